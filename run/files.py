"""Durable writes: a file's bytes, and a folder's entries (a rename into it), on disk before a later step
relies on them surviving a crash or a power loss."""

import os
from pathlib import Path


def write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
