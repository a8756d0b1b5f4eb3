"""A trained model as one file: its weights in safetensors, with everything needed to run it in the file's
metadata (the model config, vocabulary size, max_seqlen, the tokenizer, the step it was trained to).
`load_model` opens a model from such a file, a checkpoint folder or a run_dir alike.

Unlike a checkpoint (run/checkpoint.py: optimiser states, the data stream, every rank's RNG, in as many
files as ranks), an export loads with no run_dir, no data cache and no process group, on any device.

safetensors metadata is a flat map of strings, so the config and `extra` are JSON there and the tokenizer is
data/tokenizer.py's canonical JSON.
"""

import json
import os
import sys
from pathlib import Path

import safetensors
import safetensors.torch
import tiktoken
import torch
from omegaconf import OmegaConf

from configs.data_schema import DataConfig
from configs.schema import ModelConfig
from data import DataError, Prepared, prepare
from data import tokenizer as tok
from model.attention import default_backend
from model.gpt import GPT
from run.checkpoint import MANIFEST, Checkpointer, CheckpointInvalid, read_model_state, verify
from run.files import fsync_dir

FORMAT = "varlen-gpt-export/1"


class ExportInvalid(ValueError):
    """A file that is not one of our exports, or a damaged one; the message names the file and why."""


def load_model_config(values: dict):
    """The model config of a saved dict, checked against configs/schema.py's ModelConfig (an unknown key or
    a wrong type is an error naming it). The FP8 mode is an implementation of the same math that needs an
    FP8 GPU: a loaded model runs its products in the weights' precision."""
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), values)
    cfg.fp8 = "none"
    return cfg


def _check_state(path: Path, state: dict, cfg, vocab_size: int, max_seqlen: int) -> None:
    """The weights must be exactly those of the GPT the config builds: checked on a meta-device model (no
    memory, no init), so a file that could not be loaded is never written."""
    with torch.device("meta"):
        expected = {k: v.shape for k, v in GPT(cfg, vocab_size, "reference", max_seqlen).state_dict().items()}
    got = {k: v.shape for k, v in state.items()}
    missing, unexpected = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    wrong = [
        f"{k} {tuple(got[k])} (expected {tuple(v)})" for k, v in expected.items() if k in got and got[k] != v
    ]
    if missing or unexpected or wrong:
        raise ExportInvalid(
            f"not writing {path}: the weights do not match the model config "
            f"(missing {missing}, unexpected {unexpected}, wrong shapes {wrong})"
        )


def save_export(
    path: str | Path,
    state: dict[str, torch.Tensor],
    model_config: dict,
    vocab_size: int,
    max_seqlen: int,
    tokenizer_json: bytes,
    step: int,
    extra: dict,
) -> Path:
    """Write the export atomically: a temporary file in the same folder, fsynced, renamed over `path`."""
    path = Path(path)
    enc = tok.from_json(tokenizer_json)
    if enc.n_vocab != vocab_size:
        raise ExportInvalid(
            f"not writing {path}: the tokenizer has {enc.n_vocab} ids, vocab_size={vocab_size}"
        )
    _check_state(path, state, load_model_config(model_config), vocab_size, max_seqlen)
    metadata = {
        "format": FORMAT,
        "model_config": json.dumps(model_config, sort_keys=True),
        "vocab_size": str(vocab_size),
        "max_seqlen": str(max_seqlen),
        "tokenizer": tokenizer_json.decode(),
        "step": str(step),
        "extra": json.dumps(extra, sort_keys=True),
    }
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state.items()}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        # safetensors writes its files 0600; an export is for sharing, so it gets the mode a file made
        # here normally gets (0666 less the umask), read off an empty file created first.
        with open(tmp, "wb"):
            mode = tmp.stat().st_mode
        safetensors.torch.save_file(tensors, tmp, metadata=metadata)
        tmp.chmod(mode)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # make the rename itself durable
    return path


