"""The data pipeline end to end on tiny synthetic sources made here: sources, tokenizer, shards and
manifest, the PackedLoader (batch format, ranks, exact resume), and a clear error for each bad input."""

import io
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from configs.data_schema import DataConfig
from data import Batch, DataError, PackedLoader, prepare
from data import shards as shards_module
from data import tokenizer as tok
from data.sources import is_val, open_source

_rng = random.Random(42)
WORDS = ["déjà", "vu", "日本", "naïve", "🙂", "x=1;", "def", "f(x):"] + [
    "".join(_rng.choice("abcdefghijklmnoprstuvw") for _ in range(_rng.randint(2, 8))) for _ in range(200)
]


def make_texts(n: int, seed: int = 0) -> list[str]:
    """Documents of 0 to ~300 words (a few longer than a buffer), with empty and blank ones mixed in."""
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        if i % 17 == 5:
            texts.append(["", "   ", "\n\t \n"][i % 3])
            continue
        count = rng.choice([1, 2, 5, 20, 60, 300])
        texts.append(" ".join(rng.choice(WORDS) for _ in range(count)) + rng.choice(["", "\n"]))
    return texts


def write_jsonl(path: Path, texts, column: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": f"d{i}", column: text}) + "\n")
    return path


def data_config(source, cache, **overrides) -> DataConfig:
    base = dict(
        source=str(source),
        cache_dir=str(cache),
        vocab_size=300,
        val_fraction=0.2,
        num_workers=2,
        tokens_per_micro_batch=128,
        max_seqlen=64,
        max_num_docs=8,
        pack_window=8,
        prefetch=2,
        verify=True,
    )
    return DataConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def data_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    texts = make_texts(120)
    write_jsonl(root / "docs.jsonl", texts)
    pq.write_table(
        pa.table({"id": [str(i) for i in range(len(texts))], "text": texts}), root / "docs.parquet"
    )
    (root / "txt").mkdir()
    for i, text in enumerate(texts):
        (root / "txt" / f"doc_{i:04d}.txt").write_text(text, encoding="utf-8")
    return root, texts


@pytest.fixture(scope="module")
def data_prepared(data_corpus, tmp_path_factory):
    root, texts = data_corpus
    cfg = data_config(root / "docs.jsonl", tmp_path_factory.mktemp("cache"))
    return cfg, prepare(cfg), texts


def kept(texts):
    return [t for t in texts if t.strip()]


# ---- sources, tokenizer, shards --------------------------------------------------------------------


def test_shards_hold_every_document_once_with_bos_and_manifest(data_prepared):
    cfg, prepared, texts = data_prepared
    enc, bos = prepared.tokenizer, prepared.bos_id
    assert bos == enc.n_vocab - 1 == prepared.vocab_size - 1 and enc.decode([bos]) == "<|bos|>"
    counts = prepared.manifest["counts"]
    assert counts["skipped_empty"] == len(texts) - len(kept(texts)) > 0
    assert counts["docs"] == len(kept(texts)) == counts["train_docs"] + counts["val_docs"]
    assert prepared.manifest["dtype"] == "uint16"
    for split in ("train", "val"):
        expected = [t for t in kept(texts) if is_val(t, cfg.val_fraction) == (split == "val")]
        decoded = []
        for tokens, offsets in prepared.shards[split]:
            assert tokens[-1] == bos, "every shard ends with a closing bos"
            for a, b in zip(offsets[:-1], offsets[1:], strict=True):
                assert tokens[a] == bos and bos not in tokens[a + 1 : b]
                decoded.append(enc.decode(tokens[a + 1 : b].tolist()))
        assert decoded == expected, split
        assert sum(int(o[-1]) for _, o in prepared.shards[split]) == counts[f"{split}_tokens"]


def test_prepare_again_does_nothing_and_changed_inputs_are_detected(
    data_corpus, tmp_path, monkeypatch, capsys
):
    root, texts = data_corpus
    source = write_jsonl(tmp_path / "docs.jsonl", texts[:40])
    cfg = data_config(source, tmp_path / "cache")
    first = prepare(cfg)
    monkeypatch.setattr(shards_module, "_build", lambda *a: pytest.fail("rebuilt unchanged inputs"))
    again = prepare(cfg)
    assert again.folder == first.folder and "up to date" in capsys.readouterr().out
    monkeypatch.undo()
    write_jsonl(source, texts[:41])  # a changed file
    assert prepare(cfg).folder != first.folder
    assert "inputs changed" in capsys.readouterr().out
    assert prepare(replace(cfg, text_column="id")).folder != first.folder  # another column
    assert prepare(replace(cfg, val_fraction=0.3)).folder != first.folder
    assert not list((tmp_path / "cache").glob("*.tmp*"))


def test_parquet_and_txt_sources_give_the_same_shards_as_jsonl(data_corpus, data_prepared, tmp_path):
    root, _ = data_corpus
    cfg, reference, _ = data_prepared
    hashes = {e["tokens"]: e["files"][e["tokens"]]["sha256"] for e in reference.manifest["shards"]}
    for source in (root / "docs.parquet", root / "txt", f"{root}/txt/doc_*.txt"):
        prepared = prepare(replace(cfg, source=str(source), cache_dir=str(tmp_path)))
        assert prepared.tokenizer_id == reference.tokenizer_id, source
        assert {e["tokens"]: e["files"][e["tokens"]]["sha256"] for e in prepared.manifest["shards"]} == hashes


def test_split_is_by_document_hash_not_position(data_corpus, data_prepared, tmp_path):
    _, texts = data_corpus
    cfg, prepared, _ = data_prepared
    shuffled = kept(texts)
    random.Random(1).shuffle(shuffled)
    other = prepare(
        replace(cfg, source=str(write_jsonl(tmp_path / "s.jsonl", shuffled)), cache_dir=str(tmp_path))
    )

    def val_texts(p):
        return sorted(
            p.tokenizer.decode(t[a + 1 : b].tolist())
            for t, o in p.shards["val"]
            for a, b in zip(o, o[1:], strict=False)
        )

    assert val_texts(other) == val_texts(prepared) and val_texts(prepared)


def test_stdlib_source_lists_the_standard_library_in_a_fixed_order(tmp_path):
    source = open_source(DataConfig())
    rel = [p.relative_to(source.root).as_posix() for p in source.files]
    assert len(rel) > 1000 and rel == sorted(rel) and "os.py" in rel
    assert not [r for r in rel if "site-packages" in r or "dist-packages" in r]
    prepared = prepare(data_config("stdlib", tmp_path, max_docs=30, vocab_size=400))
    assert prepared.manifest["counts"]["docs"] == 30
    assert prepared.manifest["source"]["kind"] == "stdlib" and prepared.folder.name.startswith(
        "stdlib-bpe400-"
    )


def test_tokenizer_file_roundtrip_and_fingerprint():
    texts = kept(make_texts(60))
    enc = tok.train_bpe(texts, 320)
    assert enc.n_vocab == 320 and enc.encode_single_token(tok.BOS) == 319
    raw = tok.to_json(enc)
    again = tok.from_json(raw)
    assert tok.to_json(again) == raw and tok.fingerprint(raw, again) == tok.fingerprint(raw, enc)
    for text in texts[:10]:
        assert (
            again.encode_ordinary(text) == enc.encode_ordinary(text)
            and again.decode(enc.encode(text)) == text
        )
    assert tok.fingerprint(tok.to_json(tok.train_bpe(texts, 330)), enc) != tok.fingerprint(raw, enc)


# ---- the loader ------------------------------------------------------------------------------------


def batches(loader, n=None) -> list[Batch]:
    out = []
    for batch in loader:
        out.append(batch)
        if n is not None and len(out) == n:
            break
    loader.close()
    return out


def same(a: list[Batch], b: list[Batch]) -> bool:
    fields = ("input_ids", "targets", "cu_seqlens", "position_ids")
    return len(a) == len(b) and all(
        all(torch.equal(getattr(x, f), getattr(y, f)) for f in fields) and x.max_seqlen == y.max_seqlen
        for x, y in zip(a, b, strict=True)
    )


def test_batches_have_the_documented_format_and_cover_the_split(data_prepared):
    cfg, prepared, _ = data_prepared
    T, S, N, bos = cfg.tokens_per_micro_batch, cfg.max_seqlen, cfg.max_num_docs, prepared.bos_id
    out = batches(PackedLoader(prepared, cfg, split="train", infinite=False))
    seen = []
    for b in out:
        assert b.input_ids.shape == b.targets.shape == b.position_ids.shape == (T,)
        assert b.input_ids.dtype == b.targets.dtype == b.position_ids.dtype == torch.long
        assert b.cu_seqlens.shape == (N + 1,) and b.cu_seqlens.dtype == torch.int32
        assert b.max_seqlen == S and isinstance(b.max_seqlen, int)
        cu = b.cu_seqlens.tolist()
        assert cu[0] == 0 and cu == sorted(cu) and cu[-1] == T
        for s, e in zip(cu, cu[1:], strict=False):
            if e == s:
                assert e == T, "zero-length documents only as padding at the end"
                continue
            assert e - s <= S and b.position_ids[s:e].tolist() == list(range(e - s))
            ids, tgt = b.input_ids[s:e], b.targets[s:e]
            if tgt[0] < 0:  # filler: no loss
                assert (tgt == -1).all() and (ids == bos).all()
                continue
            assert (tgt >= 0).all() and torch.equal(tgt[:-1], ids[1:]), "targets are the next tokens"
            assert bos not in ids[1:].tolist(), "a segment never spans two documents"
            seen.append(ids)
    # Every token of the split exactly once (order inside documents: tests/data/test_packing.py).
    expected = np.concatenate([t[:-1] for t, _ in prepared.shards["train"]])
    got = torch.cat(seen).numpy()
    assert np.array_equal(
        np.bincount(got, minlength=prepared.vocab_size), np.bincount(expected, minlength=prepared.vocab_size)
    )


def test_document_ends_predict_bos(data_prepared):
    cfg, prepared, _ = data_prepared
    b = batches(PackedLoader(prepared, replace(cfg, max_seqlen=128), infinite=False), 1)[0]
    starts = (b.input_ids == prepared.bos_id) & (b.targets >= 0)
    before = torch.nonzero(starts).flatten()[1:] - 1  # the token before a document start ends a document
    assert len(before) and (b.targets[before] == prepared.bos_id).all()


def test_ranks_are_disjoint_and_cover_the_single_process_stream(data_prepared):
    cfg, prepared, _ = data_prepared
    single = batches(PackedLoader(prepared, cfg, infinite=False))
    world = 3
    ranks = [
        batches(PackedLoader(prepared, cfg, rank=r, world_size=world, infinite=False)) for r in range(world)
    ]
    assert sum(len(r) for r in ranks) == len(single)
    for r in range(world):
        assert same(ranks[r], single[r::world])
    endless = batches(PackedLoader(prepared, cfg, seed=5), 12)
    assert same(batches(PackedLoader(prepared, cfg, rank=1, world_size=2, seed=5), 6), endless[1::2])


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_after_any_batch_is_bit_for_bit_across_epochs(data_prepared, world_size):
    cfg, prepared, _ = data_prepared
    rank = world_size - 1
    per_epoch = len(batches(PackedLoader(prepared, cfg, seed=3, infinite=False))) // world_size
    reference = batches(
        PackedLoader(prepared, cfg, rank=rank, world_size=world_size, seed=3), 2 * per_epoch + 6
    )
    for k in (0, 1, 7, per_epoch - 1, per_epoch, per_epoch + 3):
        loader = PackedLoader(prepared, cfg, rank=rank, world_size=world_size, seed=3)
        assert same(batches(loader, k) if k else [], reference[:k])
        buffer = io.BytesIO()
        torch.save(loader.state_dict(), buffer)
        state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        resumed = PackedLoader(prepared, cfg, rank=rank, world_size=world_size, seed=3)
        resumed.load_state_dict(state)
        assert same(batches(resumed, 6), reference[k : k + 6]), k
    assert per_epoch + 3 > per_epoch and resumed.stats()["epoch"] > 1


def test_state_is_after_the_last_batch_handed_out_not_after_prefetch(data_prepared):
    cfg, prepared, _ = data_prepared
    reference = batches(PackedLoader(prepared, cfg, seed=9), 10)
    loader = PackedLoader(prepared, replace(cfg, prefetch=4), seed=9)
    first = [next(loader) for _ in range(3)]
    state = loader.state_dict()
    rest = [next(loader) for _ in range(4)]
    loader.load_state_dict(state)  # rewinds a running loader
    assert same(first + rest, reference[:7]) and same([next(loader) for _ in range(4)], reference[3:7])
    loader.close()  # stopping the thread loses nothing either
    assert same([next(loader) for _ in range(3)], reference[7:10])
    loader.close()


def test_loader_state_of_another_stream_is_refused(data_prepared):
    cfg, prepared, _ = data_prepared
    state = PackedLoader(prepared, cfg, seed=1).state_dict()
    with pytest.raises(DataError, match="seed=1"):
        PackedLoader(prepared, cfg, seed=2).load_state_dict(state)
    # Any number of ranks continues the stream, from a whole number of rounds: one buffer into it, two
    # ranks would take each other's buffers.
    PackedLoader(prepared, cfg, seed=1, rank=1, world_size=2).load_state_dict(state)
    one_in = PackedLoader(prepared, cfg, seed=1)
    next(one_in)
    with pytest.raises(
        DataError, match="1 buffers into the stream, not a whole number of rounds of world_size=2"
    ):
        PackedLoader(prepared, cfg, seed=1, rank=0, world_size=2).load_state_dict(one_in.state_dict())
    one_in.close()


def test_stats_report_packing(data_prepared):
    cfg, prepared, _ = data_prepared
    loader = PackedLoader(prepared, cfg, seed=0)
    assert loader.stats()["packing_efficiency"] == 0.0
    out = batches(loader, 40)
    stats = loader.stats()
    loss = sum((b.targets >= 0).sum().item() for b in out) / (40 * cfg.tokens_per_micro_batch)
    assert stats["packing_efficiency"] == pytest.approx(loss)
    assert 0 < stats["crop_share"] < 1 and 0 <= stats["overflow"] < 1 and stats["docs_per_batch"] >= 1
    assert stats["epoch"] > 0
    tight = PackedLoader(prepared, replace(cfg, max_num_docs=3), seed=0)  # 2 segments per document at most
    batches(tight, 40)
    assert tight.stats()["overflow"] > 0


# ---- bad input: a clear error, nothing lost --------------------------------------------------------


def bad_source(case: str, d: Path):
    """Write the bad source `case` under d; return data.source for it."""
    if case == "missing":
        return d / "nope" / "x.jsonl"
    if case == "no_match":
        return f"{d}/*.parquet"
    if case == "blank":
        return write_jsonl(d / "blank.jsonl", ["", "  ", "\n"])
    if case == "zero_rows":
        (d / "zero.jsonl").write_text("")
        return d / "zero.jsonl"
    if case == "no_column_jsonl":
        return write_jsonl(d / "body.jsonl", ["hello"], column="body")
    if case == "no_column_parquet":
        pq.write_table(pa.table({"body": ["a"]}), d / "b.parquet")
        return d / "b.parquet"
    if case == "not_text":
        return write_jsonl(d / "int.jsonl", [5])
    if case == "latin1_txt":
        (d / "bad.txt").write_bytes(b"ok \xff\xfe bytes")
        return d / "bad.txt"
    if case == "latin1_jsonl":
        (d / "bad.jsonl").write_bytes(b'{"text": "a\xff"}\n')
        return d / "bad.jsonl"
    if case == "mixed_kinds":
        (d / "m.txt").write_text("x")
        write_jsonl(d / "m.jsonl", ["y"])
        return f"{d}/m.*"
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "no such file or folder"),
        ("no_match", "no file matches"),
        ("blank", "no non-empty document.*3 empty"),
        ("zero_rows", "no non-empty document"),
        ("no_column_jsonl", "text_column='text' is not a column.*body"),
        ("no_column_parquet", "text_column='text' is not a column.*body"),
        ("not_text", "holds int64, not text"),
        ("latin1_txt", r"cannot read .*bad\.txt.*UTF-8"),
        ("latin1_jsonl", r"cannot read .*bad\.jsonl"),
        ("mixed_kinds", "mixes file kinds"),
    ],
)
def test_bad_sources_fail_clearly_and_leave_nothing_behind(tmp_path, case, message):
    source = bad_source(case, tmp_path)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=message):
        prepare(data_config(source, cache))
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_num_docs": 1}, "data.max_num_docs=1 must be at least 2"),
        (
            {"tokens_per_micro_batch": 100},
            "data.tokens_per_micro_batch=100 must be a positive multiple of 64",
        ),
        ({"max_seqlen": 1000}, "data.max_seqlen=1000 must be a positive multiple of 64"),
        ({"max_seqlen": 256}, "data.max_seqlen=256 must not exceed data.tokens_per_micro_batch=128"),
        ({"max_seqlen": 64, "max_num_docs": 2}, "data.max_num_docs=2 is too small.*at least 3"),
        ({"val_fraction": 1.0}, "data.val_fraction"),
        ({"val_fraction": 0.0}, r"data.val_fraction=0.0 must be in \(0, 1\)"),
        ({"vocab_size": 100}, "data.vocab_size=100"),
        ({"tokenizer": "no_such_encoding"}, "neither 'bpe' nor a tiktoken encoding"),
    ],
)
def test_bad_config_names_the_key(data_corpus, tmp_path, overrides, message):
    root, _ = data_corpus
    with pytest.raises(DataError, match=message):
        prepare(data_config(root / "docs.jsonl", tmp_path, **overrides))


