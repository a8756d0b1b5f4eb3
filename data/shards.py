"""Token shards: tokenize a source once, in parallel processes, into memory-mappable shards; load them.

A prepared folder, <cache_dir>/<source>-<tokenizer>-<key>, where key hashes every input (the source's
files with sizes and mtimes or the Hub name, text column, max_docs, val_fraction, tokenizer spec,
shard size), holds:

    tokenizer.json                   the tiktoken encoding, <|bos|> included (data/tokenizer.py)
    train_00000.bin, val_00000.bin   flat tokens, smallest sufficient dtype: every document as
                                     [bos, tokens...], then one closing bos
    train_00000.idx.npy, ...         int64 offsets of the documents in the .bin (n_docs + 1)
    manifest.json                    source, tokenizer, counts, and size + sha256 of every file

The closing bos makes the token after every document readable from the file: its last target (bos).
The folder is built under a temporary name and renamed into place once complete, so an interrupted
or failed build leaves nothing behind, a re-run with the same inputs finds it and does nothing, and
changed inputs give another key, hence another folder.
"""

import hashlib
import io
import json
import multiprocessing
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tiktoken
from tqdm import tqdm

from data import tokenizer as tok
from data.config import DataError, check_config
from data.sources import Source, is_val, open_source
from run.files import fsync_dir, write_durably

FORMAT = 1  # bump when the layout changes: it is part of the key
TASK_DOCS = 512  # documents per tokenizer task
TASK_CHARS = 4_000_000  # ... or fewer when they are long, to bound a task's memory
SPLITS = ("train", "val")


@dataclass
class Prepared:
    """A loaded, checked prepared folder: tokenizer plus memory-mapped shards of both splits."""

    folder: Path
    manifest: dict
    tokenizer: tiktoken.Encoding
    tokenizer_id: str
    shards: dict  # split -> [(tokens, offsets)]: tokens a read-only memory map, offsets int64 [n_docs + 1]

    @property
    def bos_id(self) -> int:
        return self.manifest["tokenizer"]["bos_id"]

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.n_vocab

    @property
    def key(self) -> str:
        return self.manifest["key"]


