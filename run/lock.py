"""One run per run_dir: `run_dir/run.lock`, held from start to exit by rank 0.

The lock is an exclusive `flock` on the file, which the kernel releases when the process dies however it
dies, so a lock file left by a killed run is free and is taken over (with a warning naming the run that
left it). The file's contents (host, pid, start time) are only there to name the holder in the error a
second run gets. On a filesystem without `flock` the contents decide alone: a holder on this host whose
process is gone is stale; a holder on another host cannot be checked and is refused.
"""

import fcntl
import json
import os
import socket
import time
import warnings
from pathlib import Path

NAME = "run.lock"


class RunLocked(RuntimeError):
    """Another live run holds the run_dir."""


def _describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')} (started {started})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / NAME
        self.fd: int | None = None

    def _read(self, fd: int) -> dict:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096)
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            return {"host": "?", "pid": "?", "unreadable": raw[:80].decode("utf-8", "replace")}

    def acquire(self) -> None:
        """Take the lock or raise RunLocked naming the holder. Warns when taking over a stale lock."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                has_flock = True
            except BlockingIOError:
                holder = self._read(fd)
                os.close(fd)
                raise RunLocked(
                    f"run_dir {self.path.parent} is in use by another run: {_describe(holder)} holds "
                    f"{self.path}. Wait for it to finish, stop it, or use another run_dir"
                ) from None
            except OSError:  # no flock on this filesystem: judge by the recorded holder
                has_flock = False
            # The holder may have released and removed the file between our open and flock: retry on the
            # file now at the path, or two runs could lock two different inodes.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        holder = self._read(fd)
        if holder:
            here = holder.get("host") == socket.gethostname()
            dead = here and isinstance(holder.get("pid"), int) and not _alive(holder["pid"])
            if not has_flock and not dead:
                os.close(fd)
                raise RunLocked(
                    f"run_dir {self.path.parent} is locked by {_describe(holder)} and this filesystem cannot "
                    f"tell whether that run is alive: if it is not, delete {self.path}"
                )
            warnings.warn(
                f"taking over the stale lock {self.path} left by {_describe(holder)}, "
                "which is no longer running",
                stacklevel=2,
            )
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(me).encode())
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        # Remove the file before unlocking, so no one can lock the old inode after we are gone.
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
