"""The data presets (configs/data): every one composes and depends on nothing outside the repository;
data=local reads its path from the environment or says how to give it; a Hub preset offline says it needs a
network. Each check runs train.py as a user would."""

import re

import pytest
from hydra import compose, initialize_config_dir

from configs.data_schema import DataConfig
from configs.schema import register_configs
from data.config import DataError
from data.sources import open_source
from tests.train_helpers import ROOT, run_train

PRESETS = sorted(p.stem for p in (ROOT / "configs" / "data").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_composes_and_names_no_path_outside_the_repository(preset, monkeypatch):
    monkeypatch.setenv("VARLEN_GPT_DATA", "corpus/*.parquet")
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("config", overrides=[f"data={preset}"])
    assert cfg.data.source and not re.match(r"(\.\./|/)", cfg.data.source), cfg.data.source
    assert "../" not in (ROOT / "configs" / "data" / f"{preset}.yaml").read_text()


def test_local_preset_takes_the_path_from_the_environment(tmp_path, corpus):
    source, cache = corpus
    common = [f"run_dir={tmp_path / 'run'}", "data=local", f"data.cache_dir={cache}", "data.vocab_size=320"]
    common += ["data.tokens_per_micro_batch=256", "data.max_seqlen=128", "data.max_num_docs=16"]
    common += ["model.depth=1", "model.head_dim=32", "compile=false", "max_steps=2", "total_batch_tokens=256"]
    unset = run_train(common, check=False, timeout=120, env_extra={"VARLEN_GPT_DATA": ""})
    assert unset.returncode != 0 and "Traceback" not in unset.stderr
    assert "data.source is empty: data=local takes it from the environment variable VARLEN_GPT_DATA" in (
        unset.stderr
    )
    run_train(common, env_extra={"VARLEN_GPT_DATA": str(source)})
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2


OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.parametrize(
    "preset, name",
    [("fineweb_edu", "HuggingFaceFW/fineweb-edu"), ("climbmix", "karpathy/climbmix-400b-shuffle")],
)
def test_a_hub_preset_offline_says_it_needs_a_network(tmp_path, preset, name):
    args = [f"run_dir={tmp_path / 'run'}", f"data={preset}", f"data.cache_dir={tmp_path / 'cache'}"]
    args += ["data.max_docs=10", "compile=false"]
    proc = run_train(args, check=False, timeout=300, env_extra={**OFFLINE, "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"data.source={name!r}" in proc.stderr
    assert "Hub datasets need a network" in proc.stderr


def test_hf_paths_offline_say_they_need_a_network(tmp_path):
    source = "hf://datasets/karpathy/climbmix-400b-shuffle/shard_0000[0-1].parquet"
    args = [f"run_dir={tmp_path / 'run'}", f"data.source='{source}'", f"data.cache_dir={tmp_path / 'cache'}"]
    args += ["compile=false"]
    proc = run_train(args, check=False, timeout=300, env_extra={**OFFLINE, "HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"data.source={source!r}: reading these Hub files failed" in proc.stderr
    assert "hf:// paths need a network" in proc.stderr


@pytest.mark.parametrize(
    "source",
    ["hf://karpathy/climbmix-400b-shuffle/shard_00000.parquet", "hf://datasets/owner/name/notes.md"],
)
def test_a_malformed_hf_path_is_refused_before_any_reading(source):
    with pytest.raises(DataError, match=r"an hf:// source is hf://datasets/<owner>/<name>"):
        open_source(DataConfig(source=source))


def test_hf_paths_name_their_cache_after_the_dataset():
    src = open_source(DataConfig(source="hf://datasets/karpathy/climbmix-400b-shuffle@main/shard_*.parquet"))
    assert (src.kind, src.name, src.hub["format"]) == ("hub", "climbmix-400b-shuffle", "parquet")
