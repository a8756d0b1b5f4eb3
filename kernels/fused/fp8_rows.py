"""Row-wise FP8 quantisation for the FP8 products of gemm_hopper.py, in one read of x [T, C].

Each row is scaled so that its largest magnitude lands on the format's largest finite value (448 for e4m3),
saturated there and cast; the row's dequantisation scale 1 / s is returned beside it, so that x is about
x8 * scale[:, None]. With `rstd=True` the kernel also takes each row's 1/rms, the RMSNorm that the
product's epilogue applies, and returns scale * rstd instead (with rstd itself, for the backward): the
normalised input is never written. With a second tensor x2 [T, C2] the rows are those of [x | x2], written
as one [T, C + C2] tensor without joining x and x2 first: q/k/v's output gradients, which one product reads.
As numerics.py's tensorwise `quantize`: a row of zeros gets a finite scale and quantises to zeros; a
non-finite value makes its row's scale 0 or NaN, so the product shows it.
"""

import torch  # noqa: I001 (kernels.common must come before triton)

# Before triton: without CUDA it switches Triton to the interpreter (see kernels/common.py).
from kernels.common import check_interpreter
from kernels.fused.numerics import AMAX_FLOOR, RMS_EPS

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# Elements a program holds: whole rows of up to this many columns, as many rows as fit.
ELEMENTS = 4096


@triton.jit
def _quantize_rows_kernel(
    X,
    X2,
    X8,
    Scale,
    Rstd,
    T,
    C,
    C1,
    top,
    floor,
    eps,
    WITH_RSTD: tl.constexpr,
    JOINED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    inside = (rows[:, None] < T) & (cols[None, :] < C)
    rows64 = rows.to(tl.int64)[:, None]
    offsets = rows64 * C + cols[None, :]
    # Columns below C1 come from X [T, C1], the rest from X2 [T, C - C1] (C1 = C without X2).
    first = cols[None, :] < C1
    x = tl.load(X + rows64 * C1 + cols[None, :], mask=inside & first, other=0.0).to(tl.float32)
    if JOINED:
        rest = tl.load(X2 + rows64 * (C - C1) + (cols[None, :] - C1), mask=inside & ~first, other=0.0)
        x += rest.to(tl.float32)
    # Divisions correctly rounded, as numerics.py's: the same scales on every path.
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), floor)
    s = tl.math.div_rn(tl.full(amax.shape, top, tl.float32), amax)
    x8 = tl.clamp(x * s[:, None], -top, top)
    tl.store(X8 + offsets, x8.to(X8.dtype.element_ty), mask=inside)
    scale = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    if WITH_RSTD:
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / C + eps)
        tl.store(Rstd + rows, rstd, mask=rows < T)
        scale = scale * rstd
    tl.store(Scale + rows, scale, mask=rows < T)


def quantize_rows(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    rstd: bool = False,
    x2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(x8, scale, rstd) for a contiguous x [T, C]: x8 in dtype (an FP8 format), scale float32 [T] with
    x ~ x8 * scale[:, None] (times each row's 1/rms with rstd=True), and that 1/rms (float32 [T]) or None.
    With x2 [T, C2] (contiguous, x's dtype), the same of [x | x2]: x8 is [T, C + C2]."""
    check_interpreter()
    if x.dim() != 2 or not x.is_contiguous() or dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(
            f"x {x.dtype} {tuple(x.shape)} to {dtype}: expected a contiguous [T, C] and an FP8 dtype"
        )
    if x2 is not None and (
        x2.dim() != 2 or not x2.is_contiguous() or x2.shape[0] != x.shape[0] or x2.dtype != x.dtype
    ):
        raise ValueError(
            f"x2 {x2.dtype} {tuple(x2.shape)}: expected a contiguous {x.dtype} [{x.shape[0]}, C2] beside x"
        )
    T, C = x.shape[0], x.shape[1] + (0 if x2 is None else x2.shape[1])
    x8 = torch.empty(T, C, device=x.device, dtype=dtype)
    scale = torch.empty(T, device=x.device, dtype=torch.float32)
    inv_rms = torch.empty(T, device=x.device, dtype=torch.float32) if rstd else None
    block_c = triton.next_power_of_2(C)
    rows = max(1, ELEMENTS // block_c)
    _quantize_rows_kernel[(triton.cdiv(T, rows),)](
        x,
        x if x2 is None else x2,
        x8,
        scale,
        inv_rms,
        T,
        C,
        x.shape[1],
        torch.finfo(dtype).max,
        AMAX_FLOOR,
        RMS_EPS,
        WITH_RSTD=rstd,
        JOINED=x2 is not None,
        ROWS=rows,
        BLOCK_C=block_c,
        num_warps=4 if block_c <= 4096 else 8,
    )
    return x8, scale, inv_rms