def test_named_tiktoken_encoding_offline_says_so(data_corpus, tmp_path, monkeypatch):
    def offline(name):
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")

    monkeypatch.setattr(tok.tiktoken, "get_encoding", offline)
    with pytest.raises(DataError, match="cl100k_base.*TIKTOKEN_CACHE_DIR.*offline"):
        prepare(data_config(data_corpus[0] / "docs.jsonl", tmp_path, tokenizer="cl100k_base"))


def test_missing_split_or_unprepared_data_is_an_error(data_corpus, data_prepared, tmp_path):
    cfg, prepared, _ = data_prepared
    with pytest.raises(DataError, match="no prepared data.*prepare_data.py"):
        prepare(replace(cfg, cache_dir=str(tmp_path)), build=False)
    # Prepared (and so, the next time, opened) with no validation document: an error before any training.
    no_val = replace(cfg, val_fraction=1e-9, cache_dir=str(tmp_path))
    for _ in range(2):
        with pytest.raises(DataError, match="val split .* holds no documents.*val_fraction"):
            prepare(no_val)
    with pytest.raises(DataError, match="rank=2"):
        PackedLoader(prepared, cfg, rank=2, world_size=2)


@pytest.fixture
def data_copy(data_prepared, tmp_path):
    """A private copy of the prepared folder to damage."""
    cfg, prepared, _ = data_prepared
    cache = tmp_path / "cache"
    shutil.copytree(prepared.folder, cache / prepared.folder.name)
    return replace(cfg, cache_dir=str(cache)), cache / prepared.folder.name


