"""train.py end to end, in subprocesses: the default run, torchrun with two ranks, wandb offline, and bad
configs. Models and data are tiny; compile is off except where tested. Faults and resumes are in
tests/run/test_faults.py."""

import os
import subprocess
import sys

import pytest

from tests.train_helpers import metrics, run_train, small_run


# About 2-3 minutes on 2 cores: with the slow tests. In CI, test_faults.py's two default runs compile
# the same model, evaluate, sample and save, and check that nothing recompiles.
@pytest.mark.slow
def test_default_run_learns_evaluates_samples_and_saves(tmp_path, stdlib_cache):
    """`python train.py` as a user runs it, shortened: stdlib data, compiled model, CPU."""
    run_dir = tmp_path / "run"
    proc = run_train(
        [
            f"run_dir={run_dir}",
            f"data.cache_dir={stdlib_cache}",
            "max_steps=60",
            "eval_every=30",
            "sample_every=30",
            "save_every=30",
        ],
        env_extra={"TORCH_LOGS": "recompiles"},
    )
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 61))
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [30, 60]
    # Far below the start (ln 4096 = 8.3 nats, uniform guessing) on held-out files, and a sane bpb.
    assert evals[-1]["val_loss"] < first - 1.5 and 0 < evals[-1]["val_bpb"] < 4
    assert all(isinstance(r["sample"], str) for r in evals)
    for key in ("lr", "grad_norm", "tokens_per_s", "peak_mem_gb", "packing_efficiency"):
        assert all(key in r for r in records), key
    assert (run_dir / "checkpoints" / "step_000060" / "manifest.json").is_file()
    assert "Recompiling" not in proc.stderr


def test_torchrun_two_ranks_match_single_process(tmp_path, corpus):
    single = tmp_path / "single"
    run_train(small_run(corpus, single, "max_steps=6", "save_every=6"))
    ranks = tmp_path / "ranks"
    logs = tmp_path / "logs"
    proc = run_train(
        ([f"--log-dir={logs}", "--redirects=3"], small_run(corpus, ranks, "max_steps=6", "save_every=6")),
        torchrun_procs=2,
    )
    a, b = metrics(single), metrics(ranks)
    assert [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
        assert (
            y["val_loss"] == pytest.approx(x["val_loss"], rel=1e-4)
            if "val_loss" in x
            else "val_loss" not in y
        )
    rank_logs = {p.parent.name: p.read_text() for p in logs.rglob("std*.log") if p.stat().st_size}
    assert any(name == "0" for name in rank_logs), proc.stdout
    assert not [name for name in rank_logs if name != "0"], rank_logs  # only rank 0 prints


def test_a_validation_split_too_small_for_the_ranks_is_refused_before_training(tmp_path, corpus):
    """Each rank evaluates buffers of its own: a held-out split of one 1,024-token buffer cannot serve two
    ranks, which must be said before the first step rather than at the first evaluation."""
    from configs.data_schema import DataConfig
    from data import PackedLoader, prepare

    geometry = ["data.tokens_per_micro_batch=1024", "data.max_seqlen=256", "total_batch_tokens=2048"]
    source, cache = corpus  # small_run's data, in this geometry
    cfg = DataConfig(
        source=str(source),
        cache_dir=str(cache),
        vocab_size=320,
        tokens_per_micro_batch=1024,
        max_seqlen=256,
        max_num_docs=16,
    )
    val = list(PackedLoader(prepare(cfg), cfg, split="val", infinite=False))
    assert len(val) == 1  # the whole split in one buffer: what makes this configuration wrong for 2 ranks
    run_dir = tmp_path / "run"
    proc = run_train(([], small_run(corpus, run_dir, *geometry)), torchrun_procs=2, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    said = "the validation split packs into 1 buffer(s) of data.tokens_per_micro_batch=1024"
    assert said in out, out[-3000:]
    assert "fewer than the 2 ranks" in out and "raise data.val_fraction" in out
    assert "step 1" not in out and not (run_dir / "metrics.jsonl").exists()


def test_wandb_offline_run_is_written_for_later_sync(tmp_path, corpus):
    run_dir = tmp_path / "run"
    run_train(
        small_run(
            corpus, run_dir, "max_steps=4", "wandb.mode=offline", "wandb.name=offline-test", "wandb.tags=[ci]"
        ),
        env_extra={"WANDB_API_KEY": ""},
    )
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    sync = subprocess.run(
        [sys.executable, "-m", "wandb", "sync", "--dry-run", str(runs[0])],
        capture_output=True,
        text=True,
        env={**os.environ, "WANDB_API_KEY": ""},
    )
    assert sync.returncode == 0 and "Would sync 1 run" in sync.stdout + sync.stderr
    # A resumed run continues the same wandb run id.
    run_train(
        small_run(corpus, run_dir, "max_steps=6", "wandb.mode=offline"), env_extra={"WANDB_API_KEY": ""}
    )
    ids = {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")}
    assert len(ids) == 1, ids
    # A checkpoint of another model depth is refused, naming the difference.
    proc = run_train(small_run(corpus, run_dir, "max_steps=8", "model.depth=2"), check=False)
    assert proc.returncode != 0 and "model.depth: checkpoint 1 vs config 2" in proc.stderr
    disabled = tmp_path / "disabled"
    run_train(small_run(corpus, disabled, "max_steps=2"))
    assert not (disabled / "wandb").exists()


def test_without_a_terminal_the_log_is_plain_lines(tmp_path, corpus):
    """Under a scheduler stdout is a file: one line every log_every steps, no progress bar."""
    proc = run_train(small_run(corpus, tmp_path / "run", "log_every=5"))
    steps = [
        line.split(" | ")[0]
        for line in proc.stdout.splitlines()
        if line.startswith("step ") and " | " in line
    ]
    assert steps == ["step 5/12", "step 10/12", "step 12/12"]
    assert "\r" not in proc.stdout + proc.stderr
