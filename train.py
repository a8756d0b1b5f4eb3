"""Pretrain a GPT on packed varlen batches.

    python train.py                                   # embedded default: stdlib sources, CPU-sized model
    python train.py model=d12 data.source=... max_steps=...
    torchrun --nproc_per_node=8 train.py model=d20 ...

Restarting with the same run_dir resumes from its newest valid checkpoint. SIGTERM, SIGINT and SIGUSR1
finish the current step, save it and exit 0. Every knob is in configs/schema.py.
"""

import math
import resource
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import hydra
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from configs.schema import ConfigError, register_configs
from data import DataError, PackedLoader, prepare
from data.config import check_config as check_data_config
from eval.loss import evaluate, token_bytes
from eval.metrics import MetricsLogError, RunLogger, attention_flops, peak_flops
from eval.sample import generate
from model.attention import BACKENDS, check_backend, default_backend
from model.gpt import GPT, GPTShape, layer_windows
from model.optim import OPTIMIZERS, build_optimizers, lr_multiplier, set_lr
from run.checkpoint import (
    Checkpointer,
    CheckpointInvalid,
    CheckpointMismatch,
    Loaded,
    check_compatible,
    check_resume,
    load,
    rng_state,
    set_rng_state,
    step_of,
)
from run.determinism import configure_determinism
from run.dist import (
    DistInfo,
    average_gradients,
    barrier,
    broadcast_object,
    gather_objects,
    init_distributed,
    mean_over_ranks,
    shutdown,
)
from run.lock import RunLock, RunLocked
from run.stop import GracefulStop

register_configs()


def check_config(cfg, info: DistInfo) -> None:
    """Every check the config allows before any data, model or checkpoint work."""
    check_data_config(cfg.data)
    micro = cfg.data.tokens_per_micro_batch * info.world_size
    if cfg.total_batch_tokens <= 0 or cfg.total_batch_tokens % micro:
        raise ConfigError(
            f"total_batch_tokens={cfg.total_batch_tokens} must be a positive multiple of "
            f"data.tokens_per_micro_batch * world_size = {micro}"
        )
    for key in ("max_steps", "save_every", "eval_every", "sample_every", "log_every", "keep_last"):
        if cfg[key] < 1:
            raise ConfigError(f"{key}={cfg[key]} must be at least 1")
    if cfg.attention != "auto":
        if cfg.attention not in BACKENDS:
            raise ConfigError(f"attention={cfg.attention!r} must be auto or one of {', '.join(BACKENDS)}")
        check_backend(cfg.attention, info.device)
    if cfg.attention == "sdpa_packed" and cfg.data.tokens_per_micro_batch % cfg.data.max_seqlen:
        raise ConfigError(
            "attention=sdpa_packed cuts the buffer into rows of data.max_seqlen tokens: "
            "data.tokens_per_micro_batch must be a multiple of data.max_seqlen"
        )
    if cfg.optim.name not in OPTIMIZERS:
        raise ConfigError(f"optim.name={cfg.optim.name!r} must be one of {', '.join(OPTIMIZERS)}")
    GPTShape.from_config(cfg.model, cfg.data.vocab_size)
    layer_windows(cfg.model.window_pattern, cfg.model.short_window, cfg.model.depth)
    if cfg.wandb.mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"wandb.mode={cfg.wandb.mode!r} must be online, offline or disabled")
    if cfg.wandb.mode == "online":
        import wandb

        if not wandb.login(verify=False, prompt=False):
            raise ConfigError(
                "wandb.mode=online but no W&B credentials were found: set WANDB_API_KEY, run `wandb login`, "
                "or use wandb.mode=offline (and `wandb sync` later)"
            )


def take_lock(run_dir: Path, info: DistInfo) -> RunLock | None:
    """Rank 0 locks run_dir before anything is written to it; every rank learns whether it did."""
    lock, error = None, None
    if info.is_main:
        lock = RunLock(run_dir)
        try:
            lock.acquire()
        except RunLocked as err:
            lock, error = None, str(err)
    error = broadcast_object(error, info)
    if error is not None:
        raise RunLocked(error)
    return lock


