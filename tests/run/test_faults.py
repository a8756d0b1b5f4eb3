"""Long runs under real faults, train.py in subprocesses at the default thread count: concurrent runs,
stop signals, SIGKILL anywhere (saves included), damaged checkpoints, a full disk, errors that must come
before any work, and bitwise-reproducible runs. Every resumed run is compared with the uninterrupted one."""

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from run.checkpoint import MANIFEST, RUN_STATE
from tests.train_helpers import (
    ROOT,
    assert_same_run,
    kill_everything,
    logged_steps,
    metrics,
    mount_tmpfs,
    run_train,
    small_run,
    start_torchrun,
    start_train,
    train_env,
    wait_for,
)

# The runs killed and stopped below are compared against this one (24 steps, a save every 4).
LONG = ("max_steps=24", "keep_last=2")


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run_train(small_run(corpus, run_dir, *LONG))
    return run_dir


def checkpoint_dir(run_dir):
    return run_dir / "checkpoints"


def temporaries(run_dir, pid: int | None = None):
    """Temporary checkpoint folders (of process `pid` only, if given)."""
    folder = checkpoint_dir(run_dir)
    found = [p for p in folder.iterdir() if ".tmp-" in p.name] if folder.is_dir() else []
    return found if pid is None else [p for p in found if p.name.endswith(f".tmp-{pid}")]


def steps_saved(run_dir):
    folder = checkpoint_dir(run_dir)
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("step_")) if folder.is_dir() else []


def test_second_run_is_refused_and_sigterm_stops_at_a_step_that_resumes_exactly(tmp_path, corpus, reference):
    run_dir = tmp_path / "run"
    first = start_train(small_run(corpus, run_dir, *LONG), tmp_path / "first.log")
    wait_for(lambda: logged_steps(run_dir) >= 5, first, "step 5")
    first.send_signal(signal.SIGSTOP)  # hold it mid-run, lock held, while the second run tries
    try:
        second = run_train(small_run(corpus, run_dir, *LONG), check=False, timeout=120)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode != 0
    assert f"is in use by another run: pid {first.pid}" in second.stderr
    assert "data:" not in second.stdout  # refused before anything else
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 0
    log = (tmp_path / "first.log").read_text()
    stopped = logged_steps(run_dir)
    assert f"stopped by SIGTERM after step {stopped}: checkpoint" in log
    assert stopped < 24, "the run finished before SIGTERM reached it"
    assert f"step_{stopped:06d}" in steps_saved(run_dir)
    assert not (run_dir / "run.lock").exists()
    run_train(small_run(corpus, run_dir, *LONG))
    assert_same_run(run_dir, reference, 24)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGUSR1])
def test_sigint_and_sigusr1_also_save_the_current_step_and_exit_0(tmp_path, corpus, sig):
    run_dir = tmp_path / "run"
    proc = start_train(small_run(corpus, run_dir, "max_steps=200", "save_every=100"), tmp_path / "log")
    wait_for(lambda: logged_steps(run_dir) >= 3, proc, "step 3")
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 0
    stopped = logged_steps(run_dir)
    assert f"stopped by {sig.name} after step {stopped}" in (tmp_path / "log").read_text()
    assert steps_saved(run_dir) == [f"step_{stopped:06d}"]


