"""The run_dir lock: a live holder is refused and named, a dead one's lock is taken over."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from run.lock import NAME, RunLock, RunLocked
from tests.train_helpers import ROOT


def hold_lock_in_another_process(run_dir: Path) -> subprocess.Popen:
    code = f"""
import sys, time
sys.path.insert(0, {str(ROOT)!r})
from run.lock import RunLock

from tests.train_helpers import ROOT
lock = RunLock({str(run_dir)!r}); lock.acquire()
print("locked", flush=True)
time.sleep(600)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_holder_is_refused_naming_the_first(tmp_path):
    holder = hold_lock_in_another_process(tmp_path)
    try:
        with pytest.raises(RunLocked, match=f"pid {holder.pid} on host {socket.gethostname()}"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()


def test_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path):
    holder = hold_lock_in_another_process(tmp_path)
    holder.kill()  # SIGKILL: no clean-up, the lock file stays behind
    holder.wait()
    assert json.loads((tmp_path / NAME).read_text())["pid"] == holder.pid
    with pytest.warns(UserWarning, match=f"stale lock .* left by pid {holder.pid}"):
        lock = RunLock(tmp_path)
        lock.acquire()
    assert json.loads((tmp_path / NAME).read_text())["pid"] != holder.pid
    lock.release()
    assert not (tmp_path / NAME).exists()


def test_released_lock_can_be_taken_again_without_warning(tmp_path, recwarn):
    with RunLock(tmp_path):
        with pytest.raises(RunLocked):
            RunLock(tmp_path).acquire()  # the same process, another open file: still refused
    start = time.time()
    with RunLock(tmp_path):
        pass
    assert time.time() - start < 5 and not recwarn.list