def find_resume(cfg, checkpointer: Checkpointer, info: DistInfo) -> Loaded | None:
    """The checkpoint to continue from, verified and checked against the config: `resume=` if given,
    else the newest valid one in run_dir. Rank 0 picks it (skipping damaged ones), every rank loads it."""
    picked, error = None, None
    if info.is_main:
        try:
            for orphan in checkpointer.remove_orphans():
                warnings.warn(f"removed {orphan}, left by a save that never finished", stacklevel=1)
            if cfg.resume:
                loaded = load(Path(cfg.resume))
                newer = [p.name for p in checkpointer.all() if step_of(p) > loaded.manifest["step"]]
                if newer:
                    raise CheckpointMismatch(
                        f"resume={cfg.resume} is at step {loaded.manifest['step']}, but run_dir already "
                        f"holds later checkpoints ({', '.join(newer)}): continuing here would mix two "
                        "histories. Use a new run_dir"
                    )
            else:
                loaded = checkpointer.latest_valid()
            if loaded is not None:
                config = OmegaConf.to_container(cfg, resolve=True)
                check_resume(loaded.manifest, config, info.world_size, loaded.path)
                picked = loaded.path
        except (CheckpointInvalid, CheckpointMismatch) as err:
            error = err
    error, picked = broadcast_object((error, picked), info)
    if error is not None:
        raise error
    if picked is None:
        return None
    return loaded if info.is_main else load(picked)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


class StepResult(NamedTuple):
    loss: torch.Tensor  # mean over micro-batches and ranks
    grad_norm: torch.Tensor  # before clipping
    attention_flops: torch.Tensor  # this rank's in-document attention FLOPs
    data_wait_s: float  # host time spent waiting for batches


def train_step(forward, model, loader, optimizers, accum: int, autocast, info: DistInfo, grad_clip: float):
    """One optimiser step over `accum` micro-batches per rank; gradients averaged over ranks."""
    loss_sum = torch.zeros((), device=info.device)
    attn_flops = torch.zeros((), device=info.device, dtype=torch.float64)
    windows = [block.attn.window for block in model.blocks]
    data_wait = 0.0
    for _ in range(accum):
        t0 = time.perf_counter()
        batch = next(loader)
        data_wait += time.perf_counter() - t0
        with autocast:
            loss = forward(
                batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen, batch.targets
            )
        (loss / accum).backward()
        loss_sum += loss.detach()
        attn_flops += attention_flops(batch.cu_seqlens, windows, model.shape.n_head, model.shape.head_dim)
    average_gradients(model.parameters(), info)
    params = list(model.parameters())
    if grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    return StepResult(mean_over_ranks(loss_sum, info) / accum, grad_norm, attn_flops, data_wait)


