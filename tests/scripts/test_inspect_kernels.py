"""The attention kernels and the fused-epilogue products compiled for Hopper on this CPU machine
(scripts/inspect_kernels.py, with the ptxas bundled in triton): every shipped block config must fit an
H100/H200 SM and keep the inner loops fed by asynchronous copies, which the interpreter tests cannot see."""

import json
import subprocess
import sys

import pytest

from tests.train_helpers import ROOT

HOPPER_SHARED_BYTES = 232448  # most shared memory one block may use on sm_90


def inspect(*args: str) -> list[dict]:
    """The rows of `scripts/inspect_kernels.py --json ARGS` (in a process of its own: the script switches
    triton out of the interpreter when imported)."""
    result = subprocess.run(
        [sys.executable, "scripts/inspect_kernels.py", "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernels_fit_hopper_and_stream_tiles_asynchronously(head_dim):
    rows = inspect("--head-dim", str(head_dim), "--kernels", "fwd", "dq", "dkdv", "dq_stored")
    # Hopper has no stored-dS dQ pass: the Gluon dK/dV pass writes dQ.
    assert {row["kernel"] for row in rows} == {"fwd", "dq", "dkdv"}
    gluon = {row["kernel"] for row in rows if row["blocks"]["gluon"]}
    assert gluon == {"fwd", "dkdv"}
    for row in rows:
        where = f"{row['kernel']} {row['blocks']}"
        assert row["shared_kb"] * 1024 <= HOPPER_SHARED_BYTES, where
        assert 0 < row["registers"] <= 255, where
        assert row["wgmma"] > 0, where  # the products run on Hopper's asynchronous tensor-core path
        # ptxas runs the products one at a time, each waited for, where it cannot keep them in flight
        # (its warnings C7510-C7515: too few registers, accumulators defined outside the products).
        assert not serialised(row), (where, row["warnings"])
        if row["blocks"]["gluon"]:
            # Warp-specialised: a load warp issues TMA loads, the partitions trade registers, and a step of
            # the inner loops makes at most a couple of local-memory accesses (operand descriptors hoisted
            # out of the dK/dV loop made triton 3.6's build spill 17-25 a step). The dK/dV pass at head dim
            # 64 holds [64, 128] S and dP beside dK and dV in 240 registers, and S's exponentials beside dP's
            # product in flight: both builds spill none (triton 3.9's spilled 22 a step on the masked blocks
            # when each step's dQ products were issued in that step, 56 when the warpgroups also issued the
            # TMA stores of dK and dV themselves).
            assert row["tma_loads"] > 0 and row["register_moves"] > 0, where
            assert all(loop["spill_ops"] <= 2 for loop in row["loops"]), where
        elif row["blocks"]["tma"]:
            assert row["tma_loads"] > 0, where
        else:
            assert row["cp_async_loads"] > 0, where
        # The masked and unmasked loops are found in the SASS, each running tensor-core products.
        assert row["loops"] and all(loop["products"] > 0 for loop in row["loops"]), where


@pytest.mark.parametrize("head_dim", [64, 128])
def test_forward_compares_the_window_only_under_one(head_dim):
    """The Gluon forward compiled for a sliding window fits as the whole-past one does, and the whole-past
    build's loops, which compare a masked block's scores against the diagonal alone, are the shorter: a
    launch over the whole past must not pay for the window's bound."""
    whole = inspect("--head-dim", str(head_dim), "--kernels", "fwd")
    windowed = inspect("--head-dim", str(head_dim), "--kernels", "fwd", "--window")
    assert [row["blocks"] for row in whole] == [row["blocks"] for row in windowed]
    for past, window in zip(whole, windowed, strict=True):
        where = f"fwd {window['blocks']}"
        assert window["tma_loads"] > 0 and not serialised(window), where
        assert all(loop["spill_ops"] <= 2 for loop in window["loops"]), where
        assert len(past["loops"]) == len(window["loops"]), where
        for a, b in zip(past["loops"], window["loops"], strict=True):
            assert a["products"] == b["products"] and a["instructions"] < b["instructions"], where


def test_fused_products_fit_hopper_without_spills():
    """The Gluon products with fused epilogues (kernels/fused/gemm_hopper.py): the MLP's two and attention's
    q/k product; and the weight-gradient product (kernels/fused/wgrad_hopper.py): warp-specialised, fed by
    TMA, no spills."""
    kernels = ["relu2", "relu2_grad", "rope_norm", "wgrad"]
    rows = inspect("--kernels", *kernels)
    assert [row["kernel"] for row in rows] == kernels
    for row in rows:
        assert row["shared_kb"] * 1024 <= HOPPER_SHARED_BYTES, row["kernel"]
        assert row["spill_bytes"] == 0 and row["wgmma"] > 0, row["kernel"]
        assert row["tma_loads"] > 0 and row["register_moves"] > 0, row["kernel"]
        assert not serialised(row), (row["kernel"], row["warnings"])
        assert row["loops"] and all(loop["products"] > 0 for loop in row["loops"]), row["kernel"]


def serialised(row):
    return any("wgmma.mma_async instructions are serialized" in warning for warning in row["warnings"])


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0020*/                   STL [R1+0x10], R2 ;
.L_x_1:
        /*0030*/                   MUFU.EX2 R3, R3 ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R88, R24, gdesc[UR8], R88 ;
        /*0050*/                   LDL.LU R2, [R1+0x10] ;
        /*0060*/              @P3 BRA `(.L_x_1) ;
        /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0080*/              @!P0 BRA `(.L_x_0) ;
.L_x_2:
        /*0090*/                   IADD3 R4, R4, 0x1, RZ ;
        /*00a0*/                   LDL R5, [R1] ;
        /*00b0*/               @P1 BRA `(.L_x_2) ;
        /*00c0*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*00d0*/                   EXIT ;
"""


def test_inner_loops_of_sass():
    """Of three loops, the outer one holds another and the third runs no products: only the inner one counts,
    with its four instructions (the branch included). Forward branches are not loops."""
    # In a process of its own: the script switches triton out of the interpreter when imported.
    code = "import json, sys, inspect_kernels as ik; print(json.dumps(ik.inner_loops(sys.stdin.read())))"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT / "scripts",
        input=SASS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == [
        dict(instructions=4, products=1, exponentials=1, spill_ops=1, barriers=0)
    ]


def test_gluon_signatures_specialise_group_as_a_launch_does():
    """A launch with one query head per K/V head passes group 1, which triton's launcher compiles as a
    constant: the Gluon kernels that the script inspects must be that build, not one with group a runtime
    integer (their registers and spills differ)."""
    code = """
import json, inspect_kernels as ik
from triton.runtime.jit import mangle_type
blocks = ik.block_sizes.block_config(64, on_hopper=True)
seen = {}
for kernel, fn in ik.GLUON_KERNELS.items():
    sig, constexprs, _ = ik.gluon_signature(kernel, fn, 64, blocks[kernel][0][1])
    at = fn.arg_names.index("group")
    seen[kernel] = [sig["group"], constexprs.get((at,))]
print(json.dumps({"launch": mangle_type(1, True), "seen": seen}))
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT / "scripts", capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["launch"] == "constexpr"
    assert out["seen"] == {"fwd": ["constexpr", 1], "dkdv": ["constexpr", 1]}
