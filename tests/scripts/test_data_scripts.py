"""The data scripts as a user runs them (subprocesses, Hydra overrides), on a tiny jsonl source."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from configs.schema import DataConfig, ModelConfig
from data import PackedLoader, prepare
from model.gpt import GPTShape
from tests.train_helpers import ROOT


@pytest.fixture(scope="module")
def data_overrides(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripts")
    with open(root / "docs.jsonl", "w") as f:
        for i in range(150):
            words = " ".join(f"w{(i * 7 + j) % 97}" for j in range([3, 30, 200][i % 3]))
            f.write(json.dumps({"text": f"document {i}: {words}"}) + "\n")
    return [
        f"data.source={root / 'docs.jsonl'}",
        f"data.cache_dir={root / 'cache'}",
        "data.vocab_size=300",
        "data.tokens_per_micro_batch=256",
        "data.max_seqlen=128",
        "data.max_num_docs=16",
    ]


def run(script: str, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"scripts/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_prepare_data_builds_once(data_overrides):
    first = run("prepare_data.py", *data_overrides)
    assert first.returncode == 0, first.stderr
    assert "prepared" in first.stdout and "tokenizing" in first.stderr  # the progress bar
    again = run("prepare_data.py", *data_overrides)
    assert again.returncode == 0 and "up to date" in again.stdout
    assert again.stdout.strip().splitlines()[-1] == first.stdout.strip().splitlines()[-1]  # the folder


def test_inspect_data_writes_batches(data_overrides, tmp_path):
    out = tmp_path / "b.npz"
    proc = run("inspect_data.py", *data_overrides, "+batches=3", f"+out={out}")
    assert proc.returncode == 0, proc.stderr
    arrays = np.load(out)
    assert arrays["input_ids"].shape == arrays["targets"].shape == arrays["position_ids"].shape == (3, 256)
    assert arrays["cu_seqlens"].shape == (3, 17) and arrays["cu_seqlens"].dtype == np.int32
    assert int(arrays["max_seqlen"]) == 128 and arrays["input_ids"][0, 0] == int(arrays["bos_id"])
    assert "batch 2:" in proc.stdout


def test_doc_stats_recommends_max_num_docs(data_overrides):
    proc = run("doc_stats.py", *data_overrides)
    assert proc.returncode == 0, proc.stderr
    assert "segments per buffer" in proc.stdout and "recommended: data.max_num_docs=" in proc.stdout


def test_doc_stats_measures_how_evenly_ranks_share_attention_work(data_overrides):
    """+ranks=2: each rank's attention FLOPs per step against a per-document count over the same
    micro-batches (n(n+1)/2 causal pairs a segment, 14 FLOPs per pair, head dim and head)."""
    model = ["model.depth=2", "model.head_dim=32"]
    proc = run("doc_stats.py", *data_overrides, *model, "total_batch_tokens=1024", "+ranks=2", "+steps=3")
    assert proc.returncode == 0, proc.stderr
    overrides = dict(o.split("=", 1) for o in data_overrides)
    data_cfg = OmegaConf.merge(
        OmegaConf.structured(DataConfig), {k.removeprefix("data."): v for k, v in overrides.items()}
    )
    prepared = prepare(data_cfg, build=False)
    shape = GPTShape.from_config(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), {"depth": 2, "head_dim": 32}), prepared.vocab_size
    )
    work = np.zeros((3, 2))
    for rank in range(2):
        batches = iter(PackedLoader(prepared, data_cfg, "train", rank=rank, world_size=2, seed=1337))
        for step in range(3):
            for _ in range(2):  # 1024 tokens a step = 256 x 2 ranks x 2 micro-batches
                cu = next(batches).cu_seqlens.tolist()
                pairs = sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu, cu[1:], strict=False))
                work[step, rank] += 14 * shape.head_dim * shape.n_head * shape.n_layer * pairs
    spread = work.max(axis=1) - work.min(axis=1)
    assert spread.max() > 0  # the ranks' shares differ: the comparison says something
    mean = float(proc.stdout.split("micro-batches, 3 steps")[1].split("mean ")[1].split(" TFLOP")[0])
    line = proc.stdout.split("spread between ranks (most - least) per step: ")[1].splitlines()[0]
    got_spread = float(line.split("mean ")[1].split(" TFLOP")[0])
    got_max = float(line.split("max ")[1].split(" TFLOP")[0])
    assert mean == pytest.approx(work.mean() / 1e12, rel=1e-3)
    assert got_spread == pytest.approx(spread.mean() / 1e12, rel=1e-3)
    assert got_max == pytest.approx(spread.max() / 1e12, rel=1e-3)


def test_bench_data_reports_throughput(data_overrides):
    proc = run("bench_data.py", *data_overrides, "+seconds=0.2", "+world_size=2")
    assert proc.returncode == 0, proc.stderr
    assert "tokenization" in proc.stdout and "PackedLoader, rank 0 of 2" in proc.stdout


def test_bad_input_exits_with_a_clear_error(data_overrides):
    proc = run("prepare_data.py", *data_overrides, "data.max_num_docs=1")
    assert proc.returncode != 0 and "data.max_num_docs=1 must be at least 2" in proc.stderr
    hub = run(
        "prepare_data.py", *data_overrides, "data.source=nobody/no-such-dataset", env={"HF_HUB_OFFLINE": "1"}
    )
    assert hub.returncode != 0 and "loading it as a Hub dataset failed" in hub.stderr