def train(cfg, info: DistInfo, checkpointer: Checkpointer, resume: Loaded | None, stop: GracefulStop) -> int:
    """Train to max_steps or to a stop signal; the exit code (1 if the last checkpoint failed to save)."""
    device = info.device
    torch.manual_seed(cfg.seed)
    run_dir = Path(cfg.run_dir)
    attention = default_backend(device) if cfg.attention == "auto" else cfg.attention
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    # Rank 0 tokenizes missing shards while the others wait, then every rank memory-maps them.
    if info.is_main:
        prepare(cfg.data, build=True)
    barrier(info)
    data = prepare(cfg.data, build=False)

    def make_loader(split: str, infinite: bool) -> PackedLoader:
        return PackedLoader(
            data,
            cfg.data,
            split=split,
            rank=info.rank,
            world_size=info.world_size,
            seed=cfg.seed,
            device=device,
            infinite=infinite,
        )

    loader = make_loader("train", infinite=True)

    model = GPT(cfg.model, data.vocab_size, attention, cfg.data.max_seqlen).to(device)
    optimizers = build_optimizers(model, cfg.optim)
    shape = asdict(model.shape)

    step, tokens_seen, wandb_id = 0, 0, None
    if resume is not None:
        check_compatible(resume, shape, data.tokenizer_id)
        state = resume.state
        model.load_state_dict(state["model"])
        for opt, opt_state in zip(optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
        loader.load_state_dict(state["loaders"][info.rank])
        set_rng_state(state["rng"][info.rank])
        step, tokens_seen, wandb_id = state["step"], state["tokens_seen"], state["wandb_id"]
        if info.is_main:
            print(f"resumed from {resume.path} at step {step}", flush=True)
        resume.state = None  # free the host copy

    logger = RunLogger(cfg, run_dir, step, wandb_id, enabled=info.is_main)
    forward = torch.compile(model, fullgraph=True, dynamic=False) if cfg.compile else model
    # Evaluation compiles too: eager FlexAttention would materialise the [T, T] scores.
    token_losses = (
        torch.compile(model.token_losses, fullgraph=True, dynamic=False)
        if cfg.compile
        else model.token_losses
    )
    byte_lengths = token_bytes(data.tokenizer, data.vocab_size)
    accum = cfg.total_batch_tokens // (cfg.data.tokens_per_micro_batch * info.world_size)
    peak = peak_flops(device)
    flops_matmul = 6 * model.matmul_params() * cfg.total_batch_tokens
    about = {
        "config": OmegaConf.to_container(cfg, resolve=True),
        "world_size": info.world_size,
        "shape": shape,
        "tokenizer_id": data.tokenizer_id,
    }

    def save() -> bool:
        loaders, rngs = gather_objects(loader.state_dict(), info), gather_objects(rng_state(), info)
        path = None
        if info.is_main:
            state = {
                "step": step,
                "tokens_seen": tokens_seen,
                "model": model.state_dict(),
                "optimizers": [opt.state_dict() for opt in optimizers],
                "loaders": loaders,
                "rng": rngs,
                "wandb_id": logger.wandb_id,
            }
            path = checkpointer.save(step, state, about)
        return broadcast_object(path, info) is not None

    if info.is_main:
        print(
            f"model: {shape} | {model.matmul_params() / 1e6:.2f}M matmul params | attention={attention} | "
            f"device={device} x{info.world_size} | grad accumulation {accum} | "
            f"deterministic={cfg.deterministic}",
            flush=True,
        )
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not info.is_main, dynamic_ncols=True, mininterval=1)
    saved = True
    stop.arm()
    while step < cfg.max_steps:
        t0 = time.perf_counter()
        lr_mult = lr_multiplier(step, cfg.max_steps, cfg.optim)
        set_lr(optimizers, lr_mult)
        result = train_step(forward, model, loader, optimizers, accum, autocast, info, cfg.optim.grad_clip)
        step += 1
        tokens_seen += cfg.total_batch_tokens

        record = {"step": step, "loss": result.loss.item()}
        dt = time.perf_counter() - t0
        step_flops = flops_matmul + result.attention_flops.item() * info.world_size
        packing = loader.stats()
        record.update(
            {
                "lr_mult": lr_mult,
                "lr": optimizers[0].param_groups[0]["lr"],
                "grad_norm": result.grad_norm.item(),
                "tokens_seen": tokens_seen,
                "tokens_per_s": cfg.total_batch_tokens / dt,
                "step_time_s": dt,
                "data_wait_s": result.data_wait_s,
                "mfu": step_flops / dt / (peak * info.world_size) if peak else None,
                "peak_mem_gb": peak_memory_gb(device),
                "packing_efficiency": packing["packing_efficiency"],
                "crop_share": packing["crop_share"],
                "overflow": packing["overflow"],
            }
        )
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            val = make_loader("val", infinite=False)
            with autocast:
                record.update(
                    evaluate(
                        token_losses, val, byte_lengths, max(1, cfg.eval_tokens // info.world_size), info
                    )
                )
            val.close()
            if info.is_main:
                bar.write(f"step {step}: val loss {record['val_loss']:.4f}, val bpb {record['val_bpb']:.4f}")
        if info.is_main and (step % cfg.sample_every == 0 or step == cfg.max_steps):
            with autocast:
                record["sample"] = generate(
                    model,
                    data.tokenizer,
                    data.bos_id,
                    cfg.sample_prompt,
                    cfg.sample_tokens,
                    seed=cfg.seed + step,
                )
            bar.write(f"step {step} sample: {record['sample']!r}")
        logger.log(record)
        if step % cfg.log_every == 0:
            bar.set_postfix(
                loss=f"{record['loss']:.4f}",
                lr=f"{lr_mult:.2f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                mfu="-" if record["mfu"] is None else f"{record['mfu']:.1%}",
                refresh=False,
            )
        bar.update(1)
        if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"loss is {record['loss']} at step {step}")
        stopping = stop.requested()
        if step % cfg.save_every == 0 or step == cfg.max_steps or stopping:
            saved = save()
        if stopping:
            if info.is_main:
                outcome = f"checkpoint {checkpointer.path(step)} written" if saved else "its save FAILED"
                bar.write(f"stopped by {stop.name} after step {step}: {outcome}")
            break
    bar.close()
    loader.close()
    logger.close()
    return 0 if saved else 1


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg) -> None:
    warnings.formatwarning = lambda message, *args, **kwargs: f"warning: {message}\n"
    info, lock = None, None
    try:
        info = init_distributed(cfg.device)
        with GracefulStop(info) as stop:
            check_config(cfg, info)
            configure_determinism(cfg.deterministic)  # before any CUDA product: it sets cuBLAS's workspace
            lock = take_lock(Path(cfg.run_dir), info)
            checkpointer = Checkpointer(cfg.run_dir, cfg.keep_last)
            resume = find_resume(cfg, checkpointer, info)
            code = train(cfg, info, checkpointer, resume, stop)
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
