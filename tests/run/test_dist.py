"""run/dist.py's two timeouts, under torchrun with 2 gloo ranks on the CPU and real stops (SIGSTOP): rank 0
preparing the data for longer than `dist_timeout_s` does not fail the rank waiting for it, and a rank that
hangs in training ends the job after `dist_timeout_s` instead of holding it forever."""

import os
import signal
import time
from pathlib import Path

from tests.train_helpers import kill_everything, logged_steps, rank_pids, small_run, start_torchrun, wait_for

TIMEOUT_S = 3


def test_rank0_preparing_the_data_beyond_the_timeout_does_not_fail_the_rank_waiting(tmp_path, corpus):
    source, _ = corpus
    run_dir, log = tmp_path / "run", tmp_path / "log"
    # A fresh cache: rank 0 trains the tokenizer and tokenizes while rank 1 waits.
    args = small_run((source, tmp_path / "cache"), run_dir, f"dist_timeout_s={TIMEOUT_S}", "max_steps=2")
    proc = start_torchrun(2, args, log)
    try:
        wait_for(lambda: "data: preparing" in log.read_text(), proc, "data preparation")
        rank0 = rank_pids(proc)[0]
        os.kill(rank0, signal.SIGSTOP)
        assert "data: prepared" not in log.read_text()  # held inside the preparation
        time.sleep(3 * TIMEOUT_S)
        os.kill(rank0, signal.SIGCONT)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        kill_everything(proc)
    assert logged_steps(run_dir) == 2


def gone(pid: int) -> bool:
    """Whether process `pid` has exited (a zombie its parent has not reaped yet counts as exited)."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def test_a_rank_hanging_in_training_ends_the_job_after_the_timeout(tmp_path, corpus):
    run_dir, log = tmp_path / "run", tmp_path / "log"
    args = small_run(corpus, run_dir, f"dist_timeout_s={TIMEOUT_S}", "max_steps=200", "save_every=100")
    proc = start_torchrun(2, args, log)
    try:
        wait_for(lambda: logged_steps(run_dir) >= 2, proc, "step 2")
        rank0 = rank_pids(proc)[0]
        os.kill(rank_pids(proc)[1], signal.SIGSTOP)  # a stuck GPU or a lost node: alive, never answering
        stopped = time.monotonic()
        # Rank 0's next collective fails after the timeout and it exits; torchrun then ends the others.
        wait_for(lambda: gone(rank0), proc, "rank 0 to exit", timeout=120)
        waited = time.monotonic() - stopped
    finally:
        kill_everything(proc)
    assert TIMEOUT_S <= waited < 60
    assert logged_steps(run_dir) < 200
    # gloo names the timeout where a rank waited, or where it closed the connection to the stopped rank.
    text = log.read_text()
    assert any(
        m in text for m in (f"Timed out waiting {TIMEOUT_S * 1000}ms", "Application timeout caused pair")
    )
