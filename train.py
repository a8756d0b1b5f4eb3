"""Pretrain a GPT on packed varlen batches.

    python train.py                                   # embedded default: stdlib sources, CPU-sized model
    python train.py model=d12 data.source=... max_steps=...
    torchrun --nproc_per_node=8 train.py model=d20 ...

Restarting with the same run_dir resumes from its newest valid checkpoint. SIGTERM, SIGINT and SIGUSR1
finish the current step, save it and exit 0. Every knob is in configs/schema.py.

`main` checks the config, takes the lock and finds the checkpoint (run/preflight.py) before any work;
`set_up` builds the data, model and optimisers and restores the checkpoint; `train` is the loop, with the
step's bookkeeping in the small functions after it.
"""

import math
import resource
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple

import hydra
import torch
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor

from configs.schema import ConfigError, register_configs
from data import DataError, PackedLoader, Prepared, prepare
from eval.core import CORE_TASKS, evaluate_core, load_for_run, missing_core_tasks
from eval.loss import evaluate, token_bytes
from eval.metrics import MetricsLogError, Progress, RunLogger, attention_flops, peak_flops
from eval.sample import generate
from model.attention import default_backend
from model.gpt import GPT
from model.optim import build_optimizers, lr_multiplier, set_lr
from run.checkpoint import (
    Checkpointer,
    CheckpointInvalid,
    CheckpointMismatch,
    Loaded,
    check_compatible,
    read_tensors,
    rng_state,
    set_rng_state,
)
from run.determinism import configure_determinism
from run.dist import (
    DistInfo,
    from_rank0,
    gather_objects,
    init_distributed,
    mean_over_ranks,
    shutdown,
    wait_for_rank0,
)
from run.lock import RunLocked
from run.parallel import (
    Parallel,
    load_model_state,
    model_state,
    needs_group_of_one,
    parallelize,
    shards_optimizers,
)
from run.preflight import check_config, find_resume, take_lock
from run.profiling import StepProfiler
from run.stop import GracefulStop

register_configs()


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


class StepResult(NamedTuple):
    loss: torch.Tensor  # mean over micro-batches and ranks
    grad_norm: torch.Tensor  # before clipping
    attention_flops: torch.Tensor  # this rank's in-document attention FLOPs
    data_wait_s: float  # host time spent waiting for batches


def train_step(
    parallel: Parallel, loader, optimizers, accum: int, autocast, info: DistInfo, grad_clip: float
):
    """One optimiser step over `accum` micro-batches per rank; gradients averaged over ranks by the
    parallel mode."""
    model = parallel.model
    loss_sum = torch.zeros((), device=info.device)
    attn_flops = torch.zeros((), device=info.device, dtype=torch.float64)
    windows = [block.attn.window for block in model.blocks]
    data_wait = 0.0
    for i in range(accum):
        t0 = time.perf_counter()
        batch = next(loader)
        data_wait += time.perf_counter() - t0
        with parallel.micro_step(last=i == accum - 1), autocast:
            loss = parallel.forward(
                batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen, batch.targets
            )
            (loss / accum).backward()
        loss_sum += loss.detach()
        attn_flops += attention_flops(batch.cu_seqlens, windows, model.shape.n_head, model.shape.head_dim)
    params = list(model.parameters())
    # Without clipping, an infinite bound: the same norm, and nothing scaled.
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf)
    if isinstance(grad_norm, DTensor):  # fsdp: the norm over every rank's shards
        grad_norm = grad_norm.full_tensor()
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    return StepResult(mean_over_ranks(loss_sum, info) / accum, grad_norm, attn_flops, data_wait)


@dataclass
class Training:
    """What the loop works with: built once by `set_up`, then advanced one step at a time."""

    cfg: object
    info: DistInfo
    data: Prepared
    loader: PackedLoader
    model: GPT  # sharded under parallel=fsdp
    optimizers: list
    parallel: Parallel  # the (compiled) functions the loop calls, and how ranks share them
    autocast: object
    accum: int  # micro-batches per rank and step
    byte_lengths: torch.Tensor  # UTF-8 bytes of each token, for bits per byte
    matmul_flops: int  # of one optimiser step's matrix products, all ranks (attention's vary by batch)
    peak_flops: float | None  # one GPU's dense bf16 peak, for MFU
    logger: RunLogger
    step: int = 0
    tokens_seen: int = 0


