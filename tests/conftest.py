import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Without CUDA the Triton kernels run in Triton's interpreter, which must be chosen before anything
# (torch._dynamo included) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor caches compiled graphs across processes (by default in one directory per user), and a cached
# graph calls a custom operator by the name and signature it had when it was cached: a changed operator
# would meet graphs compiled for its old self. So each test session, and the train.py processes it
# starts, compile into a directory of their own.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="package")
def corpus(tmp_path_factory):
    """A tiny jsonl corpus and a data cache shared by the tests that run train.py."""
    from tests.train_helpers import write_corpus

    root = tmp_path_factory.mktemp("corpus")
    return write_corpus(root / "docs.jsonl"), root / "cache"


@pytest.fixture(scope="package")
def stdlib_cache(tmp_path_factory):
    """One data cache for the tests that run train.py on its default source (tokenized once)."""
    return tmp_path_factory.mktemp("stdlib_cache")
