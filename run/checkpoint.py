"""Checkpoints of a run: one folder per save, `run_dir/checkpoints/step_NNNNNN/`, written by every rank.

A checkpoint folder holds the model and optimiser states in torch.distributed.checkpoint's format (DCP:
`.metadata` and one `__<rank>_0.distcp` per rank, each rank writing its own shards), `run_state.pt` (the
step, tokens seen, the data stream's position, every rank's RNG states, the wandb run id) and
`manifest.json`: the format, the step, what the run was (config, world size, parallel mode, model shape,
tokenizer) and the size and sha256 of every other file. What a resume must check is in the manifest, so it
is checked before any data or model work. DCP stores tensors by parameter name, whole: a checkpoint loads
on any number of ranks and in any parallel mode, each rank reading the pieces it holds.

Integrity:
- A save writes a temporary folder (`.step_NNNNNN.tmp-<pid>`, the pid of rank 0), every rank hashes a
  share of the files, rank 0 writes the manifest last, fsyncs, and renames the folder into place: a crash
  mid-save never touches the earlier checkpoints. Temporary folders of a dead run are removed at the next
  start.
- Before writing, the free space is checked against the state's size. A save that cannot be written
  (too little space, ENOSPC or any other error on any rank mid-write) is abandoned on every rank with a
  warning, its temporary folder removed, and training goes on: the next save tries again.
- Loading verifies every file's size and sha256. Picking the checkpoint to resume from walks back from
  the newest past damaged ones, each renamed to `step_NNNNNN.damaged` (nothing is deleted) with a
  warning naming it and why, to the newest valid one.
- Only the newest `keep_last` checkpoints are kept; the one just written is always among them.
"""

import hashlib
import io
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
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from run.dist import DistInfo, any_rank, broadcast_object, gather_objects
from run.files import fsync_dir, write_durably

FORMAT = "varlen-gpt-checkpoint/2"
RUN_STATE = "run_state.pt"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step_(\d{6,})$")
_TEMPORARY = re.compile(r"^\.step_\d{6,}\.tmp-\d+$")
_READ_CHUNK = 16 << 20
_SINGLE = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
# DCP warns whenever one process saves or loads without a process group, which is what it does here (the
# warning also comes from background saves' threads, beyond a local filter's reach).
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")


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


def _state_bytes(obj) -> int:
    """Bytes of the tensors in a nested state, whole (a sharded tensor counts once, at its full size)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()  # a DTensor's numel is its global one
    if isinstance(obj, dict):
        return sum(_state_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_state_bytes(v) for v in obj)
    return 0


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


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
            f"{path} is not a checkpoint: a checkpoint is a step_NNNNNN folder holding {MANIFEST}, "
            f"{RUN_STATE} and the model's DCP files"
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
    run_state: dict  # what run_state.pt holds; the tensors stay on disk until read_tensors


def load(path: Path, verify_files: bool = True) -> Loaded:
    """Verify checkpoint folder `path` (or, without `verify_files`, only read its manifest: another rank
    verified it) and load its run state; the tensors are read by `read_tensors`."""
    manifest = verify(path) if verify_files else read_manifest(path)
    try:
        # Our own file holds numpy and Python RNG states, hence weights_only=False.
        run_state = torch.load(path / RUN_STATE, map_location="cpu", weights_only=False)
    except Exception as err:  # a file that hashes right but does not unpickle: damaged all the same
        raise CheckpointInvalid(f"{path / RUN_STATE} does not load ({type(err).__name__}: {err})") from None
    return Loaded(path, manifest, run_state)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def read_tensors(path: Path, state: dict) -> None:
    """Fill `state` (tensors and DTensors, nested in dicts, as it was saved) in place from checkpoint
    `path`: each rank reads what its tensors hold, whatever the number of ranks that wrote it."""
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=not _distributed())


def read_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The whole model's weights of checkpoint `path` by parameter name, on the CPU, in one process."""
    reader = dcp.FileSystemReader(path)
    entries = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {key.removeprefix("model."): tensor for key, tensor in state.items()}