def train(cfg, info: DistInfo, checkpointer: Checkpointer, resume: Loaded | None, stop: GracefulStop) -> int:
    """Train to max_steps or to a stop signal; the exit code (1 if the last checkpoint failed to save)."""
    core_tasks = load_for_run(cfg)  # before any work: a missing or broken eval bundle stops the run here
    run = set_up(cfg, info, resume)
    progress = Progress(cfg.max_steps, run.step, cfg.log_every, enabled=info.is_main)
    clip, saved = cfg.optim.grad_clip, True
    profiler = StepProfiler(cfg.profile, cfg.run_dir, info)
    stop.arm()
    while run.step < cfg.max_steps:
        t0 = time.perf_counter()
        lr_mult = lr_multiplier(run.step, cfg.max_steps, cfg.optim)
        set_lr(run.optimizers, lr_mult)
        with profiler.step(run.step + 1):
            result = train_step(run.parallel, run.loader, run.optimizers, run.accum, run.autocast, info, clip)
        run.step += 1
        run.tokens_seen += cfg.total_batch_tokens
        record = step_metrics(run, result, lr_mult, t0)
        if due(run.step, cfg.eval_every, cfg.max_steps):
            record.update(validate(run, progress))
        if cfg.core_every and due(run.step, cfg.core_every, cfg.max_steps):
            record.update(core(run, core_tasks, progress))
        if due(run.step, cfg.sample_every, cfg.max_steps) and (info.is_main or cfg.parallel == "fsdp"):
            record["sample"] = sample(run, progress)
        report(run, record, progress)
        stopping = stop.requested()
        if due(run.step, cfg.save_every, cfg.max_steps) or stopping:
            background = cfg.async_save and not stopping and run.step < cfg.max_steps
            saved = save(run, checkpointer, background) or background  # the last save is never background
        else:
            checkpointer.poll()  # seals a background save once written
        if stopping:
            if info.is_main:
                outcome = f"checkpoint {checkpointer.path(run.step)} written" if saved else "its save FAILED"
                progress.write(f"stopped by {stop.name} after step {run.step}: {outcome}")
            break
    profiler.close()
    progress.close()
    run.loader.close()
    run.logger.close()
    return 0 if saved else 1


def set_up(cfg, info: DistInfo, resume: Loaded | None) -> Training:
    """The data (rank 0 tokenizes missing shards while the others wait), the model and its optimisers,
    restored from `resume` where given, and the compiled functions the loop calls."""
    device = info.device
    torch.manual_seed(cfg.seed)
    attention = default_backend(device) if cfg.attention == "auto" else cfg.attention
    if info.is_main:
        prepare(cfg.data, build=True)
    wait_for_rank0(info)
    data = prepare(cfg.data, build=False)
    check_val_split(cfg, info, data)
    loader = make_loader(cfg, info, data, "train")
    model = GPT(cfg.model, data.vocab_size, attention, cfg.data.max_seqlen).to(device)
    # Evaluation compiles too: eager FlexAttention would materialise the [T, T] scores.
    parallel = parallelize(
        model, cfg.parallel, info, cfg.compile, cfg.reshard_after_forward, cfg.ddp_bucket_mb
    )
    # After sharding: they hold the sharded parameters.
    optimizers = build_optimizers(model, cfg.optim, shard=shards_optimizers(cfg.parallel, info))
    step, tokens_seen, wandb_id = 0, 0, None
    if resume is not None:
        step, tokens_seen, wandb_id = restore(resume, model, optimizers, loader, data, info)
    accum = cfg.total_batch_tokens // (cfg.data.tokens_per_micro_batch * info.world_size)
    run = Training(
        cfg=cfg,
        info=info,
        data=data,
        loader=loader,
        model=model,
        optimizers=optimizers,
        parallel=parallel,
        autocast=torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext(),
        accum=accum,
        byte_lengths=token_bytes(data.tokenizer, data.vocab_size),
        matmul_flops=6 * model.matmul_params() * cfg.total_batch_tokens,
        peak_flops=peak_flops(device),
        logger=RunLogger(cfg, Path(cfg.run_dir), step, wandb_id, enabled=info.is_main),
        step=step,
        tokens_seen=tokens_seen,
    )
    if info.is_main:
        print(
            f"model: {asdict(model.shape)} | {model.matmul_params() / 1e6:.2f}M matmul params | "
            f"attention={attention} | device={device} x{info.world_size} | parallel={cfg.parallel} | "
            f"grad accumulation {accum} | "
            f"deterministic={cfg.deterministic}",
            flush=True,
        )
    return run