def read_metadata(path: str | Path) -> dict:
    """The export's metadata, parsed (the tokenizer as its JSON bytes); ExportInvalid if `path` is not an
    export of ours or is damaged."""
    path = Path(path)
    if not path.is_file():
        raise ExportInvalid(f"{path} does not exist or is not a file")
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            raw = f.metadata() or {}
    except Exception as err:  # safetensors' own error type for a bad header or a short file
        raise ExportInvalid(
            f"{path} is not a readable safetensors file, truncated or damaged? ({err})"
        ) from None
    if raw.get("format") != FORMAT:
        raise ExportInvalid(
            f"{path} is a safetensors file but not a {FORMAT} export "
            f"(the format in its metadata is {raw.get('format')!r})"
        )
    try:
        return {
            "format": raw["format"],
            "model_config": json.loads(raw["model_config"]),
            "vocab_size": int(raw["vocab_size"]),
            "max_seqlen": int(raw["max_seqlen"]),
            "tokenizer": raw["tokenizer"].encode(),
            "step": int(raw["step"]),
            "extra": json.loads(raw["extra"]),
        }
    except (KeyError, ValueError) as err:
        raise ExportInvalid(f"{path}: the export's metadata is incomplete or malformed ({err!r})") from None


def load_export(path: str | Path, device="cpu") -> tuple[GPT, tiktoken.Encoding, dict]:
    """(the GPT in eval mode on `device`, with the device's default attention backend; its tokenizer; the
    metadata of read_metadata less the tokenizer's JSON). Weights load strictly: every name and shape."""
    path = Path(path)
    meta = read_metadata(path)
    enc = tok.from_json(meta.pop("tokenizer"))
    try:
        state = safetensors.torch.load_file(path)
    except Exception as err:
        raise ExportInvalid(f"{path}: its weights do not load, truncated or damaged? ({err})") from None
    return _build(path, state, meta, device), enc, meta


def _build(path: Path, state: dict, meta: dict, device) -> GPT:
    device = torch.device(device)
    model = GPT(
        load_model_config(meta["model_config"]),
        meta["vocab_size"],
        default_backend(device),
        meta["max_seqlen"],
    )
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ExportInvalid(
            f"{path}: its weights do not fit the model its metadata describes ({err})"
        ) from None
    return model.to(device).eval()


def find_checkpoint(source: Path) -> tuple[Path, dict]:
    """(checkpoint folder, its verified manifest): `source` itself if it is a checkpoint, else the newest
    valid checkpoint of the run_dir `source`."""
    if (source / MANIFEST).is_file():
        return source, verify(source)
    candidates = Checkpointer(source, keep_last=1).all()
    if not candidates:
        raise CheckpointInvalid(f"{source} is neither a checkpoint folder nor a run_dir with checkpoints")
    for path in reversed(candidates):
        try:
            return path, verify(path)
        except CheckpointInvalid as err:
            print(f"skipping {path}: {err}", file=sys.stderr, flush=True)
    raise CheckpointInvalid(f"no checkpoint of {source} verifies (see above)")


def run_data(path: Path, manifest: dict) -> Prepared:
    """The prepared data (hence tokenizer) the checkpoint's run trained on, checked to be the same."""
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), manifest["config"]["data"])
    try:
        data = prepare(cfg, build=False)
    except DataError as err:
        raise DataError(
            f"the tokenizer of {path} is in the data cache its run used (data.source={cfg.source!r}, "
            f"data.cache_dir={cfg.cache_dir!r}), which cannot be opened: {err}"
        ) from None
    if data.tokenizer_id != manifest["tokenizer_id"]:
        raise DataError(
            f"{path} was trained with tokenizer {manifest['tokenizer_id']}, but {data.folder} holds "
            f"{data.tokenizer_id}"
        )
    return data


def load_model(source: str | Path, device="cpu") -> tuple[GPT, tiktoken.Encoding, dict]:
    """load_export's (model, tokenizer, metadata) from an export file, a checkpoint folder or a run_dir (its
    newest checkpoint that verifies). A checkpoint's tokenizer comes from its run's data cache (run_data);
    its metadata has load_export's keys, `extra` holding the checkpoint's path and run config."""
    source = Path(source)
    if source.is_file():
        return load_export(source, device)
    path, manifest = find_checkpoint(source)
    data = run_data(path, manifest)
    config = manifest["config"]
    meta = {
        "format": manifest["format"],
        "model_config": config["model"],
        "vocab_size": manifest["shape"]["vocab_size"],
        "max_seqlen": config["data"]["max_seqlen"],
        "step": manifest["step"],
        "extra": {"checkpoint": str(path), "data": config["data"]},
    }
    return _build(path, read_model_state(path), meta, device), data.tokenizer, meta
