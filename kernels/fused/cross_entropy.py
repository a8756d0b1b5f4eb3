"""Soft-capped cross-entropy of a block of logit rows in one Triton kernel: the losses and their gradient.

For each row z of raw logits (one token) and its target t, with capped logits c = cap * tanh(z / cap):

    loss = logsumexp(c) - c[t]          (0 where t < 0: no target)
    grad = scale * (softmax(c) - onehot(t)) * (1 - (c / cap)^2)     (d(scale * loss) / dz; 0 where t < 0)

One program per row loops over the row twice: the log-sum-exp, then the gradient (the second read follows
the first within the program, so part of it can come from L2; without a cap, or with one above 50, a
first pass finds the row's max). The target's logit is loaded on its own. On NVIDIA GPUs tanh is PTX's
tanh.approx.f32, one special-function instruction: with exp2 that makes two per logit and pass, which
bound the kernel, where an accurate tanh made it slower still (the compiled PyTorch formulation of
model/gpt.py, the CPU path, takes 0.68 ms per 8,192 x 32,768 bf16 chunk on an H200, this kernel 0.40 ms;
0.43 ms while every logit also paid for the row's bounds and the target's test). PTX bounds tanh.approx's
relative error by 2^-10.99; on a bf16 chunk the losses moved by 3e-7 (relative) and the gradient by at
most 1.5e-8 (of values up to 1.2e-4) against the accurate formulation. The interpreter cannot run PTX, so
there (and on ROCm) tanh comes from exp2 and a division.
"""

from typing import NamedTuple  # noqa: I001 (kernels.common must come before triton)

import torch

# Before triton: without CUDA it switches Triton to the interpreter (see kernels/common.py).
from kernels.common import INTERPRET, LOG2E, check_interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# PTX's tanh: compiled code on NVIDIA GPUs only.
PTX_TANH = not INTERPRET and torch.version.hip is None

class RowBlocks(NamedTuple):
    cols: int  # logits per loop step
    warps: int


def row_blocks(vocab_size: int) -> RowBlocks:
    """Block choice (measured on an H200 at V = 32,768): the one place where it is made."""
    return RowBlocks(min(2048, triton.next_power_of_2(vocab_size)), 8)


@triton.jit
def _tanh(x, PTX: tl.constexpr):
    if PTX:
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _load_capped(row_ptr, cols, V, cap, CAP: tl.constexpr, PTX: tl.constexpr, EVEN: tl.constexpr):
    """(c, t) of the row's logits at cols: the soft-capped logits cap * tanh(z / cap) (-inf past the row's
    end) and the tanh (the logits and 0 without a cap). EVEN: every col is inside the row."""
    if EVEN:
        z = tl.load(row_ptr + cols).to(tl.float32)
    else:
        z = tl.load(row_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
    if CAP:
        t = _tanh(z / cap, PTX)
        c = cap * t
    else:
        c, t = z, z * 0.0
    if not EVEN:
        c = tl.where(cols < V, c, float("-inf"))
    return c, t


@triton.jit
def _softcap_ce_kernel(
    logits, grad, targets, losses, scale, stride_l, stride_g, V, cap, CAP: tl.constexpr,
    ROW_MAX: tl.constexpr, PTX: tl.constexpr, BLOCK_V: tl.constexpr, EVEN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits += row * stride_l
    grad += row * stride_g
    target = tl.load(targets + row)
    offsets = tl.arange(0, BLOCK_V)

    # Soft-capped logits lie in (-cap, cap): for a cap up to 50 their exp stays well inside fp32's range,
    # so the log-sum-exp needs no pass for the row's max.
    shift = 0.0
    if ROW_MAX:
        row_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            c, t = _load_capped(logits, v0 + offsets, V, cap, CAP, PTX, EVEN)
            row_max = tl.maximum(row_max, c)
        shift = tl.max(row_max, 0)
    # Per-lane partial sums, reduced once after the loop. Per-logit work is what bounds the kernel, so the
    # loops do none for the target: its logit is loaded on its own (the same formula on the same value),
    # and the gradient's one-hot is subtracted in the one block that holds it.
    sum_exp = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        c, t = _load_capped(logits, v0 + offsets, V, cap, CAP, PTX, EVEN)
        sum_exp += tl.exp2((c - shift) * LOG2E)
    lse = shift + tl.log(tl.sum(sum_exp, 0))
    has_target = target >= 0
    first = tl.arange(0, 1)
    target_logit, _ = _load_capped(logits + tl.maximum(target, 0), first, 1, cap, CAP, PTX, False)
    tl.store(losses + row, tl.where(has_target, lse - tl.sum(target_logit, 0), 0.0))

    # Second read of the row, for the gradient.
    row_scale = tl.where(has_target, tl.load(scale), 0.0)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + offsets
        c, t = _load_capped(logits, cols, V, cap, CAP, PTX, EVEN)
        g = tl.exp2((c - lse) * LOG2E)
        if (target >= v0) & (target < v0 + BLOCK_V):
            g -= (cols == target).to(tl.float32)
        if CAP:
            g = g * (1.0 - t * t)
        g = (g * row_scale).to(grad.dtype.element_ty)
        if EVEN:
            tl.store(grad + cols, g)
        else:
            tl.store(grad + cols, g, mask=cols < V)


@torch.library.custom_op("varlen_gpt::softcap_cross_entropy", mutates_args=())
def softcap_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, cap: float, grad_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses [n] float32, grad [n, V] in grad_dtype) for logits [n, V] (last dim contiguous), targets [n]
    (int, < 0 for none), scale a 0-d float32 tensor (on the device: no host sync) and cap > 0, or 0 for no
    soft-cap. See the module docstring. grad_dtype may be an FP8 format, with `scale` putting the gradient
    inside its range: each value is rounded once, from float32."""
    check_interpreter()
    n, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    grad = logits.new_empty(logits.shape, dtype=grad_dtype)
    losses = torch.empty(n, dtype=torch.float32, device=logits.device)
    blocks = row_blocks(V)
    if n:
        _softcap_ce_kernel[(n,)](
            logits, grad, targets, losses, scale, logits.stride(0), grad.stride(0), V, cap, CAP=cap > 0,
            ROW_MAX=not 0 < cap <= 50, PTX=PTX_TANH, BLOCK_V=blocks.cols, EVEN=V % blocks.cols == 0,
            num_warps=blocks.warps,
        )
    return losses, grad


@softcap_cross_entropy.register_fake
def _(logits, targets, scale, cap, grad_dtype):
    losses = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return losses, logits.new_empty(logits.shape, dtype=grad_dtype)
