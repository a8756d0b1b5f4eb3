"""How the ranks share a step (`parallel=`), on torch.distributed's own engine: `parallelize` wraps the model
and gives the loop its functions; `model_state` and `load_model_state` move the model and optimisers in and
out of checkpoints by parameter name, whatever the mode and the number of ranks.

- `ddp`: DistributedDataParallel around the whole model, compiled as one graph. Dynamo's DDP optimiser
  splits that graph's backward at DDP's bucket boundaries, so each bucket's gradients are all-reduced
  (each on its own: `all_reduce_each_gradient`) while the backward goes on. Accumulation micro-steps
  before the last run under `no_sync`: one all-reduce of each gradient per optimiser step. With one rank
  the model is used as it is.
- `zero`: as `ddp` for the model and its gradients; each optimiser is a ZeroRedundancyOptimizer
  (model/optim.py), so each rank keeps the optimiser states of its own whole parameters (about 1/N of them,
  balanced by size), steps those, and broadcasts them to the other ranks. Checkpoints hold the same
  optimiser state by parameter name as `ddp`'s, each rank writing its parameters' part. With one rank there
  is nothing to shard: the optimisers are the plain ones (`shards_optimizers`), and `zero` is `ddp`.
- `fsdp`: FSDP2 (`fully_shard`) on each block, then on the root (embedding and head): every parameter, its
  gradient and its optimiser state are sharded over the ranks along their first dimension; a block's
  weights are all-gathered for its forward (and, with `reshard_after_forward`, again for its backward), its
  gradients reduce-scattered after its backward, on every micro-step. On CUDA the gathered weights are bf16
  and gradients are reduced in fp32; the fp32 shards are the master weights. Each block's forward is
  compiled on its own (`compile_blocks`), and FSDP2's hooks, the embedding, the final norm and the loss
  run eagerly around them.
  It runs with one rank too (a process group of one), which is how a single GPU measures it.
"""

import functools
import types
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from configs.schema import ConfigError
from run.dist import DistInfo

PARALLEL_MODES = ("ddp", "zero", "fsdp")


def check_mode(mode: str) -> None:
    if mode not in PARALLEL_MODES:
        raise ConfigError(f"parallel={mode!r} must be one of {', '.join(PARALLEL_MODES)}")


def needs_group_of_one(mode: str) -> bool:
    """Whether one process needs a process group of its own: FSDP2 does; `zero` alone is the plain run."""
    return mode == "fsdp"


def shards_optimizers(mode: str, info: DistInfo) -> bool:
    """ZeroRedundancyOptimizers or not: `zero` on several ranks (one rank has nothing to shard)."""
    return mode == "zero" and info.world_size > 1


def compiled(fn):
    """One graph, never recompiled: every batch has the same shapes (see data/loader.py)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


def _block_forward(block: nn.Module, *args, **kwargs):
    return type(block).forward(block, *args, **kwargs)


def compile_blocks(blocks: nn.ModuleList) -> None:
    """Compile each block's forward; FSDP2's hooks run eagerly around it. Dynamo keeps its graphs on the
    compiled function's code and guards on the grad mode and on the block's attention window, so a single
    function would recompile at the first evaluation and at the first block of another window. Each
    (grad mode, window) gets a copy of the function of its own, compiled once for the blocks that share it."""
    graphs = {}

    def graph(grad: bool, window: int):
        if (grad, window) not in graphs:
            name = f"block_{'train' if grad else 'eval'}_window_{window if window >= 0 else 'full'}"
            code = _block_forward.__code__.replace(co_name=name, co_qualname=name)
            graphs[grad, window] = compiled(types.FunctionType(code, _block_forward.__globals__, name))
        return graphs[grad, window]

    for block in blocks:
        block.forward = functools.partial(_dispatch, block, graph)


def _dispatch(block: nn.Module, graph, *args, **kwargs):
    return graph(torch.is_grad_enabled(), block.attn.window)(block, *args, **kwargs)


@dataclass
class Parallel:
    mode: str
    model: nn.Module  # the GPT whose parameters the optimisers hold (sharded under fsdp)
    forward: Callable  # the training loss of a micro-batch
    token_losses: Callable  # per-token losses, for evaluation
    ddp: DistributedDataParallel | None = None

    def micro_step(self, last: bool):
        """The context of one micro-step: DDP's gradient all-reduce waits for the last one."""
        return self.ddp.no_sync() if self.ddp is not None and not last else nullcontext()

    def sampling(self):
        """Sampling feeds every length up to sample_tokens: run the compiled blocks eagerly for it."""
        return torch.compiler.set_stance("force_eager") if self.mode == "fsdp" else nullcontext()


