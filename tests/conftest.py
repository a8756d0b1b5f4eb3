import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Without CUDA the Triton kernels run in Triton's interpreter, which must be chosen before anything
# (torch._dynamo included) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
