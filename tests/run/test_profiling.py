"""train.py's profile.* options (run/profiling.py): a trace of one step every `profile.every` steps, each a
Chrome trace of that step's work on every rank, and start-up errors for settings that cannot run."""

import json
import pickle

import pytest
import torch

from scripts.memory_peak import find_peak
from tests.train_helpers import run_train, small_run


def test_traces_of_every_nth_step_hold_that_steps_work(corpus, tmp_path):
    run_dir = tmp_path / "run"
    run_train(small_run(corpus, run_dir, "max_steps=5", "save_every=5", "profile.every=2"))
    profile = run_dir / "profile"
    assert sorted(p.name for p in profile.iterdir()) == ["step_000002", "step_000004"]
    for step in ("step_000002", "step_000004"):
        assert [p.name for p in (profile / step).iterdir()] == ["rank0.json"]
        events = json.loads((profile / step / "rank0.json").read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        # The step's forward and backward ran inside the trace: autograd's backward and the optimiser step.
        assert any(name.startswith("autograd::engine::evaluate_function") for name in names), step
        assert any("Optimizer.step" in name for name in names), step


def test_profile_settings_that_cannot_run_are_refused_at_start(corpus, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(small_run(corpus, run_dir, "profile.memory_snapshot=true"), check=False)
    assert proc.returncode == 1
    assert "error: profile.memory_snapshot=true records the CUDA caching allocator; this run is on cpu" in (
        proc.stderr
    )
    proc = run_train(small_run(corpus, run_dir, "profile.every=-1"), check=False)
    assert proc.returncode == 1 and "error: profile.every=-1 must be 0 (off)" in proc.stderr
    assert not (run_dir / "profile").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_snapshots_at_the_profiled_steps_hold_the_runs_allocations(corpus, tmp_path):
    run_dir = tmp_path / "run"
    run_train(
        small_run(
            corpus,
            run_dir,
            "device=cuda",
            "max_steps=4",
            "save_every=4",
            "profile.every=2",
            "profile.memory_snapshot=true",
        )
    )
    profile = run_dir / "profile"
    names = sorted(p.name for p in profile.iterdir())
    assert names == [
        "memory_step_000002_rank0.pickle",
        "memory_step_000004_rank0.pickle",
        "step_000002",
        "step_000004",
    ]
    with open(profile / "memory_step_000004_rank0.pickle", "rb") as f:
        peak = find_peak(pickle.load(f))
    # Recorded from the first step on: the steps' activations, allocated by the model's code.
    assert peak.bytes > 0 and any(site.startswith("model/") for site, _, _ in peak.sites)
