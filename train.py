"""Pretrain a GPT on packed varlen batches.

    python train.py                                   # embedded default: stdlib sources, CPU-sized model
    python train.py model=d12 data.source=... max_steps=...
    torchrun --nproc_per_node=8 train.py model=d20 ...

Restarting with the same run_dir resumes from its latest checkpoint. Every knob is in configs/schema.py.
"""

import math
import resource
import sys
import time
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
from eval.loss import evaluate, token_bytes
from eval.metrics import RunLogger, attention_flops, peak_flops
from eval.sample import generate
from model.attention import BACKENDS, default_backend
from model.checkpoint import Checkpointer, CheckpointMismatch, check_compatible, rng_state, set_rng_state
from model.dist import (
    DistInfo,
    average_gradients,
    barrier,
    gather_objects,
    init_distributed,
    mean_over_ranks,
    shutdown,
)
from model.gpt import GPT
from model.optim import build_optimizers, lr_multiplier, set_lr

register_configs()


def check_config(cfg, info: DistInfo) -> None:
    """Checks that span several groups; each group's own fields are checked where they are used."""
    micro = cfg.data.tokens_per_micro_batch * info.world_size
    if cfg.total_batch_tokens <= 0 or cfg.total_batch_tokens % micro:
        raise ConfigError(
            f"total_batch_tokens={cfg.total_batch_tokens} must be a positive multiple of "
            f"data.tokens_per_micro_batch * world_size = {micro}"
        )
    for key in ("max_steps", "save_every", "eval_every", "sample_every", "log_every"):
        if cfg[key] < 1:
            raise ConfigError(f"{key}={cfg[key]} must be at least 1")
    if cfg.attention != "auto" and cfg.attention not in BACKENDS:
        raise ConfigError(f"attention={cfg.attention!r} must be auto or one of {', '.join(BACKENDS)}")
    if cfg.wandb.mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"wandb.mode={cfg.wandb.mode!r} must be online, offline or disabled")
    if cfg.attention == "sdpa_packed" and cfg.data.tokens_per_micro_batch % cfg.data.max_seqlen:
        raise ConfigError(
            "attention=sdpa_packed cuts the buffer into rows of data.max_seqlen tokens: "
            "data.tokens_per_micro_batch must be a multiple of data.max_seqlen"
        )


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


def train(cfg, info: DistInfo) -> None:
    check_config(cfg, info)
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

    checkpointer = Checkpointer(run_dir, cfg.keep_last)
    resume = Path(cfg.resume) if cfg.resume else checkpointer.latest()
    step, tokens_seen, wandb_id = 0, 0, None
    if resume is not None:
        state = Checkpointer.load(resume)
        check_compatible(state, shape, data.tokenizer_id, resume)
        model.load_state_dict(state["model"])
        for opt, opt_state in zip(optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
        if len(state["loaders"]) != info.world_size:
            raise CheckpointMismatch(
                f"checkpoint {resume} was written by {len(state['loaders'])} ranks; "
                f"an exact resume needs the same number, not {info.world_size}"
            )
        loader.load_state_dict(state["loaders"][info.rank])
        set_rng_state(state["rng"][info.rank])
        step, tokens_seen, wandb_id = state["step"], state["tokens_seen"], state["wandb_id"]
        if info.is_main:
            print(f"resumed from {resume} at step {step}", flush=True)

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

    def save() -> None:
        loaders, rngs = gather_objects(loader.state_dict(), info), gather_objects(rng_state(), info)
        if info.is_main:
            checkpointer.save(
                step,
                {
                    "step": step,
                    "tokens_seen": tokens_seen,
                    "model": model.state_dict(),
                    "optimizers": [opt.state_dict() for opt in optimizers],
                    "loaders": loaders,
                    "rng": rngs,
                    "config": OmegaConf.to_container(cfg, resolve=True),
                    "wandb_id": logger.wandb_id,
                    "shape": shape,
                    "tokenizer_id": data.tokenizer_id,
                },
            )
        barrier(info)

    if info.is_main:
        print(
            f"model: {shape} | {model.matmul_params() / 1e6:.2f}M matmul params | attention={attention} | "
            f"device={device} x{info.world_size} | grad accumulation {accum}",
            flush=True,
        )
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not info.is_main, dynamic_ncols=True, mininterval=1)
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
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            save()
    bar.close()
    loader.close()
    logger.close()


@hydra.main(version_base=None, config_path="configs", config_name="config")
def main(cfg) -> None:
    info = None
    try:
        info = init_distributed(cfg.device)
        train(cfg, info)
    except (ConfigError, DataError, CheckpointMismatch) as err:
        sys.exit(f"error: {err}")
    finally:
        if info is not None:
            shutdown(info)


if __name__ == "__main__":
    main()
