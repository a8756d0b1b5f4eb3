"""deterministic=true on the GPU at real sizes: d12, 65,536-token micro-batches, two micro-steps per
step, Muon, compiled, our kernels. Two runs give the same bits, and a run killed by SIGKILL and resumed
gives the uninterrupted run's bits."""

import signal

import pytest
import torch

from tests.train_helpers import assert_same_run, final_weights, logged_steps, run_train, start_train, wait_for

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def d12_run(run_dir, cache) -> list[str]:
    return [
        f"run_dir={run_dir}",
        f"data.cache_dir={cache}",
        "model=d12",
        "data.vocab_size=8192",
        "data.tokens_per_micro_batch=65536",
        "data.max_seqlen=2048",
        "data.max_num_docs=128",
        "total_batch_tokens=131072",
        "max_steps=20",
        "save_every=10",
        "eval_every=20",
        "eval_tokens=65536",
        "sample_every=20",
        "deterministic=true",
    ]


def test_d12_runs_are_bitwise_identical_and_resume_exactly(tmp_path):
    cache = tmp_path / "cache"
    a, b, killed = tmp_path / "a", tmp_path / "b", tmp_path / "killed"
    run_train(d12_run(a, cache))
    run_train(d12_run(b, cache))
    assert_same_run(b, a, 20)

    proc = start_train(d12_run(killed, cache), tmp_path / "killed.log")
    wait_for(lambda: logged_steps(killed) >= 14, proc, "step 14")  # after the checkpoint of step 10
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_train(d12_run(killed, cache))
    assert_same_run(killed, a, 20)


def test_d12_fp8_runs_are_bitwise_identical(tmp_path):
    """FP8's scales are amax reductions, which do not depend on the order of their work: deterministic=true
    still gives the same bits."""
    cache = tmp_path / "cache"
    short = {"max_steps=20": "max_steps=6", "save_every=10": "save_every=6", "eval_every=20": "eval_every=6"}
    short["sample_every=20"] = "sample_every=6"
    a, b = tmp_path / "a", tmp_path / "b"
    for run_dir in (a, b):
        run_train([short.get(arg, arg) for arg in d12_run(run_dir, cache)] + ["model.fp8=tensorwise"])
    assert_same_run(b, a, 6)


def test_d12_background_saves_hold_the_bits_of_synchronous_ones(tmp_path):
    """async_save=true on the GPU: the state is staged to host memory before the next step changes it, and
    the writing thread's collectives run on their own gloo group."""
    cache = tmp_path / "cache"
    short = {"max_steps=20": "max_steps=6", "save_every=10": "save_every=2", "eval_every=20": "eval_every=6"}
    short["sample_every=20"] = "sample_every=6"
    runs = {}
    for name, extra in (("sync", []), ("async", ["async_save=true"])):
        runs[name] = tmp_path / name
        run_train([short.get(arg, arg) for arg in d12_run(runs[name], cache)] + extra)
    assert_same_run(runs["async"], runs["sync"], 6)
    for step in (4, 6):  # keep_last=2
        got, want = final_weights(runs["async"], step), final_weights(runs["sync"], step)
        assert all(torch.equal(got[k], want[k]) for k in want), step
