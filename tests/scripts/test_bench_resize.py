"""scripts/bench_resize.py: bad arguments are refused before any run, and, slow, a tiny run on two gloo
ranks killed and resumed on one and on two, its comparison worked out again here from the run folders."""

import json
import subprocess
import sys

import pytest

from tests.train_helpers import ROOT, small_run


def resize(*args, check=True):
    cmd = [sys.executable, "scripts/bench_resize.py", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=check, timeout=900)


def tiny(corpus) -> list[str]:
    """small_run's overrides (12 steps, a save every 4, an evaluation every 6) but its run_dir, which the
    script sets, with 4 micro-batches a step: one rank sums their gradients in another order than two ranks
    (two each, then the all-reduce), so the one-rank leg differs by rounding (with 2 micro-batches both sum
    the same two terms, bit for bit)."""
    return [o for o in small_run(corpus, "unused") if not o.startswith("run_dir=")] + [
        "total_batch_tokens=1024"
    ]


@pytest.mark.parametrize(
    "kill_after, overrides, message",
    [
        (12, ["max_steps=12", "save_every=4"], "--kill-after 12: must be less than max_steps=12"),
        (3, ["max_steps=12", "save_every=4"], "--kill-after 3: must be at least save_every=4"),
        (6, ["save_every=4"], "give max_steps=... in train.py's overrides after --"),
        (6, ["max_steps=12"], "give save_every=... in train.py's overrides after --"),
        (6, ["max_steps=12", "save_every=4", "run_dir=x"], "run_dir: set by this script"),
    ],
)
def test_bad_arguments_are_refused_before_any_run(tmp_path, kill_after, overrides, message):
    work = tmp_path / "work"
    args = ["--gpus", "2", "--then", "1", "--kill-after", str(kill_after), "--out", str(tmp_path / "out")]
    proc = resize(*args, "--work", str(work), "--", *overrides, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not work.exists() and not (tmp_path / "out").exists()


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rel_diff(got: dict, want: dict, key: str) -> float:
    return abs(got[key] - want[key]) / abs(want[key])


@pytest.mark.slow
def test_killed_on_two_ranks_resumes_on_one_and_on_two(tmp_path, corpus):
    work, out = tmp_path / "work", tmp_path / "out"
    args = ["--gpus", "2", "--then", "1", "2", "--kill-after", "6", "--out", str(out), "--work", str(work)]
    resize(*args, "--", *tiny(corpus))
    result = json.loads((out / "resize.json").read_text())
    assert (result["gpus"], result["kill_after"]) == (2, 6)
    assert (out / "loss.png").stat().st_size > 0

    # The kill left the run cut short, its newest checkpoint the one every leg resumed from.
    killed = records(work / "killed")
    assert 6 <= len(killed) < 12 and result["killed_at_step"] == len(killed)
    saved = sorted(int(p.name[5:]) for p in (work / "killed" / "checkpoints").glob("step_*"))
    resumed = saved[-1]
    assert 4 <= resumed <= len(killed)
    reference = records(work / "reference")
    assert [r["step"] for r in reference] == list(range(1, 13))
    assert reference[-1]["loss"] < 0.9 * reference[0]["loss"]  # the model learns: the losses differ

    assert [leg["gpus"] for leg in result["legs"]] == [1, 2]
    for leg in result["legs"]:
        assert (leg["resumed_from_step"], leg["written_by_ranks"]) == (resumed, 2)
        got = records(work / f"resumed_on_{leg['gpus']}")
        assert [r["step"] for r in got] == list(range(1, 13))
        after = [(a, b) for a, b in zip(got, reference, strict=True) if a["step"] > resumed]
        loss = max(rel_diff(a, b, "loss") for a, b in after)
        val = max(rel_diff(a, b, "val_loss") for a, b in after if "val_loss" in b)
        assert leg["max_rel_diff_loss"] == pytest.approx(loss, rel=1e-9, abs=1e-15)
        assert leg["max_rel_diff_val_loss"] == pytest.approx(val, rel=1e-9, abs=1e-15)
        keys = ("loss", "grad_norm", "val_loss")
        same = all(a.get(k) == b.get(k) for a, b in zip(got, reference, strict=True) for k in keys)
        assert leg["bitwise"] == same
        assert (leg["last_loss"], leg["reference_last_loss"]) == (got[-1]["loss"], reference[-1]["loss"])
    one, two = result["legs"]
    assert two["bitwise"] and two["max_rel_diff_loss"] == 0
    assert not one["bitwise"] and 0 < one["max_rel_diff_loss"] < 2e-2
    assert one["max_rel_diff_val_loss"] < 2e-2
