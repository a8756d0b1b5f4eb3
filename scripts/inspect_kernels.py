"""Compile the attention kernels and the fused-epilogue products for an NVIDIA architecture on a machine
without a GPU, and report what the compiler made of them.

    python scripts/inspect_kernels.py [--head-dim 128] [--arch 90] [--kernels ...] [--dump DIR]

For each attention kernel and length class of `block_config` (the one for the architecture), and for the
Gluon products (Hopper only:
kernels/fused/gemm_hopper.py's MLP `relu2` and `relu2_grad`, attention's `rope_norm`, the `residual`
projection, the MLP's output with its residual `mlp_out` and the plain `joined` product;
kernels/fused/wgrad_hopper.py's `wgrad`):
shared memory, registers and spill bytes (from the ptxas that ships with triton), the tensor-core
instructions (wgmma) and the waits for them (`wait 0` lets no product run on past it, `wait n` leaves n
groups in flight: only those can overlap the exponentials), and
how the inner loops get their tiles (TMA or cp.async copies; neither means plain loads that stall). `loop
spills` counts the spill loads and stores (SASS, from triton's nvdisasm) inside each inner loop that runs
tensor-core products, in code order: a kernel's total spill bytes say nothing about whether its hot loop
touches local memory (the unmasked loop is usually the shortest one). The kernels are specialised as a
launch on aligned [T, H, D] bf16 tensors would specialise them (16-byte strides, one query head per K/V
head, no gradient on the LSE), over the whole past (`--window`: the Gluon forward as a launch under a
sliding window compiles it). Figures are those of the installed triton; the GPU machines run triton 3.6
(`pip install --target DIR triton==3.6.0` and put DIR first on PYTHONPATH to see theirs). `--json` prints
one object per kernel and class instead of a table.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

# Compile for the GPU, even here: the kernel module otherwise switches to the interpreter without CUDA.
os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.attention import backward, block_sizes, forward, hopper, hopper_backward, hopper_forward, tiles  # noqa: E402
from kernels.common import max_registers  # noqa: E402
from kernels.fused import gemm_hopper as gh  # noqa: E402

# The classes with blocks.gluon run these warp-specialised Gluon kernels on Hopper instead.
GLUON_KERNELS = {
    "fwd": hopper_forward._fwd_persistent_kernel,
    "dkdv": hopper_backward._dkdv_kernel,
}
KERNELS = {
    "fwd": forward._fwd_kernel,
    "dq": backward._bwd_dq_kernel,
    "dkdv": backward._bwd_dkdv_kernel,
    "dq_stored": backward._bwd_dq_stored_kernel,
}
# Each product's epilogue, and whether it reads its weights as stored, [K, N] (`matmul`, `joined_matmul`).
GEMM_KERNELS = {
    "relu2": (gh.RELU2, False),
    "relu2_grad": (gh.RELU2_GRAD, False),
    "rope_norm": (gh.ROPE_NORM, False),
    "residual": (gh.RESIDUAL, False),
    "mlp_out": (gh.RESIDUAL, True),
    "joined": (gh.PLAIN, True),
}
# The FP8 products (e4m3 operands, a weight scale; both operands K-major), by the same epilogues.
FP8_GEMM_KERNELS = {
    "relu2_fp8": gh.RELU2,
    "relu2_grad_fp8": gh.RELU2_GRAD,
    "rope_norm_fp8": gh.ROPE_NORM,
    "residual_fp8": gh.RESIDUAL,
    "plain_fp8": gh.PLAIN,
}
# The products of Hopper alone, each by its inspector: gemm_hopper's epilogues and wgrad_hopper's.
HOPPER_PRODUCTS = [*GEMM_KERNELS, *FP8_GEMM_KERNELS, "wgrad"]
FP32_POINTERS = {"Lse", "dLse", "Delta", "Cos", "Sin", "Rstd", "RowScale", "Part", "WScale"}
INT32_POINTERS = {"tiles", "cu_seqlens", "DocSlots", "Counter", "Counts"}
BF16_POINTERS = {"Q", "K", "V", "Out", "dOut", "dQ", "dK", "dV", "DS"}
# Integer arguments that a launch on aligned tensors sees as multiples of 16 (and specialises on).
ALIGNED_INTS = {"T", "left", "right"}
# One query head per K/V head: a launch passes group 1, which triton compiles as a constant.
ONE_HEAD_PER_KV = dict(group=1)


def signature(kernel: str, fn, head_dim: int, blocks: block_sizes.Blocks, arch: int):
    """(signature, constexprs, attrs) of a launch as kernels/attention/forward.py and backward.py make it."""
    block_d = tiles.padded_dim(head_dim)
    config = block_sizes.block_config(head_dim, on_hopper=arch == 90)
    store_blocks = config["dkdv"][0][1]
    # As in kernels/attention/plan.py's _stored_longest: the first dK/dV class stores dS only where a
    # dq_stored pass reads it back.
    stores = "dq_stored" in config and config["dkdv"][0][0] is not None
    # The forward and dQ pass stream key blocks (n rows); the dK/dV pass streams query blocks (m rows).
    desc_rows = blocks.m if kernel == "dkdv" else blocks.n
    constants = dict(
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_M=blocks.m,
        BLOCK_N=blocks.n,
        TILE_M=blocks.m,
        BM_KV=store_blocks.m,
        TMA=blocks.tma,
        HAS_DLSE=False,
        STORE_DS=stores and kernel == "dkdv" and blocks == store_blocks,
        **ONE_HEAD_PER_KV,
    )
    return _signature(
        fn,
        constants,
        lambda name: f"tensordesc<bf16[1, 1, {desc_rows}, 1, {block_d}]>" if blocks.tma else None,
    )


def gluon_signature(kernel: str, fn, head_dim: int, blocks: block_sizes.Blocks, window: bool = False):
    """(signature, constexprs, attrs) of a launch of a Gluon kernel of kernels/attention/hopper_*.py; the
    forward's over the whole past or (`window`) under a sliding window."""
    from triton.experimental.gluon import language as gl

    def descriptor(name):
        if name == "dq_desc":  # the dK/dV pass's float32 dQ tiles, each one [32, 128] box
            rows, cols = hopper_backward.FLAT
            return f"tensordesc<fp32[{rows}, {cols}],{hopper_backward.FLAT_LAYOUT!r}>"
        # The forward splits its query tiles (and out) into 64-row parts, one per warpgroup, and streams key
        # blocks; the dK/dV pass splits 2 x 64-key tiles (and dK, dV) and streams query blocks.
        query_side = name in ("q_desc", "do_desc", "o_desc")
        if kernel == "dkdv":
            rows = blocks.m if query_side else blocks.n // 2
        else:
            rows = 64 if query_side else blocks.n
        shape = [1, 1, rows, 1, head_dim]
        return f"tensordesc<bf16{shape},{gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)!r}>"

    constants = dict(STAGES=blocks.stages, HAS_DLSE=False, **ONE_HEAD_PER_KV)
    if kernel == "fwd":
        constants["PARTS"] = blocks.m // 64
        constants["WINDOW"] = window
        constants["OUT"] = hopper_forward.out_path(head_dim, blocks.m // 64)
    return _signature(fn, constants, descriptor)


def _signature(fn, constants: dict, descriptor, aligned_ints=ALIGNED_INTS):
    """(signature, constexprs, attrs) of a launch on aligned tensors: `constants` holds the constexpr
    arguments, descriptor(name) the type of a descriptor argument (None: the launch passes None),
    `aligned_ints` the integer arguments that are multiples of 16."""
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            sig[name], constexprs[(i,)] = "constexpr", constants[name]
        elif name.endswith("_desc"):
            sig[name] = descriptor(name)
            if sig[name] is None:
                sig[name], constexprs[(i,)] = "constexpr", None
        elif name in aligned_ints:
            sig[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
        elif name in BF16_POINTERS | FP32_POINTERS | INT32_POINTERS:
            sig[name] = "*fp32" if name in FP32_POINTERS else "*i32" if name in INT32_POINTERS else "*bf16"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "sm_scale"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs


def ptxas_report(ptx: str, arch: int) -> dict:
    """Registers, spill bytes and performance warnings of ptxas -v, and the inner loops of its SASS."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "kernel.ptx")
        src.write_text(ptx)
        suffix = "a" if arch >= 90 else ""
        out = subprocess.run(
            [
                get_ptxas(arch).path,
                f"-arch=sm_{arch}{suffix}",
                "-v",
                str(src),
                "-o",
                str(Path(tmp, "k.cubin")),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        disassembler = knobs.nvidia.nvdisasm.path
        sass = subprocess.run(
            [disassembler, "-c", str(Path(tmp, "k.cubin"))], capture_output=True, text=True, check=True
        ).stdout
    registers = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    warnings = sorted(set(re.findall(r"\((C\d+)\) ([^\n]*?) (?:in|for) the function", out)))
    return dict(
        registers=int(registers.group(1)) if registers else None,
        spill_bytes=int(spills.group(1)) if spills else 0,
        warnings=[f"{code}: {text}" for code, text in warnings],
        loops=inner_loops(sass),
    )


INSTRUCTION = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def inner_loops(sass: str) -> list[dict]:
    """Counts per innermost loop (a backward branch, containing no other) that runs tensor-core products,
    in code order: instructions, products (HGMMA; QGMMA for FP8 operands), exponentials (MUFU.EX2), spill
    loads and stores (LDL/STL), and CTA barriers (BAR.SYNC)."""
    code, labels = [], {}
    for line in sass.splitlines():
        if label := LABEL.match(line.strip()):
            labels[label.group(1)] = len(code)  # the next instruction's index
        elif ins := INSTRUCTION.search(line):
            code.append((ins.group(1), ins.group(2)))
    loops = []  # (first, last instruction) of each backward branch's body
    for end, (op, operands) in enumerate(code):
        target = BRANCH_TARGET.search(operands)
        start = labels.get(target.group(1)) if op == "BRA" and target else None
        if start is not None and start <= end:
            loops.append((start, end))
    rows = []
    for start, end in sorted(loops):
        if any(start <= a and b <= end and (a, b) != (start, end) for a, b in loops):
            continue
        ops = [op for op, _ in code[start : end + 1]]
        row = dict(
            instructions=len(ops),
            products=sum(op.startswith(("HGMMA", "QGMMA")) for op in ops),
            exponentials=sum(op == "MUFU.EX2" for op in ops),
            spill_ops=sum(op.split(".")[0] in ("LDL", "STL") for op in ops),
            barriers=sum(op.startswith("BAR.SYNC") for op in ops),
        )
        if row["products"]:
            rows.append(row)
    return rows


def inspect_kernel(
    kernel: str, head_dim: int, blocks: block_sizes.Blocks, arch: int, dump: Path | None = None,
    window: bool = False,
) -> dict:
    if blocks.gluon and head_dim in hopper.HEAD_DIMS and arch == 90:
        from triton.experimental.gluon._runtime import GluonASTSource

        fn = GLUON_KERNELS[kernel]
        sig, constexprs, attrs = gluon_signature(kernel, fn, head_dim, blocks, window)
        source = GluonASTSource(fn, sig, constexprs, attrs)
        # The forward's warpgroups own 64 query rows each, the dK/dV pass's two own half the key tile.
        warpgroups = blocks.m // 64 + 1 if kernel == "fwd" else 3
        options = dict(num_warps=hopper.WARPS, maxnreg=max_registers(warpgroups))
        windowed = window and kernel == "fwd"  # the one kernel the window specialises
    else:
        fn = KERNELS[kernel]
        sig, constexprs, attrs = signature(kernel, fn, head_dim, blocks, arch)
        source = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        options = dict(num_warps=blocks.warps, num_stages=blocks.stages)
        windowed = False
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        stem = (
            f"{kernel}_d{head_dim}_{blocks.m}x{blocks.n}_w{blocks.warps}_s{blocks.stages}"
            + ("_tma" if blocks.tma else "")
            + ("_gluon" if blocks.gluon else "")
            + ("_window" if windowed else "")
        )
        for key in ("ttgir", "ptx"):
            (dump / f"{stem}.{key}").write_text(compiled.asm[key])
    return _report(kernel, blocks, compiled, arch)


def _report(kernel: str, blocks: block_sizes.Blocks, compiled, arch: int) -> dict:
    ptx = compiled.asm["ptx"]
    waits = [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)]
    return dict(
        kernel=kernel,
        blocks=blocks,
        shared_kb=compiled.metadata.shared / 1024,
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        waits_for_all=waits.count(0),
        waits_partial=len(waits) - waits.count(0),
        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        cp_async_loads=len(re.findall(r"cp\.async\.c[ag]\.", ptx)),
        register_moves=len(re.findall(r"setmaxnreg", ptx)),  # warp specialisation sharing out registers
        **ptxas_report(ptx, arch),
    )


def inspect_gemm_kernel(kernel: str, arch: int) -> dict:
    """As inspect_kernel, for kernels/fused/gemm_hopper.py's product with the epilogue `kernel` (bf16, or FP8
    operands for the *_fp8 ones; the q/k product at head dim 128)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    fp8 = kernel in FP8_GEMM_KERNELS
    epilogue, b_kn = (FP8_GEMM_KERNELS[kernel], False) if fp8 else GEMM_KERNELS[kernel]
    bk = gh.BK_FP8 if fp8 else gh.BK

    def descriptor(name):
        b = [bk, gh.BN] if b_kn else [gh.BN, bk]
        shape = {"a_desc": [gh.BM, bk], "a2_desc": [gh.BM, bk], "b_desc": b, "b2_desc": b}.get(name)
        if shape is None:  # the output, and the tile an epilogue reads: bf16
            shape = [gh.BM // 2, gh.BN]
            return f"tensordesc<bf16{shape},{gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)!r}>"
        dtype, name = (gl.float8e4nv, "fp8e4nv") if fp8 else (gl.bfloat16, "bf16")
        return f"tensordesc<{name}{shape},{gl.NVMMASharedLayout.get_default_for(shape, dtype)!r}>"

    fn = gh._matmul_kernel
    # The sizes M, N, N2, K: multiples of 16 in the model.
    rope = epilogue == gh.ROPE_NORM
    # The MLP's products scale their rows by the input's 1/rms, as the model runs them; the FP8 ones all
    # scale their rows (the operand's row scales) and the whole by the weight's scale.
    scale_rows = fp8 or epilogue in (gh.RELU2, gh.RELU2_GRAD)
    constants = dict(
        EPILOGUE=epilogue.value,
        HEAD_DIM=128 if rope else 0,
        SCALE_ROWS=scale_rows,
        SCALE_W=fp8,
        B_KN=b_kn,
        STAGES=gh.STAGES,
    )
    if not fp8:
        constants |= dict(WScale=None)
    if not rope:
        constants |= dict(Cos=None, Sin=None)
    if not rope:
        constants |= dict(Rstd=None)
    if not scale_rows:
        constants |= dict(RowScale=None)
    sig, constexprs, attrs = _signature(fn, constants, descriptor, aligned_ints={"M", "N", "N2", "K", "K1"})
    source = GluonASTSource(fn, sig, constexprs, attrs)
    options = dict(num_warps=gh.WARPS, maxnreg=gh.MAX_REGISTERS)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    blocks = block_sizes.Blocks(gh.BM, gh.BN, 2 * gh.WARPS, gh.STAGES, tma=True, gluon=True)
    return _report(kernel, blocks, compiled, arch)


def inspect_wgrad_kernel(arch: int) -> dict:
    """As inspect_kernel, for kernels/fused/wgrad_hopper.py's weight-gradient product (bf16)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels.fused import wgrad_hopper as wh

    def descriptor(name):
        shape = [wh.BK, wh.BM // 2] if name in ("g_desc", "g2_desc") else [wh.BK, wh.BN]
        return f"tensordesc<bf16{shape},{gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)!r}>"

    fn = wh._wgrad_kernel
    sig, constexprs, attrs = _signature(fn, dict(STAGES=wh.STAGES), descriptor, aligned_ints={"M", "M1", "N"})
    options = dict(num_warps=wh.WARPS, maxnreg=wh.MAX_REGISTERS)
    compiled = triton.compile(
        GluonASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32), options=options
    )
    return _report(
        "wgrad",
        block_sizes.Blocks(wh.BM, wh.BN, 2 * wh.WARPS, wh.STAGES, tma=True, gluon=True),
        compiled,
        arch,
    )


def format_row(row: dict, label: str) -> str:
    b = row["blocks"]
    blocks = f"{b.m}x{b.n} w{b.warps} s{b.stages}" + (" tma" if b.tma else "") + (" gluon" if b.gluon else "")
    return (
        f"{row['kernel']:<10} {label:<8} {blocks:<24} "
        f"{row['shared_kb']:7.1f} {row['registers'] or '?':>5} {row['spill_bytes']:>6} {row['wgmma']:>6} "
        f"{row['waits_for_all']:>6} {row['waits_partial']:>6} {row['tma_loads']:>5} "
        f"{row['cp_async_loads']:>8} {'/'.join(str(loop['spill_ops']) for loop in row['loops']):>11}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    every = [*KERNELS, *HOPPER_PRODUCTS]
    parser.add_argument("--kernels", nargs="+", choices=every, default=every)
    parser.add_argument("--dump", type=Path, help="write each kernel's TTGIR and PTX here")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    parser.add_argument(
        "--window", action="store_true",
        help="the Gluon forward as a launch under a sliding window compiles it",
    )
    args = parser.parse_args()

    config = block_sizes.block_config(args.head_dim, on_hopper=args.arch == 90)
    if not args.json:
        print(f"triton {triton.__version__}, sm_{args.arch}, head dim {args.head_dim}")
        print(
            f"{'pass':<10} {'class':<8} {'blocks':<24} {'smem KB':>7} {'regs':>5} {'spills':>6} {'wgmma':>6} "
            f"{'wait 0':>6} {'wait n':>6} {'tma':>5} {'cp.async':>8} {'loop spills':>11}"
        )
    for kernel in args.kernels:
        if kernel in HOPPER_PRODUCTS:
            # Hopper's kernels only; the head dim does not enter them.
            inspect = inspect_wgrad_kernel if kernel == "wgrad" else partial(inspect_gemm_kernel, kernel)
            rows = [(inspect(args.arch), None, "all")] if args.arch == 90 else []
        elif kernel in config:
            # dq_stored serves the documents of the first dK/dV class.
            entries = config[kernel] if kernel != "dq_stored" else [(config["dkdv"][0][0], config[kernel])]
            rows = [
                (
                    inspect_kernel(kernel, args.head_dim, blocks, args.arch, args.dump, args.window),
                    longest,
                    f"<= {longest}" if longest else "longer" if len(entries) > 1 else "all",
                )
                for longest, blocks in entries
            ]
        else:
            rows = []
        for row, longest, label in rows:
            if args.json:
                print(json.dumps({**row, "blocks": row["blocks"]._asdict(), "longest": longest}))
                continue
            print(format_row(row, label))
            for warning in row["warnings"]:
                print(f"      ptxas {warning}")


if __name__ == "__main__":
    main()
