"""Checkpoints of a run: one folder per save, `run_dir/checkpoints/step_NNNNNN/`.

A checkpoint folder holds `state.pt` (model and optimiser states, every rank's data loader and RNG
states, the step, tokens seen, the wandb run id) and `manifest.json`: the format, the step, what the
run was (config, world size, model shape, tokenizer) and the size and sha256 of every other file. What
a resume must check is in the manifest, so it is checked before any data or model work.

Integrity:
- A save writes a temporary folder (`.step_NNNNNN.tmp-<pid>`), hashing `state.pt` while it is written,
  writes the manifest last, fsyncs, and renames the folder into place: a crash mid-save never touches
  the earlier checkpoints. Temporary folders of a dead run are removed at the next start.
- Before writing, the free space is checked against the state's size. A save that cannot be written
  (too little space, ENOSPC or any other OS error mid-write) is abandoned with a warning, its temporary
  folder removed, and training goes on: the next save tries again.
- Loading verifies every file's size and sha256. Picking the checkpoint to resume from walks back from
  the newest past damaged ones, each renamed to `step_NNNNNN.damaged` (nothing is deleted) with a
  warning naming it and why, to the newest valid one.
- Only the newest `keep_last` checkpoints are kept; the one just written is always among them.
"""

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FORMAT = "varlen-gpt-checkpoint/1"
STATE = "state.pt"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step_(\d{6,})$")
_TEMPORARY = re.compile(r"^\.step_\d{6,}\.tmp-\d+$")
_READ_CHUNK = 16 << 20


class CheckpointMismatch(ValueError):
    """A valid checkpoint that this run's config cannot continue; the message names the difference."""


class CheckpointInvalid(ValueError):
    """A path that is not a checkpoint, or a damaged one; the message names the path and why."""


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