def test_truncated_shard_is_detected(data_copy):
    cfg, folder = data_copy
    shard = folder / "train_00000.bin"
    shard.write_bytes(shard.read_bytes()[:-6])
    with pytest.raises(DataError, match=r"train_00000\.bin is truncated.*prepare again"):
        prepare(cfg, build=False)


def test_corrupted_shard_is_detected_by_its_checksum(data_copy):
    cfg, folder = data_copy
    shard = folder / "train_00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 0x01
    shard.write_bytes(bytes(raw))
    prepare(cfg, build=False)  # sizes only on other ranks
    with pytest.raises(DataError, match=r"train_00000\.bin is corrupted: its sha256"):
        prepare(cfg)  # rank 0 / prepare_data re-hash (data.verify)


def test_corrupted_index_and_manifest_are_detected(data_copy):
    cfg, folder = data_copy
    (folder / "train_00000.idx.npy").unlink()
    with pytest.raises(DataError, match=r"train_00000\.idx\.npy is missing"):
        prepare(cfg, build=False)
    (folder / "manifest.json").write_text("{ not json")
    with pytest.raises(DataError, match="manifest.json is unreadable or corrupted"):
        prepare(cfg, build=False)


def test_tokenizer_that_does_not_match_the_shards_is_refused(data_copy, data_corpus, tmp_path):
    cfg, folder = data_copy
    other = prepare(replace(cfg, vocab_size=320, cache_dir=str(tmp_path / "other")))
    shutil.copy(other.folder / "tokenizer.json", folder / "tokenizer.json")
    with pytest.raises(
        DataError, match=r"tokenizer\.json is tokenizer bpe-320-.* shards were tokenized with bpe-300"
    ):
        prepare(cfg, build=False)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_tokenizer_processes_default_to_the_cpus_the_process_may_use():
    """A process pinned to one CPU (as a SLURM allocation or taskset pins a job) tokenizes with one worker,
    however many CPUs the node has."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from data.shards import usable_cpus; print(usable_cpus(), os.cpu_count())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    pinned, node = map(int, out.stdout.split())
    assert pinned == 1 and node == os.cpu_count()
    assert shards_module.usable_cpus() == len(os.sched_getaffinity(0))
