"""How the ranks share a step (`parallel=`), on torch.distributed's own engine: `parallelize` wraps the model
and gives the loop its functions; `model_state` and `load_model_state` move the model and optimisers in and
out of checkpoints by parameter name, whatever the mode and the number of ranks.

- `ddp`: DistributedDataParallel around the whole model, compiled as one graph. Dynamo's DDP optimiser
  splits that graph's backward at DDP's bucket boundaries, so each bucket's all-reduce runs while the
  backward goes on. Accumulation micro-steps before the last run under `no_sync`: one all-reduce of each
  gradient per optimiser step. With one rank the model is used as it is.
- `fsdp`: FSDP2 (`fully_shard`) on each block, then on the root (embedding and head): every parameter, its
  gradient and its optimiser state are sharded over the ranks along their first dimension; a block's
  weights are all-gathered for its forward (and, with `reshard_after_forward`, again for its backward), its
  gradients reduce-scattered after its backward, on every micro-step. On CUDA the gathered weights are bf16
  and gradients are reduced in fp32; the fp32 shards are the master weights. Each block is compiled on its
  own (FSDP2's hooks run between blocks), and the embedding, final norm and loss run eagerly around them.
  It runs with one rank too (a process group of one), which is how a single GPU measures it.
"""

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel

from configs.schema import ConfigError
from run.dist import DistInfo

PARALLEL_MODES = ("ddp", "fsdp")


def check_mode(mode: str) -> None:
    if mode not in PARALLEL_MODES:
        raise ConfigError(f"parallel={mode!r} must be one of {', '.join(PARALLEL_MODES)}")


def compiled(fn):
    """One graph, never recompiled: every batch has the same shapes (see data/loader.py)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


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


def parallelize(model: nn.Module, mode: str, info: DistInfo, compile: bool, reshard_after_forward: bool):
    """Wrap `model` (on its device, the same weights on every rank) for `mode`."""
    check_mode(mode)
    wrap = compiled if compile else (lambda fn: fn)
    if mode == "ddp":
        if not info.enabled:
            return Parallel(mode, model, wrap(model), wrap(model.token_losses))
        # DDP around the compiled model: its hooks run eagerly, and the graph, compiled inside DDP's forward,
        # is split at the buckets by dynamo's DDP optimiser. (Compiling DDP itself fails with fullgraph:
        # dynamo cannot trace DDP's bucket bookkeeping.)
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        ddp = DistributedDataParallel(wrap(model), device_ids=device_ids)
        return Parallel(mode, model, ddp, wrap(model.token_losses), ddp)
    cuda = info.device.type == "cuda"
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if cuda else None, reduce_dtype=torch.float32 if cuda else None
    )
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    for block in model.blocks:
        if compile:
            block.compile(fullgraph=True, dynamic=False)  # in place: parameter names stay as they are
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    register_fsdp_forward_method(model, "token_losses")  # it gathers the root's weights as forward does
    return Parallel(mode, model, model, model.token_losses)


def model_state(model: nn.Module, optimizers: list) -> dict:
    """The model and optimiser states by parameter name, as this rank holds them (DTensor shards under
    fsdp): what a checkpoint saves and fills on load."""
    weights, optim = get_state_dict(model, optimizers)
    return {"model": weights, "optimizers": optim}


def load_model_state(model: nn.Module, optimizers: list, state: dict) -> None:
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizers"])
