"""scripts/bench_train.py on the CPU: each `+models` entry is its configs/model preset, with the command
line's model overrides on top, whatever preset the command line itself selects."""

import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from configs.schema import ModelConfig
from model.gpt import GPTShape
from tests.train_helpers import ROOT, write_corpus

pytestmark = pytest.mark.slow


def preset_heads(name: str, **overrides) -> str:
    """Heads as the preset's YAML, merged over the schema's defaults, derives them."""
    preset = OmegaConf.load(ROOT / "configs" / "model" / f"{name}.yaml")
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), preset, overrides)
    shape = GPTShape.from_config(cfg, vocab_size=320)
    return f"{shape.n_head} x {shape.head_dim}"


def tiny_bench(tmp_path) -> list[str]:
    """A corpus of 100 documents and the overrides of a quick CPU benchmark of one step on it."""
    source = write_corpus(tmp_path / "docs.jsonl", n_docs=100)
    return [
        f"data.source={source}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.vocab_size=320",
        "data.tokens_per_micro_batch=256",
        "data.max_seqlen=128",
        "data.max_num_docs=16",
        "total_batch_tokens=512",
        "compile=false",
        "+backends=[reference]",
        "+warmup=1",
        "+steps=1",
    ]


def test_bench_train_uses_each_model_preset(tmp_path):
    out = tmp_path / "bench.json"
    args = [
        *tiny_bench(tmp_path),
        "model=d20",  # the +models list decides, not this
        "model.depth=1",  # a model override applies to every preset
        "+models=[tiny,d12]",
        f"+out={out}",
        "+profile_step=true",
    ]
    cmd = [sys.executable, "scripts/bench_train.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, check=True, timeout=600, capture_output=True, text=True)
    assert "profile of one step, tiny reference" in proc.stdout
    assert "profile of one step, d12 reference" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["heads"]) for r in rows] == [
        ("tiny", preset_heads("tiny", depth=1)),
        ("d12", preset_heads("d12", depth=1)),
    ]
    assert rows[0]["heads"] != rows[1]["heads"]  # the presets differ in head_dim, so this can tell them apart


def test_bench_train_skips_fa4_with_a_note_where_it_cannot_run(tmp_path):
    """attention=fa4 cannot run on the CPU: its rows are left out with the reason, the others still run."""
    out = tmp_path / "bench.json"
    args = [a for a in tiny_bench(tmp_path) if not a.startswith("+backends=")]
    args += ["device=cpu", "+models=[tiny]", "model.depth=1", "+backends=[reference,fa4]", f"+out={out}"]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_train.py", *args],
        cwd=ROOT,
        check=True,
        timeout=600,
        capture_output=True,
        text=True,
    )
    assert "skipping attention=fa4 cannot run here" in proc.stdout
    assert "this run is on cpu" in proc.stdout
    report = json.loads(out.read_text())
    assert [r["attention"] for r in report["rows"]] == ["reference"]
    assert report["env"]["flash_attn_4"] is None


def test_bench_train_on_the_cpu_has_no_steady_peak_and_skips_the_memory_snapshot(tmp_path):
    """The peak RSS cannot be reset, so the timed steps' own peak is None; the allocator history is CUDA's."""
    out, snapshots = tmp_path / "bench.json", tmp_path / "snapshots"
    args = [*tiny_bench(tmp_path), "device=cpu", "+models=[tiny]", "model.depth=1", f"+out={out}"]
    args.append(f"+memory_snapshot={snapshots}")
    cmd = [sys.executable, "scripts/bench_train.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, check=True, timeout=600, capture_output=True, text=True)
    assert "+memory_snapshot skipped: it records the CUDA allocator, this run is on cpu" in proc.stdout
    assert "profile of one step" not in proc.stdout  # profiled only when asked (+profile_step=true)
    assert not snapshots.exists()
    (row,) = json.loads(out.read_text())["rows"]
    assert row["steady_peak_mem_gb"] is None and row["peak_mem_gb"] > 0
    assert "steady GB" in proc.stdout


def test_under_torchrun_each_mode_reports_the_memory_its_sharding_leaves_on_a_rank(tmp_path):
    """Two gloo ranks: ddp holds every parameter and optimiser state on each rank; zero the parameters and
    about half the states; fsdp about half of both (the model's own parameter count is the reference)."""
    common = [*tiny_bench(tmp_path), "+models=[d12]", "model.depth=2"]
    rows = {}
    for mode in ("ddp", "zero", "fsdp"):
        out = tmp_path / f"{mode}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        cmd += ["scripts/bench_train.py", *common, f"parallel={mode}", f"+out={out}"]
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=600)
        report = json.loads(out.read_text())
        assert report["env"]["world_size"] == 2 and report["env"]["parallel"] == mode
        (rows[mode],) = report["rows"]
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), {"depth": 2, "head_dim": 128})
    shape = GPTShape.from_config(cfg, vocab_size=320)
    d, v = shape.n_embd, shape.padded_vocab_size
    matrices = shape.n_layer * 12 * d * d
    params = (matrices + 2 * v * d) * 4 / 1e9  # fp32
    states = (matrices + 2 * 2 * v * d) * 4 / 1e9  # Muon's momentum, AdamW's two moments
    close = dict(rel=1e-6, abs=1e-7)  # AdamW's step counters add a few bytes
    ddp, zero, fsdp = rows["ddp"], rows["zero"], rows["fsdp"]
    assert ddp["params_gb"] == pytest.approx(params)
    assert ddp["optim_state_gb"] == pytest.approx(states, **close)
    assert zero["params_gb"] == pytest.approx(params)
    # The largest rank's share: at least half, at most half plus the largest parameter's states (the
    # embedding's two moments).
    assert states / 2 <= zero["optim_state_gb"] <= states / 2 + 2 * v * d * 4 / 1e9 + 1e-7
    assert fsdp["params_gb"] == pytest.approx(params / 2)
    assert fsdp["optim_state_gb"] == pytest.approx(states / 2, **close)
    for row in rows.values():
        assert row["tokens_per_s"] == pytest.approx(2 * row["tokens_per_s_per_rank"])
        assert row["steady_peak_mem_gb"] is None  # gloo on the CPU