def make_loader(cfg, info: DistInfo, data: Prepared, split: str) -> PackedLoader:
    """This rank's share of the split: the training stream without end, or one pass of validation."""
    return PackedLoader(
        data,
        cfg.data,
        split=split,
        rank=info.rank,
        world_size=info.world_size,
        seed=cfg.seed,
        device=info.device,
        infinite=split == "train",
    )


def check_val_split(cfg, info: DistInfo, data: Prepared) -> None:
    """Every rank evaluates whole buffers of its own (global buffer i on rank i % world_size), so the held-out
    split must pack into at least one buffer per rank: found now, not at the first evaluation."""
    val = make_loader(cfg, info, data, "val")
    buffers = val.pass_buffers(at_most=info.world_size)
    val.close()
    if buffers < info.world_size:
        raise DataError(
            f"the validation split packs into {buffers} buffer(s) of data.tokens_per_micro_batch="
            f"{cfg.data.tokens_per_micro_batch} tokens, fewer than the {info.world_size} ranks that each "
            "evaluate buffers of their own: raise data.val_fraction or use more data"
        )


def restore(resume: Loaded, model: GPT, optimizers, loader: PackedLoader, data: Prepared, info: DistInfo):
    """Load a checkpoint's model and optimisers (each rank its part, whatever the ranks and mode that wrote
    it), the data stream's position and, with the same number of ranks, each rank's RNG; (step, tokens
    seen, wandb id)."""
    check_compatible(resume, asdict(model.shape), data.tokenizer_id)
    tensors = model_state(model, optimizers)
    read_tensors(resume.path, tensors)
    load_model_state(model, optimizers, tensors)
    state = resume.run_state
    loader.load_state_dict(state["loader"])
    if len(state["rng"]) == info.world_size:
        set_rng_state(state["rng"][info.rank])
    if info.is_main:
        was = resume.manifest
        print(
            f"resumed from {resume.path} at step {state['step']} "
            f"(written by {was['world_size']} rank(s), parallel={was['parallel']})",
            flush=True,
        )
    return state["step"], state["tokens_seen"], state["wandb_id"]


def due(step: int, every: int, max_steps: int) -> bool:
    """Whether an every-N-steps event (evaluation, sample, checkpoint) falls on this step; the last step
    has them all."""
    return step % every == 0 or step == max_steps


def step_metrics(run: Training, result: StepResult, lr_mult: float, t0: float) -> dict:
    """The step's record for metrics.jsonl: loss, learning rate, speed, MFU, memory and packing."""
    cfg, info = run.cfg, run.info
    record = {"step": run.step, "loss": result.loss.item()}
    dt = time.perf_counter() - t0  # after the loss's .item(), which waits for the step's kernels
    step_flops = run.matmul_flops + result.attention_flops.item() * info.world_size
    peak = run.peak_flops
    packing = run.loader.stats()
    record.update(
        {
            "lr_mult": lr_mult,
            "lr": run.optimizers[0].param_groups[0]["lr"],
            "grad_norm": result.grad_norm.item(),
            "tokens_seen": run.tokens_seen,
            "tokens_per_s": cfg.total_batch_tokens / dt,
            "step_time_s": dt,
            "data_wait_s": result.data_wait_s,
            "mfu": step_flops / dt / (peak * info.world_size) if peak else None,
            "peak_mem_gb": peak_memory_gb(info.device),
            "packing_efficiency": packing["packing_efficiency"],
            "crop_share": packing["crop_share"],
            "overflow": packing["overflow"],
        }
    )
    return record