def test_second_sigint_exits_at_once_without_saving(tmp_path, corpus):
    """Ctrl-C twice on a run stuck inside a step. Here the step is stuck on its console, a pipe that
    nobody reads any more: the first SIGINT can only wait for the step, the second must exit at once."""
    run_dir, log = tmp_path / "run", tmp_path / "log"
    console, console_in = os.pipe()
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "train.py", *small_run(corpus, run_dir, "max_steps=100", "save_every=100")],
            cwd=ROOT,
            env=train_env(),
            stdout=console_in,
            stderr=err,
        )
    try:
        os.set_blocking(console, False)
        printed = b""
        while b"step 1/100" not in printed:  # keep the console drained until step 1's line
            assert proc.poll() is None, log.read_text()
            try:
                printed += os.read(console, 1 << 16)
            except BlockingIOError:
                time.sleep(0.001)
        # Fill the pipe while the run is held, so that its next line (step 2's, before step 2's stop
        # check) blocks.
        proc.send_signal(signal.SIGSTOP)
        while True:
            try:
                os.read(console, 1 << 16)
            except BlockingIOError:
                break
        os.write(console_in, b"\n" * fcntl.fcntl(console, fcntl.F_GETPIPE_SZ))
        proc.send_signal(signal.SIGCONT)
        wait_for(lambda: logged_steps(run_dir) >= 2, proc, "step 2's metrics")  # written just before the line
        proc.send_signal(signal.SIGINT)
        wait_for(lambda: "SIGINT received: finishing this step" in log.read_text(), proc, "the first SIGINT")
        assert proc.poll() is None and logged_steps(run_dir) == 2  # still inside step 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        proc.kill()
        proc.wait()
        os.close(console)
        os.close(console_in)
    assert "second SIGINT: exiting now" in log.read_text()
    assert steps_saved(run_dir) == [] and temporaries(run_dir) == []


def test_signal_before_training_starts_exits_at_once_with_a_message(tmp_path, corpus):
    source, _ = corpus
    run_dir, log = tmp_path / "run", tmp_path / "log"
    # A fresh data cache: the run is busy training its tokenizer when the signal comes.
    proc = start_train(small_run((source, tmp_path / "cache"), run_dir), log)
    wait_for(lambda: "data: preparing" in log.read_text(), proc, "data preparation")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 1
    assert "SIGTERM received before training started: exiting" in log.read_text()
    assert "Traceback" not in log.read_text()
    assert not (run_dir / "run.lock").exists() and steps_saved(run_dir) == []


# Where each SIGKILL lands, one after the other on the same run_dir, each restart going on from whatever
# the last one left: mid-interval, inside a save (temporary folder made, tensors and run state written,
# manifest written),
# right after a checkpoint's rename, and right after a step that saves was logged.
KILLS_CI = ["step 3", "saving", "state written", "step 10", "manifest written", "renamed", "step 20"]
# Around every save but the last: a step before it, then each point inside it (a kill inside a save sends
# the restart back to the previous checkpoint, so the next point meets the same save again).
KILLS_SLOW = [
    point
    for save in (4, 8, 12, 16, 20)
    for point in (f"step {save - 2}", "saving", "state written", "manifest written", "renamed")
]


def kill_trigger(point: str, run_dir, pid: int):
    if point.startswith("step "):
        n = int(point.split()[1])
        return lambda: logged_steps(run_dir) >= n
    if point == "renamed":
        before = set(steps_saved(run_dir))
        return lambda: bool(set(steps_saved(run_dir)) - before)
    inside = {"saving": None, "state written": RUN_STATE, "manifest written": MANIFEST}[point]
    return lambda: any(inside is None or (t / inside).exists() for t in temporaries(run_dir, pid))


def kill_and_resume(tmp_path, corpus, reference, points, *extra):
    run_dir = tmp_path / "run"
    args = small_run(corpus, run_dir, *LONG, *extra)
    orphans_removed = 0
    for i, point in enumerate(points):
        proc = start_train(args, tmp_path / f"log{i}")
        try:
            wait_for(kill_trigger(point, run_dir, proc.pid), proc, f"kill point {point!r}")
        finally:
            proc.kill()
            proc.wait()
        orphans_removed += "left by a save that never finished" in (tmp_path / f"log{i}").read_text()
    proc = run_train(args)
    orphans_removed += "left by a save that never finished" in proc.stderr
    assert_same_run(run_dir, reference, 24)
    # Kills inside a save left temporary folders that a restart removed (the kill points did hit saves).
    assert orphans_removed >= 1
    assert temporaries(run_dir) == []


def test_sigkill_at_many_points_resumes_bitwise(tmp_path, corpus, reference):
    kill_and_resume(tmp_path, corpus, reference, KILLS_CI)