def step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _state_bytes(obj) -> int:
    """Bytes of the tensors in a nested state: what torch.save writes, less a little metadata."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


class _HashingWriter:
    """A file wrapper that hashes what torch.save writes, so the file is never read back to hash it."""

    def __init__(self, f):
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            self.f.write(data)
        except OSError as err:
            self.error = err  # torch.save reports it as a RuntimeError of its zip writer
            raise
        self.sha256.update(data)
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        self.f.flush()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(path: Path) -> dict:
    """The manifest of checkpoint folder `path`, checked for form; CheckpointInvalid if it is not one."""
    if path.is_file():
        raise CheckpointInvalid(
            f"{path} is not a checkpoint: a checkpoint is a step_NNNNNN folder holding {MANIFEST} and {STATE}"
        )
    if not path.is_dir():
        raise CheckpointInvalid(f"{path} does not exist")
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CheckpointInvalid(f"{path} is not a checkpoint: it has no {MANIFEST}") from None
    except (OSError, ValueError) as err:
        raise CheckpointInvalid(f"{path / MANIFEST} is unreadable ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointInvalid(f"{path / MANIFEST} is not a {FORMAT} manifest")
    return manifest


def verify(path: Path) -> dict:
    """Check every file of checkpoint folder `path` against its manifest; returns the manifest."""
    manifest = read_manifest(path)
    for name, expected in manifest["files"].items():
        file = path / name
        try:
            size = file.stat().st_size
        except OSError as err:
            raise CheckpointInvalid(f"{file} is missing or unreadable ({err})") from None
        if size != expected["size"]:
            raise CheckpointInvalid(
                f"{file} is {size} bytes, its manifest says {expected['size']} (truncated?)"
            )
        try:
            digest = _sha256(file)
        except OSError as err:
            raise CheckpointInvalid(f"{file} is unreadable ({err})") from None
        if digest != expected["sha256"]:
            raise CheckpointInvalid(f"{file} does not match its checksum in {MANIFEST} (corrupted)")
    return manifest


@dataclass
class Loaded:
    path: Path
    manifest: dict
    state: dict


def load(path: Path) -> Loaded:
    """Verify, then load, checkpoint folder `path` onto the CPU."""
    manifest = verify(path)
    try:
        # Our own files hold numpy and Python RNG states next to tensors, hence weights_only=False.
        state = torch.load(path / STATE, map_location="cpu", weights_only=False)
    except Exception as err:  # a file that hashes right but does not unpickle: damaged all the same
        raise CheckpointInvalid(f"{path / STATE} does not load ({type(err).__name__}: {err})") from None
    return Loaded(path, manifest, state)


class Checkpointer:
    """The checkpoints of one run_dir. Writing methods are for rank 0, under the run lock."""

    def __init__(self, run_dir: str | Path, keep_last: int):
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be at least 1")
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step:06d}"

    def all(self) -> list[Path]:
        """Checkpoint folders, oldest first (damaged ones renamed away are not listed)."""
        if not self.dir.is_dir():
            return []
        return sorted((p for p in self.dir.iterdir() if _NAME.match(p.name)), key=step_of)

    def remove_orphans(self) -> list[Path]:
        """Remove temporary folders left by saves that never finished (only while holding the run lock)."""
        if not self.dir.is_dir():
            return []
        orphans = [p for p in self.dir.iterdir() if _TEMPORARY.match(p.name)]
        for p in orphans:
            shutil.rmtree(p, ignore_errors=True)
        return orphans

    def latest_valid(self) -> Loaded | None:
        """The newest checkpoint that verifies and loads. Damaged newer ones are renamed `*.damaged`
        with a warning naming each and why; nothing is deleted."""
        for path in reversed(self.all()):
            try:
                return load(path)
            except CheckpointInvalid as err:
                aside = path.with_name(path.name + ".damaged")
                os.replace(path, aside)
                warnings.warn(
                    f"checkpoint {path} is damaged and was skipped: {err}. It is kept as {aside}",
                    stacklevel=2,
                )
        return None

    def save(self, step: int, state: dict, about: dict) -> Path | None:
        """Write checkpoint `step` atomically and prune to keep_last. `about` (config, world size, shape,
        tokenizer) goes into the manifest. Returns None, with a warning, when it could not be written."""
        final = self.path(step)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            need = int(_state_bytes(state) * 1.02) + (1 << 20)
            free = shutil.disk_usage(self.dir).free
            if free < need:
                warnings.warn(
                    f"checkpoint {final} not written: it needs about {_size(need)} and only "
                    f"{_size(free)} are free in {self.dir}. Training goes on; "
                    "the next save tries again",
                    stacklevel=2,
                )
                return None
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            with open(tmp / STATE, "wb") as f:
                writer = _HashingWriter(f)
                try:
                    torch.save(state, writer)
                except RuntimeError:
                    if writer.error is None:
                        raise
                    raise writer.error from None
                f.flush()
                os.fsync(f.fileno())
            manifest = {
                "format": FORMAT,
                "step": step,
                **about,
                "files": {STATE: {"size": writer.size, "sha256": writer.sha256.hexdigest()}},
            }
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            if final.exists():  # a checkpoint of this step from an abandoned history (see check_resume)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.dir)  # make the rename itself durable
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            warnings.warn(
                f"checkpoint {final} not written ({err}). Training goes on; the next save tries again",
                stacklevel=2,
            )
            return None
        for old in [p for p in self.all() if step_of(p) <= step][: -self.keep_last]:
            shutil.rmtree(old)
        return final


# Keys a resumed run must share with its checkpoint: the model's function (every model.* key but those
# choosing an implementation of the same math), the optimiser, and what decides the data stream.
_FREE_MODEL_KEYS = {"loss_chunk_tokens", "fused_mlp", "fused_rope_norm", "fused_residual", "fp8"}
_STREAM_DATA_KEYS = (
    "source",
    "text_column",
    "hub_config",
    "hub_split",
    "hub_revision",
    "max_docs",
    "val_fraction",
    "tokenizer",
    "vocab_size",
    "tokenizer_max_chars",
    "tokens_per_micro_batch",
    "max_seqlen",
    "max_num_docs",
    "pack_window",
)


def _fixed_keys(config: dict) -> list[str]:
    model = [f"model.{k}" for k in config["model"] if k not in _FREE_MODEL_KEYS]
    return [*model, "optim.name", *(f"data.{k}" for k in _STREAM_DATA_KEYS), "seed"]


def _get(config: dict, key: str):
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def check_resume(manifest: dict, config: dict, world_size: int, path: Path) -> None:
    """Refuse to resume checkpoint `path` with a config that would not continue its run, naming every
    difference: the model's architecture, the optimiser, the data stream, the seed, the world size."""
    saved = manifest["config"]
    diffs = [
        f"{key}: checkpoint {_get(saved, key)!r} vs config {_get(config, key)!r}"
        for key in _fixed_keys(config)
        if _get(saved, key) != _get(config, key)
    ]
    if manifest["world_size"] != world_size:
        diffs.append(
            f"world size: checkpoint {manifest['world_size']} ranks vs {world_size} now "
            "(an exact resume replays every rank's data stream)"
        )
    if diffs:
        raise CheckpointMismatch(
            f"checkpoint {path} cannot be continued by this config: {'; '.join(diffs)}. "
            "Use the checkpoint's values, or a new run_dir"
        )


def check_compatible(loaded: Loaded, shape: dict, tokenizer_id: str) -> None:
    """Refuse a checkpoint of another model shape or tokenizer, naming what differs (the shape is derived
    from the config, the tokenizer from the prepared data: both are checked once they exist)."""
    manifest = loaded.manifest
    if manifest["tokenizer_id"] != tokenizer_id:
        raise CheckpointMismatch(
            f"checkpoint {loaded.path} was trained with tokenizer {manifest['tokenizer_id']}, but this run's "
            f"data uses tokenizer {tokenizer_id}: use the same data.tokenizer/data.vocab_size/data.source, "
            "or a new run_dir"
        )
    if manifest["shape"] != shape:
        diff = ", ".join(
            f"{k}: checkpoint {manifest['shape'].get(k)} vs config {v}"
            for k, v in shape.items()
            if manifest["shape"].get(k) != v
        )
        raise CheckpointMismatch(
            f"checkpoint {loaded.path} has another model shape ({diff}): use the same model config, "
            "or a new run_dir"
        )
