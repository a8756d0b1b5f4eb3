"""CORE in a run (train.py's core_every) and scripts/eval.py on that run, against eval/core.py's
evaluate_core and eval/loss.py's evaluate on the checkpoint's own model; a missing bundle stops both
before any work."""

import json
import runpy
import sys

import pytest
from omegaconf import OmegaConf

from configs.schema import ConfigError
from eval.core import BUNDLE_URL, evaluate_core, load_bundle, load_for_run
from tests.eval.core_helpers import TASKS, write_bundle
from tests.eval.test_core import core_config
from tests.scripts.test_export import CPU, checkpoint, checkpoint_model, run_data, script
from tests.train_helpers import ROOT, metrics, run_train, small_run

LABELS = [t["label"] for t in TASKS]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return write_bundle(tmp_path_factory.mktemp("core") / "eval_bundle")


@pytest.fixture(scope="module")
def core_run(corpus, bundle, tmp_path_factory):
    """A 12-step run with CORE every 6 steps."""
    run_dir = tmp_path_factory.mktemp("core_run") / "run"
    run_train(
        small_run(corpus, run_dir, "core_every=6", f"core.bundle_dir={bundle}", "core.batch_tokens=256")
    )
    return run_dir


def core_of_checkpoint(path, bundle):
    model, data = checkpoint_model(path), run_data(path)
    return evaluate_core(model, data.tokenizer, load_bundle(core_config(bundle)), 256, CPU)


def test_a_run_logs_core_every_core_every_steps(core_run, bundle):
    records = metrics(core_run)
    keys = {"core", *(f"core/{label}" for label in LABELS)}
    assert [r["step"] for r in records if keys <= r.keys()] == [6, 12]
    assert not any("core" in r for r in records if r["step"] not in (6, 12))
    want = core_of_checkpoint(checkpoint(core_run, 12), bundle)
    assert records[-1]["core"] == pytest.approx(want.core, abs=1e-12)
    for label in LABELS:
        assert records[-1][f"core/{label}"] == pytest.approx(want.centered[label], abs=1e-12)


def test_eval_script_gives_core_and_bits_per_byte(core_run, bundle, tmp_path):
    out = tmp_path / "scores.json"
    proc = script(
        "eval.py", core_run, f"core.bundle_dir={bundle}", "core.batch_tokens=256", "--eval", "core,bpb",
        "--tokens", 512, "--json", out,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    scores = json.loads(out.read_text())
    last = metrics(core_run)[-1]
    assert scores["step"] == 12
    assert scores["core"]["core"] == pytest.approx(last["core"], abs=1e-12)
    assert scores["core"]["centered"] == pytest.approx({k: last[f"core/{k}"] for k in LABELS}, abs=1e-12)
    want = core_of_checkpoint(checkpoint(core_run, 12), bundle)
    assert scores["core"]["accuracy"] == want.accuracy
    # The same tokens as the run's own evaluation at step 12 (eval_tokens=512).
    assert scores["bpb"]["loss"] == pytest.approx(last["val_loss"], abs=1e-6)
    assert scores["bpb"]["bpb"] == pytest.approx(last["val_bpb"], abs=1e-6)
    rows = [line.split() for line in proc.stdout.splitlines()]
    table = {row[0]: row[1:] for row in rows if row and row[0] in LABELS}
    assert table == {
        k: [f"{scores['core']['accuracy'][k]:.4f}", f"{scores['core']['centered'][k]:.4f}"] for k in LABELS
    }
    assert f"CORE {scores['core']['core']:.4f}" in " ".join(proc.stdout.split())
    # The test bundle's tasks are none of CORE's: the mean is said not to be a CORE score.
    assert len(scores["core"]["missing_tasks"]) == 22 and "hellaswag" in scores["core"]["missing_tasks"]
    assert "the bundle lacks 22 of CORE's 22 tasks" in proc.stdout


def eval_main(monkeypatch, *args) -> str:
    """scripts/eval.py's main in this process (no interpreter start-up) for an error: its message."""
    monkeypatch.setattr(sys, "argv", ["eval.py", *map(str, args)])
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(str(ROOT / "scripts" / "eval.py"), run_name="__main__")
    return str(exit.value.code)


def test_a_missing_bundle_stops_eval_and_train_before_any_work(corpus, tmp_path, monkeypatch):
    missing = tmp_path / "no_bundle"
    message = eval_main(monkeypatch, tmp_path / "no_run", f"core.bundle_dir={missing}")
    assert (
        message.startswith(f"error: core.bundle_dir={str(missing)!r}: no such folder")
        and BUNDLE_URL in message
    )
    cache = tmp_path / "cache"
    args = small_run((corpus[0], cache), tmp_path / "run", "core_every=6", f"core.bundle_dir={missing}")
    proc = run_train(args, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"error: core.bundle_dir={str(missing)!r}: no such folder" in proc.stderr
    assert not cache.exists()  # no data was prepared


def test_bad_settings_are_named(core_run, bundle, monkeypatch):
    message = eval_main(monkeypatch, core_run, "--eval", "bpb", f"core.bundle_dir={bundle}")
    assert "core.* overrides are for --eval core" in message
    assert "max_per_tasks" in eval_main(monkeypatch, core_run, "core.max_per_tasks=3")
    message = eval_main(monkeypatch, core_run, f"core.bundle_dir={bundle}", "core.max_per_task=1")
    assert "task schema draws 1 few-shot examples" in message
    message = eval_main(monkeypatch, core_run, f"core.bundle_dir={bundle}", "core.batch_tokens=100")
    assert "core.batch_tokens=100 must be a positive multiple of 64" in message
    run = OmegaConf.create({"core_every": -1, "core": core_config(bundle), "data": {"max_seqlen": 128}})
    with pytest.raises(ConfigError, match="core_every=-1 must be at least 0"):
        load_for_run(run)
    run.core_every, run.core.batch_tokens = 6, 64
    with pytest.raises(ConfigError, match="core.batch_tokens=64 must be at least data.max_seqlen=128"):
        load_for_run(run)


def test_core_in_a_two_rank_fsdp_run_matches_one_process(corpus, bundle, tmp_path):
    """Ranks score disjoint items of the bundle through FSDP's gathered weights; the scores are those of
    the checkpoint's model in one process."""
    run_dir = tmp_path / "fsdp"
    args = small_run(
        corpus, run_dir, "parallel=fsdp", "max_steps=4", "save_every=4", "eval_every=4", "sample_every=4",
        "core_every=4", f"core.bundle_dir={bundle}", "core.batch_tokens=256",
    )  # fmt: skip
    run_train(([], args), torchrun_procs=2)
    want = core_of_checkpoint(checkpoint(run_dir, 4), bundle)
    last = metrics(run_dir)[-1]
    assert last["step"] == 4 and last["core"] == pytest.approx(want.core, abs=1e-12)