def prepare(cfg, build: bool = True, verify: bool | None = None) -> Prepared:
    """Load the prepared tokenizer + shards for cfg (a DataConfig), building them first when missing
    and build=True. verify (default: build and data.verify) re-hashes every file against the manifest;
    sizes and structure are always checked."""
    check_config(cfg)
    source = open_source(cfg)
    inputs = {
        "format": FORMAT,
        "source": source.fingerprint(),
        "max_docs": cfg.max_docs,
        "val_fraction": cfg.val_fraction,
        "tokenizer": _tokenizer_spec(cfg),
        "shard_tokens": cfg.shard_tokens,
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    spec = inputs["tokenizer"]
    label = spec["name"] + (str(spec["vocab_size"]) if spec["name"] == "bpe" else "")
    folder = Path(cfg.cache_dir).expanduser() / f"{source.name}-{label}-{key}"
    if (folder / "manifest.json").exists():
        prepared = _load(folder, verify=build and cfg.verify if verify is None else verify)
        if build:
            print(f"data: {folder} is up to date ({_summary(prepared.manifest)})", flush=True)
        _check_splits(cfg, prepared)
        return prepared
    if not build:
        raise DataError(
            f"no prepared data for data.source={cfg.source!r} at {folder}: "
            "run `python scripts/prepare_data.py` "
            "with the same data overrides first (train.py does it on rank 0)"
        )
    older = sorted(p.name for p in folder.parent.glob(f"{source.name}-{label}-*") if ".tmp" not in p.name)
    why = f"the inputs changed since {', '.join(older)} (files, column or settings)" if older else "first use"
    print(f"data: preparing {folder} ({why})", flush=True)
    _build(cfg, source, folder, {"key": key, **inputs})
    prepared = _load(folder, verify=False)
    _check_splits(cfg, prepared)
    return prepared


def _check_splits(cfg, prepared: Prepared) -> None:
    """Both splits must hold documents: training needs the one, every evaluation the other. Checked
    when the shards are prepared or opened, so it stops a run before any training."""
    counts = prepared.manifest["counts"]
    for split in SPLITS:
        if counts[f"{split}_docs"] == 0:
            total = sum(counts[f"{s}_docs"] for s in SPLITS)
            fix = "raise" if split == "val" else "lower"
            raise DataError(
                f"the {split} split of {prepared.folder} holds no documents (of {total} in all; documents "
                f"are split whole, by a hash of their id): {fix} data.val_fraction (now {cfg.val_fraction}) "
                "or use more documents"
            )


def _tokenizer_spec(cfg) -> dict:
    if cfg.tokenizer == "bpe":
        return {"name": "bpe", "vocab_size": cfg.vocab_size, "max_chars": cfg.tokenizer_max_chars}
    return {"name": cfg.tokenizer}


def _summary(manifest: dict) -> str:
    c = manifest["counts"]
    return (
        f"{c['train_docs']:,} train / {c['val_docs']:,} val documents, "
        f"{c['train_tokens']:,} / {c['val_tokens']:,} "
        f"tokens, tokenizer {manifest['tokenizer']['id']}"
    )


# ---- building -------------------------------------------------------------------------------------


def _build(cfg, source: Source, folder: Path, inputs: dict) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        t0 = time.perf_counter()
        enc = _make_tokenizer(cfg, source)
        t1 = time.perf_counter()
        raw = tok.to_json(enc)
        _write(tmp / "tokenizer.json", raw)
        counts, shards = _tokenize(cfg, source, raw, enc, tmp)
        t2 = time.perf_counter()
        manifest = {
            **inputs,
            "text_column": source.text_column,
            "tokenizer": {
                "id": tok.fingerprint(raw, enc),
                "name": enc.name,
                "vocab_size": enc.n_vocab,
                "bos_id": enc.encode_single_token(tok.BOS),
                "file": _file_entry(tmp / "tokenizer.json"),
            },
            "dtype": np.dtype(_dtype(enc)).name,
            "counts": counts,
            "shards": shards,
            "seconds": {"tokenizer": round(t1 - t0, 3), "tokenize": round(t2 - t1, 3)},
        }
        _write(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        fsync_dir(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / "manifest.json").exists():
                raise
            shutil.rmtree(tmp)  # another process finished the same build first
        fsync_dir(folder.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"data: prepared {folder} ({_summary(manifest)})", flush=True)


def _documents(cfg, source: Source, counts: dict):
    """(text, is_val) of the non-empty documents, up to data.max_docs; empty ones are counted and skipped."""
    kept = 0
    for doc_id, text in source.docs():
        if text is None or not text.strip():
            counts["skipped_empty"] += 1
            continue
        yield text, is_val(doc_id, cfg.val_fraction)
        kept += 1
        if kept == cfg.max_docs:
            break


def _check_not_empty(cfg, counts: dict, kept: int) -> None:
    if kept == 0:
        raise DataError(
            f"data.source={cfg.source!r} holds no non-empty document "
            f"({counts['skipped_empty']} empty or whitespace-only ones were skipped)"
        )


def _make_tokenizer(cfg, source: Source) -> tiktoken.Encoding:
    if cfg.tokenizer != "bpe":
        return tok.named_encoding(cfg.tokenizer)
    counts = {"skipped_empty": 0}
    seen = {"docs": 0, "chars": 0}

    def texts():
        for text, val in _documents(cfg, source, counts):
            seen["docs"] += 1
            if val:
                continue
            room = cfg.tokenizer_max_chars - seen["chars"]
            seen["chars"] += min(len(text), room)
            yield text[:room]
            if seen["chars"] >= cfg.tokenizer_max_chars:
                return

    print(f"data: training a {cfg.vocab_size}-token BPE on {source.kind} text", flush=True)
    enc = tok.train_bpe(texts(), cfg.vocab_size)
    _check_not_empty(cfg, counts, seen["docs"])
    if seen["chars"] == 0:
        raise DataError(
            f"data.source={cfg.source!r}: no document fell in the train split to train the tokenizer on "
            f"(data.val_fraction={cfg.val_fraction}); lower it or use more documents"
        )
    if enc.n_vocab < cfg.vocab_size:
        print(
            f"data: warning: the BPE stopped at {enc.n_vocab} tokens "
            f"(asked for data.vocab_size={cfg.vocab_size}): "
            "the training text has no more pairs to merge",
            flush=True,
        )
    return enc


def _dtype(enc: tiktoken.Encoding):
    return np.uint16 if enc.n_vocab <= 2**16 else np.uint32


class _ShardWriter:
    """Appends tokenized documents of one split to shard files, closing a shard past shard_tokens."""

    def __init__(self, folder: Path, split: str, dtype, bos: int, shard_tokens: int):
        self.folder, self.split, self.dtype, self.bos, self.shard_tokens = (
            folder,
            split,
            dtype,
            bos,
            shard_tokens,
        )
        self.entries, self.docs, self.tokens = [], 0, 0
        self.file = None

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if self.file is None:
            self.name = f"{self.split}_{len(self.entries):05d}"
            self.file = open(self.folder / f"{self.name}.bin", "wb")
            self.hash, self.lengths, self.count = hashlib.sha256(), [], 0
        data = tokens.tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.lengths.append(lengths)
        self.count += len(tokens)
        if self.count >= self.shard_tokens:
            self.close()

    def close(self) -> None:
        if self.file is None:
            return
        closing = np.array([self.bos], dtype=self.dtype).tobytes()
        self.file.write(closing)
        self.hash.update(closing)
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.file = None
        lengths = np.concatenate(self.lengths)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        buf = io.BytesIO()
        np.save(buf, offsets)
        _write(self.folder / f"{self.name}.idx.npy", buf.getvalue())
        bin_name = f"{self.name}.bin"
        self.entries.append(
            {
                "split": self.split,
                "tokens": bin_name,
                "index": f"{self.name}.idx.npy",
                "docs": len(lengths),
                "num_tokens": self.count,
                "files": {
                    bin_name: {
                        "bytes": (self.count + 1) * np.dtype(self.dtype).itemsize,
                        "sha256": self.hash.hexdigest(),
                    },
                    f"{self.name}.idx.npy": _file_entry(self.folder / f"{self.name}.idx.npy"),
                },
            }
        )
        self.docs += len(lengths)
        self.tokens += self.count


_worker_enc = None


def _init_worker(raw: bytes) -> None:
    global _worker_enc
    _worker_enc = tok.from_json(raw)


def _encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Flat [bos, tokens...] of each text, and each document's length (bos included)."""
    bos = _worker_enc.encode_single_token(tok.BOS)
    flat, lengths = [], []
    for text in texts:
        ids = _worker_enc.encode_ordinary(text)
        flat.append(bos)
        flat.extend(ids)
        lengths.append(len(ids) + 1)
    return np.array(flat, dtype=_dtype(_worker_enc)), np.array(lengths, dtype=np.int64)


def _tasks(docs):
    """Batches of (texts, is_val flags) for the tokenizer processes."""
    texts, flags, chars = [], [], 0
    for text, val in docs:
        texts.append(text)
        flags.append(val)
        chars += len(text)
        if len(texts) == TASK_DOCS or chars >= TASK_CHARS:
            yield texts, np.array(flags)
            texts, flags, chars = [], [], 0
    if texts:
        yield texts, np.array(flags)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (what a SLURM allocation or `taskset` grants), not every
    CPU of the node, which os.cpu_count() gives."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _tokenize(cfg, source: Source, raw: bytes, enc: tiktoken.Encoding, folder: Path) -> tuple[dict, list]:
    bos = enc.encode_single_token(tok.BOS)
    writers = {s: _ShardWriter(folder, s, _dtype(enc), bos, cfg.shard_tokens) for s in SPLITS}
    counts = {"skipped_empty": 0}
    workers = cfg.num_workers or usable_cpus()
    # Not fork: under torchrun this process already runs threads (the process groups', tqdm's), and a fork
    # copies their locks, held or not. A forkserver is one clean process that imports this module once and
    # forks each worker from itself.
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])
    else:
        context = multiprocessing.get_context("spawn")
    total = source.size_hint()
    if total is not None and cfg.max_docs is not None:
        total = min(total, cfg.max_docs)
    kept, total_tokens = 0, 0
    with (
        context.Pool(workers, _init_worker, (raw,)) as pool,
        tqdm(total=total, unit="doc", desc="tokenizing", dynamic_ncols=True, mininterval=1) as bar,
    ):
        inflight = deque()

        def collect():
            nonlocal total_tokens
            flags, result = inflight.popleft()
            tokens, lengths = result.get()
            total_tokens += len(tokens)
            for split, mask in (("train", ~flags), ("val", flags)):
                if mask.any():
                    picks = np.repeat(mask, lengths)
                    writers[split].add(tokens[picks], lengths[mask])
            bar.update(len(lengths))
            bar.set_postfix(tokens=f"{total_tokens:,}", refresh=False)

        for texts, flags in _tasks(_documents(cfg, source, counts)):
            kept += len(texts)
            inflight.append((flags, pool.apply_async(_encode, (texts,))))
            if len(inflight) >= 2 * workers:
                collect()
        while inflight:
            collect()
    _check_not_empty(cfg, counts, kept)
    for writer in writers.values():
        writer.close()
    counts.update(
        {
            "docs": kept,
            "train_docs": writers["train"].docs,
            "val_docs": writers["val"].docs,
            "tokens": writers["train"].tokens + writers["val"].tokens,
            "train_tokens": writers["train"].tokens,
            "val_tokens": writers["val"].tokens,
        }
    )
    if source.kind == "stdlib":
        counts["undecodable_replaced"] = source.undecodable
    if counts["skipped_empty"]:
        print(f"data: skipped {counts['skipped_empty']:,} empty or whitespace-only documents", flush=True)
    return counts, writers["train"].entries + writers["val"].entries


