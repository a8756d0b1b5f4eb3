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


def test_bench_train_uses_each_model_preset(tmp_path):
    source = write_corpus(tmp_path / "docs.jsonl", n_docs=100)
    out = tmp_path / "bench.json"
    args = [
        f"data.source={source}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.vocab_size=320",
        "data.tokens_per_micro_batch=256",
        "data.max_seqlen=128",
        "data.max_num_docs=16",
        "total_batch_tokens=512",
        "compile=false",
        "model=d20",  # the +models list decides, not this
        "model.depth=1",  # a model override applies to every preset
        "+models=[tiny,d12]",
        "+backends=[reference]",
        "+warmup=1",
        "+steps=1",
        f"+out={out}",
    ]
    subprocess.run([sys.executable, "scripts/bench_train.py", *args], cwd=ROOT, check=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["heads"]) for r in rows] == [
        ("tiny", preset_heads("tiny", depth=1)),
        ("d12", preset_heads("d12", depth=1)),
    ]
    assert rows[0]["heads"] != rows[1]["heads"]  # the presets differ in head_dim, so this can tell them apart
