"""Checkpoints of a run: one file per save, `run_dir/checkpoints/step_NNNNNN.pt`.

A checkpoint holds everything an exact resume needs: model and optimiser states, every rank's data
loader and RNG states, the step, tokens seen, the config, the wandb run id, and the model shape and
tokenizer fingerprint it was trained with. Weights are replicated across ranks, so rank 0 writes the
one file; the write goes to a temporary name that is renamed into place (atomic on POSIX), so a crash
mid-save leaves the previous checkpoints untouched. Only the newest `keep_last` are kept.
"""

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

_NAME = re.compile(r"^step_(\d{6,})\.pt$")


class CheckpointMismatch(ValueError):
    pass


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    def __init__(self, run_dir: str | Path, keep_last: int):
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be at least 1")
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step:06d}.pt"

    def list(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        found = [p for p in self.dir.iterdir() if _NAME.match(p.name)]
        return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))

    def latest(self) -> Path | None:
        found = self.list()
        return found[-1] if found else None

    def save(self, step: int, state: dict) -> Path:
        """Write atomically, then drop the oldest checkpoints beyond keep_last. Call on rank 0 only."""
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
        for old in self.list()[: -self.keep_last]:
            old.unlink()
        return final

    @staticmethod
    def load(path: str | Path) -> dict:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"resume={path}: no such checkpoint file")
        # Our own files hold numpy and Python RNG states next to tensors, hence weights_only=False.
        return torch.load(path, map_location="cpu", weights_only=False)


def check_compatible(state: dict, shape: dict, tokenizer_id: str, path: Path) -> None:
    """Refuse a checkpoint of another model shape or tokenizer, naming what differs."""
    if state["tokenizer_id"] != tokenizer_id:
        raise CheckpointMismatch(
            f"checkpoint {path} was trained with tokenizer {state['tokenizer_id']}, but this run's data "
            f"uses tokenizer {tokenizer_id}: use the same data.tokenizer/data.vocab_size/data.source, "
            "or a new run_dir"
        )
    if state["shape"] != shape:
        diff = ", ".join(
            f"{k}: checkpoint {state['shape'].get(k)} vs config {v}"
            for k, v in shape.items()
            if state["shape"].get(k) != v
        )
        raise CheckpointMismatch(
            f"checkpoint {path} has another model shape ({diff}): use the same model config, or a new run_dir"
        )