@pytest.mark.slow
def test_sigkill_with_background_saves_resumes_bitwise(tmp_path, corpus, reference):
    """async_save=true: kills while a thread writes a checkpoint (or before it is sealed) leave the earlier
    ones usable, and the run ends with the bits of the uninterrupted one, whose saves were synchronous."""
    kill_and_resume(tmp_path, corpus, reference, KILLS_CI, "async_save=true")


@pytest.mark.slow
def test_sigkill_at_many_points_resumes_bitwise_compiled(tmp_path, corpus, tmp_path_factory):
    compiled = ("compile=true",)
    reference = tmp_path_factory.mktemp("reference_compiled") / "run"
    run_train(small_run(corpus, reference, *LONG, *compiled))
    kill_and_resume(tmp_path, corpus, reference, KILLS_SLOW, *compiled)


def test_truncated_newest_checkpoint_falls_back_to_the_previous(tmp_path, corpus):
    """In a real run; tests/run/test_checkpoint.py damages checkpoints in every other way."""
    run_dir = tmp_path / "run"
    fixed_lr = ("optim.warmdown_ratio=0", "keep_last=3")  # max_steps changes below, the schedule must not
    run_train(small_run(corpus, run_dir, "max_steps=24", *fixed_lr))
    newest = checkpoint_dir(run_dir) / "step_000024" / "__0_0.distcp"  # the tensors, as DCP writes them
    os.truncate(newest, newest.stat().st_size // 3)
    # Ask for more steps: the restart goes back to step 20 and trains 21-28.
    proc = run_train(small_run(corpus, run_dir, "max_steps=28", *fixed_lr))
    assert f"checkpoint {checkpoint_dir(run_dir) / 'step_000024'} is damaged and was skipped" in proc.stderr
    assert "resumed from" in proc.stdout and "step_000020 at step 20" in proc.stdout
    extended = tmp_path / "extended"
    run_train(small_run(corpus, extended, "max_steps=28", *fixed_lr))
    assert_same_run(run_dir, extended, 28)
    assert (checkpoint_dir(run_dir) / "step_000024.damaged" / "__0_0.distcp").exists()  # kept, not deleted


def test_torn_metrics_line_is_dropped_and_the_run_goes_on(tmp_path, corpus, reference):
    run_dir = tmp_path / "run"
    proc = start_train(small_run(corpus, run_dir, *LONG), tmp_path / "log")
    wait_for(lambda: logged_steps(run_dir) >= 14, proc, "step 14")
    proc.send_signal(signal.SIGTERM)  # a checkpoint at the last logged step: the next line is kept
    assert proc.wait(timeout=120) == 0
    stopped = logged_steps(run_dir)
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": %d, "loss": 1.2' % (stopped + 1))  # what a crash mid-write leaves
    resumed = run_train(small_run(corpus, run_dir, *LONG))
    assert f"line {stopped + 1} is torn" in resumed.stderr
    assert_same_run(run_dir, reference, 24)


def test_full_disk_during_a_save_training_goes_on_and_resume_works(tmp_path, corpus, reference):
    """A real ENOSPC inside a save: the run_dir's filesystem runs out of inodes once the checkpoint's
    state file is written, so making its manifest fails. The free-space check (bytes) passes."""
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "size=64m,nr_inodes=400"):
        pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
    try:
        run_dir = disk / "run"
        proc = start_train(small_run(corpus, run_dir, *LONG), tmp_path / "log")
        wait_for(lambda: "step_000004" in steps_saved(run_dir), proc, "the first checkpoint")
        proc.send_signal(signal.SIGSTOP)
        filler = disk / "filler"
        filler.mkdir()
        for i in range(os.statvfs(disk).f_ffree - 2):  # room for the temporary folder and state.pt only
            (filler / str(i)).touch()
        proc.send_signal(signal.SIGCONT)
        wait_for(lambda: "No space left on device" in (tmp_path / "log").read_text(), proc, "ENOSPC")
        proc.send_signal(signal.SIGSTOP)
        for p in filler.iterdir():
            p.unlink()
        proc.send_signal(signal.SIGCONT)
        failed = logged_steps(run_dir)
        wait_for(lambda: any(int(s[5:]) > failed for s in steps_saved(run_dir)), proc, "the next checkpoint")
        proc.kill()
        proc.wait()
        log = (tmp_path / "log").read_text()
        assert "not written: [Errno 28] No space left on device" in log
        assert "Training goes on" in log
        assert temporaries(run_dir) == []  # the failed save cleaned up after itself
        run_train(small_run(corpus, run_dir, *LONG))
        assert_same_run(run_dir, reference, 24)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.bogus=1", "bogus"),
        ("max_steps=ten", "max_steps"),
        ("model.n_kv_heads=3", "model.n_kv_heads"),
        ("model.window_pattern=SXL", "model.window_pattern"),
        ("total_batch_tokens=300", "total_batch_tokens"),
        ("keep_last=0", "keep_last=0 must be at least 1"),
        ("ddp_bucket_mb=0", "ddp_bucket_mb=0.0 must be positive"),
        ("wandb.mode=sometimes", "wandb.mode"),
        ("attention=magic", "attention"),
        ("attention=flex", "attention=flex needs a CUDA device"),
        ("attention=torch_varlen", "attention=torch_varlen needs a CUDA device"),
        ("optim.name=sgd", "optim.name"),
        ("data.max_num_docs=1", "max_num_docs"),
        ("data.val_fraction=0", "data.val_fraction=0.0 must be in (0, 1)"),
        ("wandb.mode=online", "wandb.mode=online but no W&B credentials"),
    ],
)
def test_bad_config_exits_before_any_work_naming_the_key(tmp_path, corpus, override, message):
    env = {"WANDB_API_KEY": "", "HOME": str(tmp_path), "NETRC": str(tmp_path / "netrc")}
    proc = run_train(small_run(corpus, tmp_path / "run", override), check=False, timeout=120, env_extra=env)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
    assert "data:" not in proc.stdout and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    run_train(small_run(corpus, run_dir, "max_steps=4"))
    return run_dir


