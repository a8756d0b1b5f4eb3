"""What a run reports: FLOPs and MFU, and the metrics log (run_dir/metrics.jsonl + wandb).

FLOPs of one training step, forward and backward:
    6 * (matmul parameters) per token                      (embedding lookups excluded)
  + 3.5 * 4 * D * H * (visible query-key pairs) per layer  (attention, in-document causal work only)
A causal segment of L tokens has L(L+1)/2 visible pairs (fewer with a sliding window). The forward
does two matmuls over them (QK^T and PV, 2 FLOPs per multiply-add) and the backward 2.5 times that,
the convention of flash-attn's benchmarks. MFU divides FLOPs per second by the device's dense bf16 peak.

Communication a step leaves exposed: of the time the GPU runs collective kernels (NCCL), the part during
which no other kernel runs, so that compute waits for it (`exposed_time`, over a profiled step's kernels).
"""

import json
import os
import re
import sys
import time
import warnings
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

# Dense bf16 peaks (no sparsity) of the GPUs we run on; MFU is left out elsewhere.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def device_slug(name: str) -> str:
    """The GPU's model from its CUDA name, for benchmark file names: 'NVIDIA H100 80GB HBM3' -> 'h100'."""
    models = re.findall(r"\b[A-Z]+\d{2,4}[A-Z]?\b", name)
    return (models[0] if models else name.split()[-1]).lower()


def visible_pairs(cu_seqlens: torch.Tensor, window: int) -> torch.Tensor:
    """Number of (query, key) pairs a causal, optionally windowed, attention computes, on device."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).double()
    full = lengths * (lengths + 1) / 2
    if window < 0:
        return full.sum()
    w = window + 1  # keys visible to a query once the window is full
    windowed = w * (w + 1) / 2 + (lengths - w) * w
    return torch.where(lengths <= w, full, windowed).sum()


def attention_flops(cu_seqlens: torch.Tensor, windows: list[int], n_head: int, head_dim: int) -> torch.Tensor:
    pairs = sum(visible_pairs(cu_seqlens, w) for w in windows)
    return 3.5 * 4 * head_dim * n_head * pairs


def merged(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as disjoint ones, in order."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def exposed_time(comm, compute) -> tuple[float, float]:
    """The length of the union of the `comm` intervals, and of its part that no `compute` interval covers."""
    comm, compute = merged(comm), merged(compute)
    total = sum(end - start for start, end in comm)
    covered, first = 0.0, 0
    for start, end in comm:
        while first < len(compute) and compute[first][1] <= start:
            first += 1
        i = first
        while i < len(compute) and compute[i][0] < end:
            covered += min(end, compute[i][1]) - max(start, compute[i][0])
            i += 1
    return total, total - covered


class MetricsLogError(ValueError):
    """metrics.jsonl holds something no crash leaves behind; the message names the line."""


class RunLogger:
    """Appends one JSON object per step to metrics.jsonl and mirrors it to wandb (rank 0 only).

    On resume the log is first cut back to the checkpoint's step, so steps that ran after the
    checkpoint and before the crash are neither duplicated nor missing.
    """

    def __init__(self, cfg, run_dir: Path, resume_step: int, wandb_id: str | None, enabled: bool):
        self.enabled = enabled
        self.wandb_run = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._truncate(resume_step)
        self.file = open(self.path, "a")
        if cfg.wandb.mode != "disabled":
            import wandb

            self.wandb_run = wandb.init(
                project=cfg.wandb.project,
                entity=cfg.wandb.entity,
                group=cfg.wandb.group,
                name=cfg.wandb.name,
                tags=list(cfg.wandb.tags),
                mode=cfg.wandb.mode,
                dir=str(run_dir),
                id=wandb_id,
                resume="allow",
                config=OmegaConf.to_container(cfg, resolve=True),
            )
            # Steps re-run after a resume are logged again; plotting against "step" keeps them in place.
            self.wandb_run.define_metric("step")
            self.wandb_run.define_metric("*", step_metric="step")

    @property
    def wandb_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run else None

    def _truncate(self, resume_step: int) -> None:
        """Cut the log back to `resume_step`, in place (no temporary copy: it works on a full disk).

        A torn line (a crash or a full disk mid-write) can only be the last one; it is dropped with a
        warning. Steps are in order, so the kept records are a prefix of the file.
        """
        if not self.path.exists():
            return
        keep = 0  # bytes of the prefix kept
        with open(self.path, "rb") as f:
            lines = f.read().splitlines(keepends=True)
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line) if line.endswith(b"\n") else None
            except ValueError:
                record = None
            if record is None:
                if number == len(lines):
                    warnings.warn(
                        f"{self.path}: line {number} is torn (the run stopped while writing it); dropped",
                        stacklevel=2,
                    )
                    break
                raise MetricsLogError(
                    f"{self.path}: line {number} of {len(lines)} is not a JSON record; "
                    "fix or remove it, or use a new run_dir"
                )
            if record["step"] > resume_step:
                break
            keep += len(line)
        if keep < self.path.stat().st_size:
            os.truncate(self.path, keep)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(record)

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


class Progress:
    """The run's progress on the console: a tqdm bar on a terminal; elsewhere (a scheduler's log file) one
    plain line every `log_every` steps, since a bar's carriage returns make one endless line there."""

    def __init__(
        self, total: int, initial: int, log_every: int, enabled: bool, interactive: bool | None = None
    ):
        self.total, self.step, self.log_every, self.enabled = total, initial, log_every, enabled
        self.interactive = sys.stdout.isatty() and sys.stderr.isatty() if interactive is None else interactive
        self.bar = None
        if enabled and self.interactive:
            self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, mininterval=1)
        self.start, self.start_step = time.perf_counter(), initial

    def write(self, message: str) -> None:
        if self.bar is not None:
            self.bar.write(message)
        elif self.enabled:
            print(message, flush=True)

    def update(self, record: dict) -> None:
        """After each step, with its metrics record."""
        self.step = record["step"]
        mfu = "-" if record["mfu"] is None else f"{record['mfu']:.1%}"
        if self.bar is not None:
            if self.step % self.log_every == 0:
                self.bar.set_postfix(
                    loss=f"{record['loss']:.4f}",
                    lr=f"{record['lr_mult']:.2f}",
                    tok_s=f"{record['tokens_per_s']:.0f}",
                    mfu=mfu,
                    refresh=False,
                )
            self.bar.update(1)
        elif self.enabled and (self.step % self.log_every == 0 or self.step == self.total):
            per_step = (time.perf_counter() - self.start) / (self.step - self.start_step)
            eta = int(per_step * (self.total - self.step))
            print(
                f"step {self.step}/{self.total} | loss {record['loss']:.4f} | lr {record['lr_mult']:.2f} | "
                f"{record['tokens_per_s']:,.0f} tok/s | mfu {mfu} | eta {eta // 3600}h{eta // 60 % 60:02d}m"
                f"{eta % 60:02d}s",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
