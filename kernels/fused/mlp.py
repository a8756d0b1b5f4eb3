"""`relu2_mlp`: the pre-norm ReLU^2 MLP with its residual, out = x + relu(rms_norm(x) W1^T)^2 W2^T (a block's
update of the residual stream x), as PyTorch custom operators with autograd.

The RMSNorm is never written out. With r = 1/rms of each row of x, rms_norm(x) W1^T = r * (x W1^T) row by
row, so the first product reads x itself and scales its rows. On Hopper the products that feed and follow
the activation run gemm_hopper.py, which does the elementwise work in their epilogues: the forward
writes a = relu(r * x W1^T)^2 straight from the product (never h, nor the normalised x), and the backward
writes dh = r * (g W2) * 2 sqrt(a) straight from its product, with sqrt(a) = relu(h) standing in for the h
that was never kept. With that dh, dh^T x is W1's gradient and u = dh W1 is r times the normalised input's
gradient, from which the norm's backward is dx = g + u - x r^2 mean(u x) (g from the residual). The products
over the hidden width, x + a W2^T and dh W1, are the same Gluon GEMM, the first adding x in its epilogue
(`_product`): the stream's add then costs no pass of its own, and the norm that follows (the next block's)
reads one tensor instead of two. The weight gradients run wgrad_hopper.py where that beats cuBLAS
(its `preferred`: d20's widths at full batch), else cuBLAS.
Elsewhere the operators run the same formulas in PyTorch (`reference_*`).
The operators take W2 transposed ([H, C], row-major), so that both fused products read their weight in
nn.Linear's layout; `relu2_mlp` makes that copy (cast and transpose in one compiled kernel when traced).
End to end that measured the same as a kernel that reads W2 as it is.
Both operators have fake implementations, so torch.compile traces through them without a graph break; the
norm's backward is plain PyTorch, which the compiler fuses into one pass with the residual's gradient.
"""

import torch  # noqa: I001 (kernels.common must come before triton)

# Before triton: without CUDA it switches Triton to the interpreter (see kernels/common.py).
from kernels.common import check_interpreter
from kernels.fused.numerics import RMS_EPS, wide
from kernels.fused.products import fp8_product, fp8_rows, fp8_weight, on_hopper_product, weight_grad

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# The 1/rms kernel's rows per program and columns per step (H200: 50 us at d20's 65,536 x 1,280, against
# 65 us for 16 rows of 512 columns; a copy of that size takes about 40).
RSTD_ROWS, RSTD_COLS = 4, 256