@pytest.mark.parametrize(
    ("overrides", "messages"),
    [
        (["optim=adamw"], ["optim.name: checkpoint 'muon' vs config 'adamw'"]),
        (
            ["model.window_pattern=SL", "model.short_window=64", "model.logit_softcap=30"],
            [
                "model.window_pattern: checkpoint 'L' vs config 'SL'",
                "model.short_window: checkpoint 256 vs config 64",
                "model.logit_softcap: checkpoint 15.0 vs config 30.0",
            ],
        ),
        (
            ["data.max_seqlen=64", "seed=7"],
            ["data.max_seqlen: checkpoint 128 vs config 64", "seed: checkpoint 1337 vs config 7"],
        ),
    ],
)
def test_resume_with_another_config_is_refused_before_any_work(finished, corpus, overrides, messages):
    proc = run_train(small_run(corpus, finished, "max_steps=8", *overrides), check=False, timeout=120)
    assert proc.returncode != 0
    for message in messages:
        assert message in proc.stderr
    assert "data:" not in proc.stdout and "Traceback" not in proc.stderr
    assert [r["step"] for r in metrics(finished)] == [1, 2, 3, 4]  # nothing lost


def test_resume_from_a_file_that_is_not_a_checkpoint(tmp_path, corpus):
    bogus = tmp_path / "weights.pt"
    bogus.write_bytes(b"\x80\x04not a checkpoint")
    proc = run_train(small_run(corpus, tmp_path / "run", f"resume={bogus}"), check=False, timeout=120)
    assert proc.returncode != 0 and f"{bogus} is not a checkpoint" in proc.stderr
    assert "data:" not in proc.stdout and "Traceback" not in proc.stderr


