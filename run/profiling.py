"""Profiling a training run (train.py's `profile.*`, as torchtitan's profiling options): a torch.profiler
trace of one step every `profile.every` steps, and on CUDA the caching allocator's history, dumped at those
steps and when a step runs out of memory.

Files go to run_dir/profile/ (every rank writes its own): step_<N>/rank<R>.json, a Chrome trace (Perfetto,
chrome://tracing); memory_step_<N>_rank<R>.pickle and memory_oom_step_<N>_rank<R>.pickle, allocator
snapshots (pytorch.org/memory_viz, scripts/memory_peak.py). Each is written to a temporary name and renamed.
"""

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from configs.schema import ConfigError
from run.dist import DistInfo

# Allocator events kept: a ring buffer, so a long run keeps its recent past (the oldest events go first).
HISTORY_ENTRIES = 1_000_000


def write_by_name(path: Path, write) -> None:
    """write(name) writes a file at `name` (torch's exporters take a path): here to a temporary name, then
    renamed to `path`, so that no reader sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    write(str(tmp))
    os.replace(tmp, path)


def start_memory_history() -> None:
    """Record the CUDA caching allocator's history from now on, any earlier record dropped. Python stacks
    only: sites are Python frames, and C++ unwinding would slow the step and bloat the file."""
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python", clear_history=True)


def dump_memory_history(path: Path) -> None:
    write_by_name(path, torch.cuda.memory._dump_snapshot)


def stop_memory_history() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def check_profile(cfg, device: torch.device) -> None:
    """Refuse, at start-up, profile settings that cannot run."""
    if cfg.every < 0:
        raise ConfigError(f"profile.every={cfg.every} must be 0 (off) or a number of steps")
    if cfg.memory_snapshot and device.type != "cuda":
        raise ConfigError(
            f"profile.memory_snapshot=true records the CUDA caching allocator; this run is on {device.type}"
        )


class StepProfiler:
    """Wraps each training step (`with profiler.step(n):`, n the number the step will have once done)."""

    def __init__(self, cfg, run_dir: str, info: DistInfo):
        self.every, self.memory = int(cfg.every), bool(cfg.memory_snapshot)
        self.dir, self.rank, self.device = Path(run_dir) / "profile", info.rank, info.device
        if self.memory:
            start_memory_history()

    @contextmanager
    def step(self, n: int):
        if not (self.every and n % self.every == 0):
            with self._oom_snapshot(n):
                yield
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with self._oom_snapshot(n), torch.profiler.profile(activities=activities) as prof:
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the step's kernels belong to its trace
        write_by_name(self.dir / f"step_{n:06d}" / f"rank{self.rank}.json", prof.export_chrome_trace)
        if self.memory:
            self._snapshot(f"memory_step_{n:06d}")

    @contextmanager
    def _oom_snapshot(self, n: int):
        try:
            yield
        except torch.OutOfMemoryError:
            if self.memory:
                self._snapshot(f"memory_oom_step_{n:06d}")
            raise

    def _snapshot(self, name: str) -> None:
        dump_memory_history(self.dir / f"{name}_rank{self.rank}.pickle")

    def close(self) -> None:
        if self.memory:
            stop_memory_history()