def validate(run: Training, progress: Progress) -> dict:
    """Validation loss and bits per byte over eval_tokens of the held-out split (a fresh pass each time)."""
    cfg, info = run.cfg, run.info
    val = make_loader(cfg, info, run.data, "val")
    with run.autocast:
        result = evaluate(run.parallel.token_losses, val, run.byte_lengths, cfg.eval_tokens, info)
    val.close()
    if info.is_main:
        progress.write(f"step {run.step}: val loss {result['val_loss']:.4f}, val bpb {result['val_bpb']:.4f}")
    return result


def core(run: Training, tasks: list, progress: Progress) -> dict:
    """The CORE metric (eval/core.py), each rank scoring its share of the items; `core` and `core/<task>`
    (centred scores) for the record."""
    with run.autocast:
        result = evaluate_core(run.model, run.data.tokenizer, tasks, run.cfg.core.batch_tokens, run.info)
    if run.info.is_main:
        missing = missing_core_tasks(result.accuracy)
        without = f" (without {len(missing)} of its {len(CORE_TASKS)} tasks)" if missing else ""
        progress.write(f"step {run.step}: CORE {result.core:.4f}{without}")
    return result.metrics()


def sample(run: Training, progress: Progress) -> str:
    """A continuation of sample_prompt, seeded by the step so that a resumed run repeats it: on rank 0, or
    under fsdp on every rank, each taking rank 0's tokens (each forward gathers the weights from all, so
    every rank must stop at the same token)."""
    cfg = run.cfg
    with run.autocast, run.parallel.sampling():
        text = generate(
            run.model,
            run.data.tokenizer,
            run.data.bos_id,
            cfg.sample_prompt,
            cfg.sample_tokens,
            seed=cfg.seed + run.step,
            agree=partial(from_rank0, info=run.info) if cfg.parallel == "fsdp" else None,
        )
    if run.info.is_main:
        progress.write(f"step {run.step} sample: {text!r}")
    return text


def report(run: Training, record: dict, progress: Progress) -> None:
    """Log the record (metrics.jsonl, wandb), show the progress, and stop on a non-finite loss."""
    run.logger.log(record)
    progress.update(record)
    if not math.isfinite(record["loss"]):
        raise FloatingPointError(f"loss is {record['loss']} at step {run.step}")


def save(run: Training, checkpointer: Checkpointer, background: bool = False) -> bool:
    """Checkpoint this step, every rank writing its part; whether it was written (False for a background
    save, which the checkpointer seals later)."""
    info = run.info
    run_state = {
        "step": run.step,
        "tokens_seen": run.tokens_seen,
        "loader": run.loader.state_dict(),  # the same on every rank: the stream's position
        "rng": gather_objects(rng_state(), info),
        "wandb_id": run.logger.wandb_id,
    }
    about = {
        "config": OmegaConf.to_container(run.cfg, resolve=True),
        "world_size": info.world_size,
        "parallel": run.cfg.parallel,
        "shape": asdict(run.model.shape),
        "tokenizer_id": run.data.tokenizer_id,
    }
    tensors = model_state(run.model, run.optimizers)
    return checkpointer.save(run.step, tensors, run_state, about, background) is not None


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg) -> None:
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    info, lock = None, None
    try:
        info = init_distributed(
            cfg.device, group_of_one=needs_group_of_one(cfg.parallel), timeout_s=cfg.dist_timeout_s
        )
        with GracefulStop(info) as stop:
            check_config(cfg, info)
            configure_determinism(cfg.deterministic)  # before any CUDA product: it sets cuBLAS's workspace
            lock = take_lock(Path(cfg.run_dir), info)
            if lock is not None:
                stop.release_on_early_exit(lock.release)
            checkpointer = Checkpointer(cfg.run_dir, cfg.keep_last, info)
            resume = find_resume(cfg, checkpointer, info)
            code = train(cfg, info, checkpointer, resume, stop)
            # No rank tears the process group down while another still uses it; rank 0 may still be
            # closing the logs (wandb's upload), which is no collective's business.
            wait_for_rank0(info)
    except (ConfigError, DataError, CheckpointMismatch, CheckpointInvalid, RunLocked, MetricsLogError) as err:
        sys.exit(f"error: {err}")
    finally:
        if lock is not None:
            lock.release()
        if info is not None:
            shutdown(info)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