def all_reduce_each_gradient(group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: the mean over the ranks of each gradient of the bucket, one all-reduce per
    parameter, where DDP's own hook reduces the bucket's flat buffer. On three ranks or more, the order in
    which an element's terms are summed depends on where the element sits in the tensor reduced, and DDP
    reduces the first step after it is built in one bucket, then regroups the gradients in the order the
    backward made them: reduced bucket by bucket, a resumed run's first step would not hold the
    uninterrupted run's bits. Reduced parameter by parameter, an element's place is its place in its
    parameter. The buckets still decide when the all-reduces start, so they overlap the backward as
    before."""
    bucket.buffer().div_(dist.get_world_size(group))  # one kernel for the bucket's gradients, its views
    works = [dist.all_reduce(grad, group=group, async_op=True) for grad in bucket.gradients()]
    if bucket.buffer().is_cuda:
        # NCCL runs a group's collectives in order on one stream, so the last one's future stands for all,
        # and it is CUDA-aware: DDP reads the buffer on a stream that waits for it. collect_all's future
        # knows no streams, and DDP would read the buffer while the all-reduces still wrote it.
        done = works[-1].get_future()
    else:
        done = torch.futures.collect_all([work.get_future() for work in works])
    return done.then(lambda _: bucket.buffer())


def parallelize(
    model: nn.Module,
    mode: str,
    info: DistInfo,
    compile: bool,
    reshard_after_forward: bool,
    ddp_bucket_mb: float | None = None,
):
    """Wrap `model` (on its device, the same weights on every rank) for `mode`; `reshard_after_forward` and
    `ddp_bucket_mb` as the config's keys of those names (None: DDP's default)."""
    check_mode(mode)
    wrap = compiled if compile else (lambda fn: fn)
    if mode in ("ddp", "zero"):
        if not info.enabled:
            return Parallel(mode, model, wrap(model), wrap(model.token_losses))
        # DDP around the compiled model: its hooks run eagerly, and the graph, compiled inside DDP's forward,
        # is split at the buckets by dynamo's DDP optimiser. (Compiling DDP itself fails with fullgraph:
        # dynamo cannot trace DDP's bucket bookkeeping.)
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        # The gradients are views into DDP's buckets rather than a second copy beside them: one fp32
        # gradient of the model less per rank, with the same arithmetic.
        ddp = DistributedDataParallel(
            wrap(model), device_ids=device_ids, gradient_as_bucket_view=True, bucket_cap_mb=ddp_bucket_mb
        )
        ddp.register_comm_hook(None, all_reduce_each_gradient)
        return Parallel(mode, model, ddp, wrap(model.token_losses), ddp)
    cuda = info.device.type == "cuda"
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=torch.float32 if cuda else None
    )
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    if compile:
        compile_blocks(model.blocks)  # in place: parameter names stay as they are
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        # The backward starts with the last block: freeing its gathered weights would only gather them again.
        reshard = reshard_after_forward and i < last
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    for method in ("token_losses", "prefill", "decode"):  # they gather the root's weights as forward does
        register_fsdp_forward_method(model, method)
    return Parallel(mode, model, model, model.token_losses)


def model_state(model: nn.Module, optimizers: list) -> dict:
    """The model and optimiser states by parameter name, as this rank holds them (DTensor shards under
    fsdp; under zero, the states of this rank's parameters only): what a checkpoint saves and fills on
    load."""
    if not _zero(optimizers):
        weights, optim = get_state_dict(model, optimizers)
        return {"model": weights, "optimizers": optim}
    weights, optim = get_state_dict(model, [opt.optim for opt in optimizers])
    # The param groups as ddp writes them (every parameter's name, the same on every rank): each rank's own
    # lists would differ, and a checkpoint keeps one copy of what ranks share.
    names = {param: name for name, param in model.named_parameters()}
    optim["param_groups"] = [
        {**_hyper(local), **_hyper(whole), "params": [names[p] for p in whole["params"]]}
        for opt in optimizers
        for whole, local in zip(opt.param_groups, opt.optim.param_groups, strict=True)
    ]
    return {"model": weights, "optimizers": optim}


def load_model_state(model: nn.Module, optimizers: list, state: dict) -> None:
    if not _zero(optimizers):
        set_state_dict(
            model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizers"]
        )
        return
    set_model_state_dict(model, state["model"])
    saved = state["optimizers"]
    names = {param: name for name, param in model.named_parameters()}
    groups = {tuple(group["params"]): group for group in saved["param_groups"]}
    for opt in optimizers:
        local = {"state": {}, "param_groups": []}
        for whole, mine in zip(opt.param_groups, opt.optim.param_groups, strict=True):
            group = groups[tuple(names[p] for p in whole["params"])]
            ids = range(len(local["state"]), len(local["state"]) + len(mine["params"]))
            local["state"].update(
                {i: saved["state"][names[p]] for i, p in zip(ids, mine["params"], strict=True)}
            )
            local["param_groups"].append({**_hyper(group), "params": list(ids)})
            whole.update(_hyper(group))
        opt.optim.load_state_dict(local)


def _zero(optimizers: list) -> bool:
    return any(isinstance(opt, ZeroRedundancyOptimizer) for opt in optimizers)


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}