class Checkpointer:
    """The checkpoints of one run_dir. `save` is collective (every rank calls it); the other writing
    methods are for rank 0, under the run lock."""

    def __init__(self, run_dir: str | Path, keep_last: int, info: DistInfo = _SINGLE):
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be at least 1")
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.info = info
        self._pending, self._future, self._group = None, None, None

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

    def save(
        self, step: int, tensors: dict, run_state: dict, about: dict, background: bool = False
    ) -> Path | None:
        """Write checkpoint `step` atomically and prune to keep_last; every rank calls it. `tensors` (the
        model and optimisers, sharded or not) go through DCP, `run_state` (rank 0's) into run_state.pt,
        `about` (config, world size, shape, tokenizer) into the manifest. Returns the folder, or None on
        every rank, with a warning, when it could not be written.

        With `background`, the tensors are copied to host memory and written by a thread while training
        goes on: it returns None at once, and `poll` (each step) or the next save seals the folder once
        every rank's part is written. A crash before then leaves only a temporary folder."""
        self.poll(block=True)  # one save at a time, in order
        info, final = self.info, self.path(step)
        tmp = final.with_name(f".{final.name}.tmp-{broadcast_object(os.getpid(), info)}")
        failure = None
        if info.is_main:
            failure = self._prepare(tmp, _state_bytes(tensors))
        failure = broadcast_object(failure, info)
        if failure is None and background:
            failure = self._start(tmp, tensors, run_state)
            if failure is None:
                self._pending = (tmp, final, step, about)
                return None
        elif failure is None:
            failure = self._write(tmp, tensors, run_state)
        return self._finish(tmp, final, step, about, failure)

    def poll(self, block: bool = False) -> Path | None:
        """Seal the background save once every rank has written its part (with `block`, wait for it);
        the folder it wrote, or None (none finished, or it failed, with a warning)."""
        if self._pending is None or (not block and any_rank(not self._future.done(), self.info)):
            return None
        (tmp, final, step, about), self._pending = self._pending, None
        failure = None
        try:
            self._future.result()
        except (Exception, CheckpointException) as err:
            failure = _reason(err)
        failures = [f for f in gather_objects(failure, self.info) if f is not None]
        return self._finish(tmp, final, step, about, failures[0] if failures else None)

    def _finish(self, tmp: Path, final: Path, step: int, about: dict, failure: str | None) -> Path | None:
        if failure is None:
            failure = self._seal(tmp, final, step, about)
        if failure is not None:
            if self.info.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                warnings.warn(
                    f"checkpoint {final} not written: {failure}. Training goes on; the next save tries again",
                    stacklevel=3,
                )
            return None
        if self.info.is_main:
            for old in [p for p in self.all() if step_of(p) <= step][: -self.keep_last]:
                shutil.rmtree(old)
        return final

    def _prepare(self, tmp: Path, tensor_bytes: int) -> str | None:
        """Rank 0: the free-space check and an empty temporary folder; the reason it failed, if it did."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            need = int(tensor_bytes * 1.02) + (1 << 20)
            free = shutil.disk_usage(self.dir).free
            if free < need:
                return f"it needs about {_size(need)} and only {_size(free)} are free in {self.dir}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as err:
            return str(err)
        return None

    def _write(self, tmp: Path, tensors: dict, run_state: dict) -> str | None:
        """Every rank: its DCP shards, and rank 0 the run state; the first failure of any rank."""
        failure = None
        try:
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp), no_dist=not _distributed())
            if self.info.is_main:
                write_durably(tmp / RUN_STATE, _pickled(run_state))
        except (Exception, CheckpointException) as err:  # DCP's carries each failing rank's error
            failure = _reason(err)
        failures = [f for f in gather_objects(failure, self.info) if f is not None]
        return failures[0] if failures else None

    def _start(self, tmp: Path, tensors: dict, run_state: dict) -> str | None:
        """Every rank: stage its tensors and start writing them in a thread; rank 0 writes the run state."""
        failure = None
        try:
            if _distributed() and self._group is None:
                # The writing thread's collectives run on a gloo group of their own, not on the training's,
                # and give up as the run's do: a rank whose writes hang ends the job.
                self._group = dist.new_group(backend="gloo", timeout=self.info.timeout)
            self._future = dcp.async_save(
                tensors,
                storage_writer=dcp.FileSystemWriter(tmp),
                process_group=self._group,
                no_dist=not _distributed(),
            )
            if self.info.is_main:
                write_durably(tmp / RUN_STATE, _pickled(run_state))
        except (Exception, CheckpointException) as err:
            failure = _reason(err)
        failures = [f for f in gather_objects(failure, self.info) if f is not None]
        return failures[0] if failures else None

    def _seal(self, tmp: Path, final: Path, step: int, about: dict) -> str | None:
        """Hash the files (each rank a share), then rank 0 writes the manifest and renames the folder."""
        info = self.info
        names = sorted(p.name for p in tmp.iterdir()) if info.is_main else None
        names = broadcast_object(names, info)
        mine = {
            name: {"size": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
            for name in names[info.rank :: info.world_size]
        }
        files = {}
        for part in gather_objects(mine, info):
            files.update(part)
        failure = None
        if info.is_main:
            try:
                manifest = {"format": FORMAT, "step": step, **about, "files": dict(sorted(files.items()))}
                write_durably(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
                fsync_dir(tmp)
                if final.exists():  # a checkpoint of this step from an abandoned history (see check_resume)
                    shutil.rmtree(final)
                os.replace(tmp, final)
                fsync_dir(self.dir)  # make the rename itself durable
            except OSError as err:
                failure = str(err)
        return broadcast_object(failure, info)


def _pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _reason(err: BaseException) -> str:
    """Why a save failed: the OS error under it where there is one (ENOSPC reads better than DCP's
    wrapper). An interrupt that DCP wrapped is raised again: it stops the run, as anywhere else."""
    causes = [exc for exc, _ in err.failures.values()] if isinstance(err, CheckpointException) else [err]
    for cause in causes:
        if not isinstance(cause, Exception):
            raise cause
    for cause in causes:
        seen = cause
        while seen is not None:
            if isinstance(seen, OSError):
                return str(seen)
            seen = seen.__cause__ or seen.__context__
    return f"{type(causes[0]).__name__}: {causes[0]}"


# Keys a resumed run must share with its checkpoint: the model's function (every model.* key but those
# choosing an implementation of the same math), the optimiser, and what decides the data stream.
_FREE_MODEL_KEYS = {"loss_chunk_tokens", "fused_mlp", "fused_rope_norm", "fused_residual", "fp8", "fp8_head"}
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


def check_resume(manifest: dict, config: dict, path: Path) -> None:
    """Refuse to resume checkpoint `path` with a config that would not continue its run, naming every
    difference: the model's architecture, the optimiser, the data stream, the seed. The number of ranks and
    the parallel mode may change: the data stream and the tensors do not depend on them."""
    saved = manifest["config"]
    diffs = [
        f"{key}: checkpoint {_get(saved, key)!r} vs config {_get(config, key)!r}"
        for key in _fixed_keys(config)
        if _get(saved, key) != _get(config, key)
    ]
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
