"""Compressed JSON lines (.jsonl.gz, .json.gz, .jsonl.zst, .json.zst; files, folders and globs): the same
shards and batches as the plain file they were compressed from, and a corrupt archive named in the error."""

import gzip
from dataclasses import replace

import pytest
import zstandard

from data import DataError, PackedLoader, prepare
from tests.data.test_pipeline import data_config, make_texts, write_jsonl

COMPRESS = {".gz": gzip.compress, ".zst": lambda raw: zstandard.ZstdCompressor().compress(raw)}


def shard_hashes(prepared) -> dict:
    return {e["tokens"]: e["files"][e["tokens"]]["sha256"] for e in prepared.manifest["shards"]}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain")
    raw = write_jsonl(root / "docs.jsonl", make_texts(60)).read_bytes()
    cfg = data_config(root / "docs.jsonl", root / "cache")
    return raw, cfg, prepare(cfg)


@pytest.mark.parametrize("inner", [".jsonl", ".json"])
@pytest.mark.parametrize("outer", [".gz", ".zst"])
@pytest.mark.parametrize("form", ["file", "folder", "glob"])
def test_compressed_json_gives_the_shards_and_batches_of_the_plain_file(plain, tmp_path, inner, outer, form):
    raw, cfg, reference = plain
    folder = tmp_path / "corpus"
    folder.mkdir()
    path = folder / f"docs{inner}{outer}"
    path.write_bytes(COMPRESS[outer](raw))
    source = {"file": path, "folder": folder, "glob": f"{folder}/*{inner}{outer}"}[form]
    prepared = prepare(replace(cfg, source=str(source), cache_dir=str(tmp_path / "cache")))
    assert prepared.tokenizer_id == reference.tokenizer_id
    assert shard_hashes(prepared) == shard_hashes(reference)
    batches = []
    for source_prepared in (prepared, reference):
        loader = PackedLoader(source_prepared, cfg, split="train", seed=0)
        batches.append(next(loader))
        loader.close()
    got, want = batches
    assert got.input_ids.tolist() == want.input_ids.tolist()
    assert got.cu_seqlens.tolist() == want.cu_seqlens.tolist()


@pytest.mark.parametrize("name", ["docs.jsonl.gz", "docs.json.zst"])
def test_a_corrupt_archive_is_named_in_the_error(plain, tmp_path, name):
    raw, cfg, _ = plain
    good = tmp_path / "a_good.jsonl.gz"
    good.write_bytes(gzip.compress(raw))
    bad = tmp_path / name
    bad.write_bytes(COMPRESS[bad.suffix](raw)[:40])  # cut short
    with pytest.raises(DataError, match=f"cannot read {bad}"):
        prepare(replace(cfg, source=f"{tmp_path}/*", cache_dir=str(tmp_path / "cache")))