# ---- loading and checking -------------------------------------------------------------------------


def _load(folder: Path, verify: bool) -> Prepared:
    path = folder / "manifest.json"
    try:
        manifest = json.loads(path.read_bytes())
        missing = {"format", "key", "tokenizer", "dtype", "counts", "shards"} - set(manifest)
    except (OSError, ValueError, TypeError) as err:
        raise DataError(
            f"{path} is unreadable or corrupted ({err}): delete {folder} and prepare again"
        ) from err
    if missing:
        raise DataError(
            f"{path} is corrupted (no {', '.join(sorted(missing))}): delete {folder} and prepare again"
        )
    if manifest.get("format") != FORMAT:
        raise DataError(
            f"{path} has format {manifest.get('format')}, this code reads {FORMAT}: prepare again"
        )
    tok_path = folder / "tokenizer.json"
    try:
        raw = tok_path.read_bytes()
        enc = tok.from_json(raw)
    except (OSError, ValueError, KeyError) as err:
        raise DataError(
            f"{tok_path} is missing or unreadable ({err}): delete {folder} and prepare again"
        ) from err
    tokenizer_id = tok.fingerprint(raw, enc)
    if tokenizer_id != manifest["tokenizer"]["id"] or enc.n_vocab != manifest["tokenizer"]["vocab_size"]:
        raise DataError(
            f"{tok_path} is tokenizer {tokenizer_id} ({enc.n_vocab} tokens), but the shards were tokenized "
            f"with {manifest['tokenizer']['id']}: delete {folder} and prepare again"
        )
    dtype = np.dtype(manifest["dtype"])
    shards = {s: [] for s in SPLITS}
    for entry in manifest["shards"]:
        for name, expected in entry["files"].items():
            _check_file(folder / name, expected, verify)
        tokens = np.memmap(folder / entry["tokens"], dtype=dtype, mode="r")
        offsets = np.load(folder / entry["index"])
        bad = (
            offsets.dtype != np.int64
            or len(offsets) != entry["docs"] + 1
            or offsets[0] != 0
            or offsets[-1] + 1 != len(tokens)
            or (np.diff(offsets) < 1).any()
        )
        if bad:
            raise DataError(
                f"shard {folder / entry['index']} does not match {folder / entry['tokens']}: prepare again"
            )
        if verify and tokens.max() >= enc.n_vocab:
            raise DataError(
                f"shard {folder / entry['tokens']} holds ids beyond the tokenizer's "
                f"vocabulary of {enc.n_vocab}"
            )
        shards[entry["split"]].append((tokens, offsets))
    return Prepared(folder, manifest, enc, tokenizer_id, shards)


def _check_file(path: Path, expected: dict, verify: bool) -> None:
    """Size always (truncation), sha256 when verify (corruption), against the manifest."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DataError(
            f"{path} is missing (listed in the manifest): delete {path.parent} and prepare again"
        ) from None
    if size != expected["bytes"]:
        raise DataError(
            f"{path} is truncated or damaged: {size} bytes, the manifest says {expected['bytes']}; "
            f"delete {path.parent} and prepare again"
        )
    if verify and _sha256(path) != expected["sha256"]:
        raise DataError(
            f"{path} is corrupted: its sha256 does not match the manifest; "
            f"delete {path.parent} and prepare again"
        )


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _file_entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": _sha256(path)}


def _write(path: Path, data: bytes) -> None:
    """Atomic write: a temporary file, fsynced, then renamed over the target."""
    tmp = path.with_name(path.name + ".tmp")
    write_durably(tmp, data)
    os.replace(tmp, path)