@triton.jit
def _rstd_kernel(X, Rstd, T, C, eps, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    base = X + rows.to(tl.int64)[:, None] * C
    total = tl.zeros([ROWS], tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(base + cols[None, :], mask=(rows[:, None] < T) & (cols[None, :] < C), other=0.0)
        total += tl.sum(x.to(tl.float32) * x.to(tl.float32), axis=1)
    tl.store(Rstd + rows, tl.rsqrt(total / C + eps), mask=rows < T)


def rstd_kernel(x: torch.Tensor) -> torch.Tensor:
    """float32 1/rms of each row of a contiguous x [T, C] by the Triton kernel: one read of x."""
    check_interpreter()
    T, C = x.shape
    rstd = torch.empty(T, device=x.device, dtype=torch.float32)
    block_c = min(triton.next_power_of_2(C), RSTD_COLS)
    _rstd_kernel[(triton.cdiv(T, RSTD_ROWS),)](x, rstd, T, C, RMS_EPS, ROWS=RSTD_ROWS, BLOCK_C=block_c)
    return rstd


def row_rstd(x: torch.Tensor) -> torch.Tensor:
    """1/rms of each row of x [T, C], float32 (float64 for a float64 x, in PyTorch)."""
    if x.is_cuda and x.dtype != torch.float64:
        return rstd_kernel(x)
    return torch.rsqrt(x.to(wide(x.dtype)).square().mean(dim=-1) + RMS_EPS)


def reference_forward(x: torch.Tensor, w1: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """a = relu(rstd * x w1^T)^2, rows scaled (in float32 at least, rounded to x's dtype)."""
    h = (x @ w1.t()).to(rstd.dtype) * rstd[:, None]
    return torch.relu(h).square().to(x.dtype)


def reference_grad(g: torch.Tensor, w2_t: torch.Tensor, a: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """dh = rstd * (g w2) * 2 sqrt(a), with w2_t = w2^T: d relu(h)^2 / dh = 2 relu(h), relu(h) = sqrt(a)."""
    da = (g @ w2_t.t()).to(rstd.dtype)
    return (da * (2 * a.to(rstd.dtype).sqrt()) * rstd[:, None]).to(g.dtype)


@torch.library.custom_op("varlen_gpt::relu2_mlp_fwd", mutates_args=())
def relu2_mlp_fwd(
    x: torch.Tensor, w1: torch.Tensor, w2_t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rstd = row_rstd(x)
    if on_hopper_product(x, w1):
        from kernels.fused.gemm_hopper import relu2_matmul

        a = relu2_matmul(x, w1, rstd)
    else:
        a = reference_forward(x, w1, rstd)
    return _product(a, w2_t, x), a, rstd


@relu2_mlp_fwd.register_fake
def _(x, w1, w2_t):
    rstd = x.new_empty(x.shape[0], dtype=wide(x.dtype))
    return x.new_empty(x.shape[0], w2_t.shape[1]), x.new_empty(x.shape[0], w1.shape[0]), rstd


@torch.library.custom_op("varlen_gpt::relu2_mlp_bwd", mutates_args=())
def relu2_mlp_bwd(
    g: torch.Tensor,
    x: torch.Tensor,
    w1: torch.Tensor,
    w2_t: torch.Tensor,
    a: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u, dW1, dW2), u = rstd * the normalised input's gradient (see the module docstring)."""
    g = g.contiguous()
    if on_hopper_product(g, w2_t, a):
        from kernels.fused.gemm_hopper import relu2_grad_matmul

        dh = relu2_grad_matmul(g, w2_t, a, rstd)
    else:
        dh = reference_grad(g, w2_t, a, rstd)
    # W2's gradient in W2's layout, seen as W2^T's: the fp32 gradient that autograd adds up over the
    # micro-batches then has W2's layout too, which takes a vectorised add instead of a strided one.
    return _product(dh, w1), weight_grad(dh, x), weight_grad(g, a).t()


def _product(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor | None = None) -> torch.Tensor:
    """a b over the hidden width (K = 4 C), plus r where given: on Hopper the Gluon product, cuBLAS
    elsewhere. At the power cap that training runs at, the plain Gluon product took 1,250 us at d20 against
    1,290 for cuBLAS's (an H200, once warm; cold, cuBLAS was faster), and end to end it gained 0.3% at d20
    and 0.2-0.4% at d12."""
    if on_hopper_product(a, b, *([] if r is None else [r])):
        from kernels.fused.gemm_hopper import matmul

        return matmul(a, b, r)
    return a @ b if r is None else torch.addmm(r, a, b)


@relu2_mlp_bwd.register_fake
def _(g, x, w1, w2_t, a, rstd):
    return x.new_empty(x.shape), w1.new_empty(w1.shape), w2_t.new_empty(w2_t.shape[1], w2_t.shape[0]).t()


def _setup_context(ctx, inputs, output):
    x, w1, w2_t = inputs
    ctx.save_for_backward(x, w1, w2_t, output[1], output[2])


def _input_grad(grad_out: torch.Tensor, x: torch.Tensor, u: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """dx = g + u - x r^2 mean(u x): the residual's gradient and the norm's backward (module docstring)."""
    xf, uf = x.to(rstd.dtype), u.to(rstd.dtype)
    dx = grad_out.to(rstd.dtype) + uf - xf * (rstd.square() * (uf * xf).mean(dim=-1))[:, None]
    return dx.to(x.dtype)


def _backward(ctx, grad_out, grad_a, grad_rstd):
    # a and rstd are outputs only so that the backward can keep them; nothing downstream differentiates them.
    x, w1, w2_t, a, rstd = ctx.saved_tensors
    u, dw1, dw2 = relu2_mlp_bwd(grad_out, x, w1, w2_t, a, rstd)
    return _input_grad(grad_out, x, u, rstd), dw1, dw2


relu2_mlp_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check_shapes(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
    if x.dim() != 2 or w1.shape != (w2.shape[1], x.shape[1]) or w2.shape[0] != x.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}: expected [T, C], [H, C], [C, H]"
        )


def relu2_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x + relu(rms_norm(x) w1^T)^2 w2^T for x [T, C], w1 [H, C] and w2 [C, H], in x's dtype (the weights are
    cast to it, as autocast would cast them for the products)."""
    _check_shapes(x, w1, w2)
    out, _, _ = relu2_mlp_fwd(x.contiguous(), w1.to(x.dtype), w2.t().to(x.dtype).contiguous())
    return out


# ---- FP8 ------------------------------------------------------------------------------------------------
# The same MLP with FP8 products for its forward and input gradients (products.py's fp8_rows, fp8_product):
# every product's left operand (x, a, g, dh) quantised row by row to e4m3, its right one (W1, W2 and their
# transposes) per tensor. The row scales multiply the rows in the products' epilogues, x's with its 1/rms
# (so the norm stays unwritten, as in the bf16 operator), and the weight's scale the whole. a, dh and the
# outputs are bf16, the weight gradients are the bf16 products of the operator above (wgrad_hopper.py):
# FP8 ones sum along the tokens, so both operands would first be quantised into transposed copies, which
# costs more than the FP8 product saves (scripts/bench_fp8_wgrad.py). The operators take the weights
# quantised (products.py's fp8_weight) from W1 and W2 as they are stored (float32 masters: one rounding, no
# bf16 copy kept for the backward): by `relu2_mlp_fp8` for the forward, by the registered backward for the
# backward's transposes. The forward takes W1 and W2 themselves only so that autograd gives them their
# gradients (which it casts from bf16 to theirs).


@torch.library.custom_op("varlen_gpt::relu2_mlp_fp8_fwd", mutates_args=())
def relu2_mlp_fp8_fwd(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w1_8: torch.Tensor,
    w1_inv: torch.Tensor,
    w2_8: torch.Tensor,
    w2_inv: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x8, x_scale, rstd = fp8_rows(x, with_rstd=True)
    a = fp8_product(x8, x_scale, w1_8, w1_inv, "relu2")
    a8, a_scale, _ = fp8_rows(a)
    return fp8_product(a8, a_scale, w2_8, w2_inv, "residual", x), a, rstd


@relu2_mlp_fp8_fwd.register_fake
def _(x, w1, w2, w1_8, w1_inv, w2_8, w2_inv):
    return (
        torch.empty_like(x),
        x.new_empty(x.shape[0], w1.shape[0]),
        x.new_empty(x.shape[0], dtype=torch.float32),
    )


@torch.library.custom_op("varlen_gpt::relu2_mlp_fp8_bwd", mutates_args=())
def relu2_mlp_fp8_bwd(
    g: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    rstd: torch.Tensor,
    w1_t8: torch.Tensor,
    w1_inv: torch.Tensor,
    w2_t8: torch.Tensor,
    w2_inv: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u, dW1, dW2) as relu2_mlp_bwd's, u and dh from FP8 products with W2^T and W1^T (w2_t8 [H, C], w1_t8
    [C, H])."""
    g = g.contiguous()
    g8, g_scale, _ = fp8_rows(g)
    dh = fp8_product(g8, g_scale * rstd, w2_t8, w2_inv, "relu2_grad", a)
    dh8, dh_scale, _ = fp8_rows(dh)
    u = fp8_product(dh8, dh_scale, w1_t8, w1_inv, "plain")
    return u, weight_grad(dh, x), weight_grad(g, a)


@relu2_mlp_fp8_bwd.register_fake
def _(g, x, a, rstd, w1_t8, w1_inv, w2_t8, w2_inv):
    return torch.empty_like(x), x.new_empty(w1_t8.t().shape), x.new_empty(w2_t8.t().shape)


def _setup_fp8_context(ctx, inputs, output):
    x, w1, w2 = inputs[:3]
    ctx.save_for_backward(x, w1, w2, output[1], output[2])


def _fp8_backward(ctx, grad_out, grad_a, grad_rstd):
    x, w1, w2, a, rstd = ctx.saved_tensors
    u, dw1, dw2 = relu2_mlp_fp8_bwd(grad_out, x, a, rstd, *fp8_weight(w1, True), *fp8_weight(w2, True))
    return _input_grad(grad_out, x, u, rstd), dw1, dw2, None, None, None, None


relu2_mlp_fp8_fwd.register_autograd(_fp8_backward, setup_context=_setup_fp8_context)


def relu2_mlp_fp8(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """relu2_mlp with FP8 products (see above), for a bf16 x: out and x's gradient in bf16, the weights
    quantised as they are stored."""
    _check_shapes(x, w1, w2)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x {x.dtype}: the FP8 MLP takes a bfloat16 residual stream")
    out, _, _ = relu2_mlp_fp8_fwd(x.contiguous(), w1, w2, *fp8_weight(w1), *fp8_weight(w2))
    return out