def test_empty_validation_split_stops_before_training(tmp_path):
    """One big document: the split is by document, so one of the two splits is empty."""
    source = tmp_path / "one.txt"
    source.write_text("a long single document " * 2000)
    args = [f"run_dir={tmp_path / 'run'}", f"data.source={source}", f"data.cache_dir={tmp_path / 'cache'}"]
    args += ["data.vocab_size=300", "compile=false"]
    for _ in range(2):  # when prepared, then when opened
        proc = run_train(args, check=False, timeout=300)
        assert proc.returncode != 0
        assert "split of" in proc.stderr and "holds no documents (of 1 in all" in proc.stderr
        assert "model:" not in proc.stdout and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_two_default_runs_are_bitwise_identical(tmp_path, stdlib_cache):
    """`python train.py` (compiled, CPU, the default thread count), shortened, twice; neither recompiles
    after its first step (nor for evaluation and sampling)."""
    runs = []
    for name in ("a", "b"):
        run_dir = tmp_path / name
        proc = run_train(
            [
                f"run_dir={run_dir}",
                f"data.cache_dir={stdlib_cache}",
                "max_steps=10",
                "eval_every=5",
                "sample_every=5",
                "save_every=10",
            ],
            env_extra={"TORCH_LOGS": "recompiles"},
        )
        assert "Recompiling" not in proc.stderr
        runs.append(run_dir)
    assert_same_run(runs[0], runs[1], 10)


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(tmp_path, corpus):
    """torchrun with two gloo ranks: only rank 1 gets SIGTERM; both finish the step, rank 0 saves it, all
    exit 0. The stop is a collective decision, so no rank waits forever on one that left."""
    run_dir = tmp_path / "run"
    args = small_run(corpus, run_dir, "max_steps=400", "save_every=400", "data.tokens_per_micro_batch=128")
    args += ["data.max_seqlen=64", "data.max_num_docs=8", "total_batch_tokens=512"]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            *args,
        ],
        cwd=ROOT,
        env=train_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for(lambda: logged_steps(run_dir) >= 3, proc, "step 3")
    workers = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    assert len(workers) == 2
    ranks = {
        int(Path(f"/proc/{w}/environ").read_bytes().split(b"RANK=")[1].split(b"\0")[0]): w for w in workers
    }
    os.kill(ranks[1], signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    stopped = logged_steps(run_dir)
    assert f"stopped by a signal on another rank after step {stopped}: checkpoint" in output
    assert steps_saved(run_dir) == [f"step_{stopped:06d}"]


# Imported at start-up by every Python process that has this file's folder on PYTHONPATH: in torchrun's rank
# 1, checkpoint writes hang (for ten minutes, as on a stuck file system) in the thread of a background save.
STALLED_WRITES = """import os
import time

if os.environ.get("RANK") == "1":
    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def stalled(self, *args, **kwargs):
        time.sleep(600)
        return write_data(self, *args, **kwargs)

    FileSystemWriter.write_data = stalled
"""


def test_a_background_save_hung_on_one_rank_ends_the_run_after_dist_timeout_s(tmp_path, corpus):
    """torchrun with two gloo ranks and async_save=true, and rank 1's checkpoint writes hang. The background
    save's collectives give up after dist_timeout_s, as the run's do, so the job ends in about two timeouts
    (the save's, then the next save's gather on the other rank) instead of holding its ranks for torch's
    default 30 minutes; nothing is sealed as a checkpoint."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STALLED_WRITES)
    run_dir = tmp_path / "run"
    args = small_run(corpus, run_dir, "async_save=true", "dist_timeout_s=15", "max_steps=400", "save_every=4")
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    proc = start_torchrun(2, args, tmp_path / "log", env_extra={"PYTHONPATH": path})
    try:
        proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        kill_everything(proc)
        raise AssertionError(f"still running after 180 s at step {logged_steps(run_dir)}") from None
    assert proc.returncode != 0
    assert "Timed out waiting 15000ms" in (tmp_path / "log").read_text()  # gloo's, not another error
    assert 4 <= logged_steps(run_dir) < 400
    assert steps_saved(run_dir) == []
