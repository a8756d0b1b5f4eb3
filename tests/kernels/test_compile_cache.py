"""torch.compile's caches and our custom ops: importing `kernels` tags the caches with a digest of kernels/
and model/, so an edit that changes what an op returns compiles afresh instead of reusing a stale graph.

Each run is a fresh process over one cache directory, as a user's runs before and after an upgrade are. The
op under test grows its input K-fold; its edit changes K in both its implementations, which the compiled
graph's code does not show."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.train_helpers import ROOT

OP = """import torch

K = {k}


@torch.library.custom_op("{name}::grow", mutates_args=())
def grow(x: torch.Tensor) -> torch.Tensor:
    return x.new_ones(x.shape[0] * K)


@grow.register_fake
def _(x):
    return x.new_empty(x.shape[0] * K)
"""

RUN = """import importlib.util, sys
import torch
import kernels  # noqa: F401 (tags the compile caches)

spec = importlib.util.spec_from_file_location("probe", sys.argv[1])
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
grown = torch.compile(lambda x: probe.grow(x) * 2, fullgraph=True, dynamic=False)(torch.ones(4))
print(grown.numel())
"""


def run(tree: Path, op_file: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(tree)}
    env.pop("TORCH_COMPILE_CACHE_KEY_TAG", None)
    cmd = [sys.executable, str(tree / "run_probe.py"), str(op_file)]
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_an_edited_op_in_model_compiles_afresh_where_one_outside_is_served_stale(tmp_path):
    tree, cache = tmp_path / "tree", tmp_path / "cache"
    for folder in ("kernels", "model"):
        shutil.copytree(ROOT / folder, tree / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "run_probe.py").write_text(RUN)
    inside, outside = tree / "model" / "probe_op.py", tree / "elsewhere" / "probe_op.py"
    outside.parent.mkdir()

    # An op under model/: the edit changes the tag, so the second run compiles the new op.
    inside.write_text(OP.format(k=3, name="probe_inside"))
    assert run(tree, inside, cache).stdout.split() == ["12"]
    inside.write_text(OP.format(k=5, name="probe_inside"))
    after = run(tree, inside, cache)
    assert after.returncode == 0 and after.stdout.split() == ["20"], after.stderr[-2000:]

    # The same edit outside the tagged folders: the cache serves the graph compiled for K = 3, whose size
    # check fails. This is the failure the tag prevents.
    outside.write_text(OP.format(k=3, name="probe_outside"))
    assert run(tree, outside, cache).stdout.split() == ["12"]
    outside.write_text(OP.format(k=5, name="probe_outside"))
    stale = run(tree, outside, cache)
    assert stale.returncode != 0 and "expected size 20==12" in stale.stderr
