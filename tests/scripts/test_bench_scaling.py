"""scripts/bench_scaling.py: the table from bench_train's JSON rows (efficiencies against the fewest GPUs of
the same mode and of ddp, worked out here by hand), and, slow, the whole sweep on gloo ranks on the CPU."""

import json
import subprocess
import sys

import pytest

from tests.scripts.test_bench_train import tiny_bench
from tests.train_helpers import ROOT


def row(model: str, tokens: float, ranks: int, **extra) -> dict:
    return {
        "model": model,
        "tokens_per_s": tokens,
        "tokens_per_s_per_rank": tokens / ranks,
        "mfu_nanochat": 0.5,
        "mfu_in_document": 0.4,
        "peak_mem_gb": 10.0,
        "params_gb": 1.0,
        "optim_state_gb": 2.0 / ranks,
        **extra,
    }


def write(out, mode: str, ranks: int, rows: list[dict]) -> None:
    env = {"parallel": mode, "world_size": ranks}
    (out / f"train_{mode}_x{ranks}.json").write_text(json.dumps({"env": env, "rows": rows}))


def scaling(*args, check=True):
    cmd = [sys.executable, "scripts/bench_scaling.py", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=check, timeout=900)


def test_table_from_the_files(tmp_path):
    write(tmp_path, "ddp", 1, [row("d12", 1000.0, 1)])
    comm = {"comm_s": 0.0112, "exposed_comm_s": 0.0026, "exposed_comm_share": 0.0018}
    comm_by_rank = {**comm, "exposed_comm_s_by_rank": [0.0026, 0.0011]}
    write(tmp_path, "ddp", 2, [row("d12", 1900.0, 2, **comm)])
    failed = {"model": "d20", "attention": "triton", "error": "out of memory"}  # left out of the table
    write(tmp_path, "fsdp", 2, [row("d12", 1700.0, 2, **comm_by_rank), failed])
    scaling("--gpus", "1", "2", "--modes", "ddp", "fsdp", "--out", str(tmp_path), "--table-only")
    lines = (tmp_path / "table.md").read_text().splitlines()
    assert lines[2:] == [
        "| d12 | `ddp` | 1 | 1,000 | 1,000 | 100.0% / 100.0% | 50.0% / 40.0% | 10.0 | 3.00 | - |",
        # 950 per GPU over ddp's 1,000 on one GPU; NCCL 11.2 ms, 2.6 ms exposed.
        "| d12 | `ddp` | 2 | 1,900 | 950 | 95.0% / 95.0% | 50.0% / 40.0% | 10.0 | 2.00 "
        "| 11 ms, 2.6 ms (0.2%) |",
        # fsdp has no one-GPU row: its fewest GPUs are 2, per GPU 850 over its own 850, and against ddp's
        # one GPU 850 over 1,000.
        "| d12 | `fsdp` | 2 | 1,700 | 850 | 100.0% / 85.0% | 50.0% / 40.0% | 10.0 | 2.00 "
        # every rank's exposed time recorded: the least and the most
        "| 11 ms, 2.6 ms (0.2%); ranks 1.1-2.6 ms |",
    ]


def test_refusals(tmp_path):
    proc = scaling("--out", str(tmp_path), check=False)
    assert proc.returncode == 2 and "give bench_train.py's overrides after --" in proc.stderr
    proc = scaling("--out", str(tmp_path), "--table-only", check=False)
    assert proc.returncode == 1 and f"no results in {tmp_path}" in proc.stderr
    proc = scaling("--gpus", "0", "--out", str(tmp_path), "--table-only", check=False)
    assert proc.returncode == 2 and "--gpus 0: every count must be at least 1" in proc.stderr


@pytest.mark.slow
def test_sweep_on_gloo_ranks(tmp_path):
    out = tmp_path / "out"
    scaling(
        "--gpus",
        "1",
        "2",
        "--modes",
        "ddp",
        "fsdp",
        "--out",
        str(out),
        "--",
        *tiny_bench(tmp_path),
        "+models=[tiny]",
    )
    for mode in ("ddp", "fsdp"):
        for ranks in (1, 2):
            result = json.loads((out / f"train_{mode}_x{ranks}.json").read_text())
            assert (result["env"]["parallel"], result["env"]["world_size"]) == (mode, ranks)
    rows = (out / "table.md").read_text().splitlines()[2:]
    assert [r.split(" | ")[1:3] for r in rows] == [
        ["`ddp`", "1"],
        ["`ddp`", "2"],
        ["`fsdp`", "1"],
        ["`fsdp`", "2"],
    ]
