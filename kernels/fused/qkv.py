"""`qkv_rope_norm`: attention's queries, keys and values, q = rms_norm(rope(x Wq^T)) per head, k likewise and
v = x Wv^T, as PyTorch custom operators with autograd.

On Hopper the queries and keys come from one product (gemm_hopper.py) whose epilogue rotates and
normalises each head of its output tile before the store: that product's output is never written, only q, k
and each head's 1/rms. The values are cuBLAS's plain product: with no epilogue to fuse, the Gluon product
measured no faster. Elsewhere the same formulas run in PyTorch (`reference_forward`). The product rounds to
x's dtype before the rotation, as the unfused model does (its rotation starts from nn.Linear's output); the
rotation and the norm then run in float32.

Backward, per head with y = q (the output, kept for attention anyway), r its 1/rms and dy its gradient:

    du = r (dy - y mean(dy y))          the RMSNorm's backward (u = rope(h), y = r u)
    dh = rope^-1(du)                    the rotation by -angle

One Triton kernel writes dh of the queries' and the keys' heads into one [T, Nq + Nk] tensor (on CUDA;
`reference_grad` elsewhere). The values' gradient dv joins it only inside the products that follow, which read
the two tensors as one [T, Nq + Nk + Nv] operand without copying them together: on Hopper the input gradient
is one product over K = Nq + Nk + Nv (gemm_hopper.py's `joined_matmul`), and the three weight
gradients one [Nq + Nk + Nv, C] product by wgrad_hopper.py's stream-K kernel. At d20 (an H200, 65,536
tokens) the input gradient took 905-915 us against 930-940 for cuBLAS over a joined copy, and the copy itself
~85 us in this kernel. Kept apart, each gradient would be two cuBLAS products (dW 744 + 326 us, dx 625 +
339 us, and the add of their outputs).
"""

import torch  # noqa: I001 (kernels.common must come before triton)

# Before triton: without CUDA it switches Triton to the interpreter (see kernels/common.py).
from kernels.common import check_interpreter
from kernels.fused.numerics import RMS_EPS, wide
from kernels.fused.products import (
    fp8_on_hopper,
    fp8_product,
    fp8_rows,
    fp8_weight,
    on_hopper_product,
    weight_grad,
)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# Backward block choice: rows per program (all their heads, one after another).
BWD_ROWS, BWD_WARPS = 32, 4


def supported_head_dim(head_dim: int) -> bool:
    """Whether the fused product takes heads of head_dim: whole heads in each of its output tiles."""
    from kernels.fused import gemm_hopper

    return gemm_hopper.BN % head_dim == 0


def _heads(y: torch.Tensor, head_dim: int) -> torch.Tensor:
    return y.view(y.shape[0], -1, head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the halves of x's last dim (the model's apply_rotary, without its casts)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def reference_forward(x, wq, wk, cos, sin):
    """(q, k, rstd) as the fused product computes them, in PyTorch (float32 at least inside)."""
    return _rope_norm(x @ wq.t(), x @ wk.t(), cos, sin)


def _rope_norm(hq, hk, cos, sin):
    """(q, k, rstd) from the products' outputs hq, hk (rounded to their dtype, as the fused product rounds
    them before its epilogue), rotated and normalised per head in float32 at least."""
    head_dim = 2 * cos.shape[1]
    outs, rstds = [], []
    for h in (hq, hk):
        u = _rotate(_heads(h, head_dim).to(wide(h.dtype)), cos[:, None], sin[:, None])
        rstd = torch.rsqrt(u.square().mean(dim=-1) + RMS_EPS)
        outs.append((u * rstd[..., None]).to(h.dtype).flatten(1))
        rstds.append(rstd)
    return outs[0], outs[1], torch.cat(rstds, dim=1)


def reference_grad(dq, dk, q, k, rstd, cos, sin):
    """dh [T, Nq + Nk]: the gradient of the queries' and keys' product outputs, in PyTorch."""
    head_dim = 2 * cos.shape[1]
    dh = []
    for dy, y in ((dq, q), (dk, k)):
        dy, y = _heads(dy, head_dim).to(wide(y.dtype)), _heads(y, head_dim).to(wide(y.dtype))
        r = rstd[:, : y.shape[1]] if not dh else rstd[:, -y.shape[1] :]
        du = r[..., None] * (dy - y * (dy * y).mean(dim=-1, keepdim=True))
        dh.append(_rotate(du, cos[:, None], -sin[:, None]).to(q.dtype).flatten(1))
    return torch.cat(dh, dim=1)


@triton.jit
def _head_grad(dY, Y, Rstd, dH, rows, T, c, s, width, heads, first, n_heads, HEAD_DIM: tl.constexpr):
    """Every head of one input (queries or keys: dY, Y [T, width]) for these rows, into dH's columns of heads
    first.. (see the module docstring). Rstd and dH have n_heads heads' columns."""
    HALF: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, HALF)
    inside = rows[:, None] < T
    for head in range(heads):
        lo = rows[:, None] * width + head * HEAD_DIM + cols[None, :]
        dy1 = tl.load(dY + lo, mask=inside, other=0.0).to(tl.float32)
        dy2 = tl.load(dY + lo + HALF, mask=inside, other=0.0).to(tl.float32)
        y1 = tl.load(Y + lo, mask=inside, other=0.0).to(tl.float32)
        y2 = tl.load(Y + lo + HALF, mask=inside, other=0.0).to(tl.float32)
        r = tl.load(Rstd + rows * n_heads + first + head, mask=rows < T, other=0.0)
        mean = (tl.sum(dy1 * y1, axis=1) + tl.sum(dy2 * y2, axis=1)) / HEAD_DIM
        du1 = r[:, None] * (dy1 - y1 * mean[:, None])
        du2 = r[:, None] * (dy2 - y2 * mean[:, None])
        out = dH + rows[:, None] * (n_heads * HEAD_DIM) + (first + head) * HEAD_DIM + cols[None, :]
        tl.store(out, (du1 * c + du2 * s).to(dH.dtype.element_ty), mask=inside)
        tl.store(out + HALF, (du2 * c - du1 * s).to(dH.dtype.element_ty), mask=inside)


@triton.jit
def _rope_norm_bwd_kernel(dQ, dK, Q, K, Rstd, Cos, Sin, dH, T, NQ, NK, HEAD_DIM: tl.constexpr,
                          ROWS: tl.constexpr):
    """dH for ROWS rows, every head of queries then of keys: the rows' angles are loaded once."""
    HALF: tl.constexpr = HEAD_DIM // 2
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    angles = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]
    c = tl.load(Cos + angles, mask=rows[:, None] < T, other=1.0)
    s = tl.load(Sin + angles, mask=rows[:, None] < T, other=0.0)
    HQ, HK = NQ // HEAD_DIM, NK // HEAD_DIM
    _head_grad(dQ, Q, Rstd, dH, rows, T, c, s, NQ, HQ, 0, HQ + HK, HEAD_DIM)
    _head_grad(dK, K, Rstd, dH, rows, T, c, s, NK, HK, HQ, HQ + HK, HEAD_DIM)


def rope_norm_grad(dq, dk, q, k, rstd, cos, sin) -> torch.Tensor:
    """dh [T, Nq + Nk] by the Triton kernel (all tensors contiguous, on one device)."""
    check_interpreter()
    (T, Nq), Nk, head_dim = q.shape, k.shape[1], 2 * cos.shape[1]
    dh = q.new_empty(T, Nq + Nk)
    _rope_norm_bwd_kernel[(triton.cdiv(T, BWD_ROWS),)](
        dq, dk, q, k, rstd, cos, sin, dh, T, Nq, Nk, HEAD_DIM=head_dim, ROWS=BWD_ROWS, num_warps=BWD_WARPS,
    )
    return dh


@torch.library.custom_op("varlen_gpt::qkv_rope_norm_fwd", mutates_args=())
def qkv_rope_norm_fwd(
    x: torch.Tensor, w: torch.Tensor, nq: int, nk: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, rstd) from the stacked weights w = [Wq; Wk; Wv] (Wq's rows nq, Wk's nk)."""
    wq, wk, wv = w[:nq], w[nq : nq + nk], w[nq + nk :]
    if on_hopper_product(x, wq, wk) and supported_head_dim(2 * cos.shape[1]):
        from kernels.fused.gemm_hopper import rope_norm_matmul

        q, k, rstd = rope_norm_matmul(x, wq, wk, cos, sin, 2 * cos.shape[1])
    else:
        q, k, rstd = reference_forward(x, wq, wk, cos, sin)
    return q, k, x @ wv.t(), rstd


@qkv_rope_norm_fwd.register_fake
def _(x, w, nq, nk, cos, sin):
    T = x.shape[0]
    rstd = x.new_empty(T, (nq + nk) // (2 * cos.shape[1]), dtype=wide(x.dtype))
    return x.new_empty(T, nq), x.new_empty(T, nk), x.new_empty(T, w.shape[0] - nq - nk), rstd


@torch.library.custom_op("varlen_gpt::qkv_rope_norm_bwd", mutates_args=())
def qkv_rope_norm_bwd(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    rstd: torch.Tensor,
    w_inv: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx and the gradient of the stacked weights [Wq; Wk; Wv], from dh [T, Nq + Nk] and dv read as one
    operand. w is the stack in x's dtype; or, given w_inv, its transpose in e4m3 with the stack's 1 / s,
    and dx comes from an FP8 product (see below), the weight gradient still bf16."""
    dq, dk, dv = dq.contiguous(), dk.contiguous(), dv.contiguous()
    if x.is_cuda:
        dh = rope_norm_grad(dq, dk, q, k, rstd, cos, sin)
    else:
        dh = reference_grad(dq, dk, q, k, rstd, cos, sin)
    dx = _input_grad(dh, dv, w) if w_inv is None else _fp8_input_grad(dh, dv, w, w_inv)
    return dx, weight_grad(dh, x, dv)


def _input_grad(dh: torch.Tensor, dv: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[dh | dv] w: one product on Hopper, two elsewhere."""
    if on_hopper_product(dh, dv, w):
        from kernels.fused import gemm_hopper

        if dh.shape[1] % gemm_hopper.BK == 0:
            return gemm_hopper.joined_matmul(dh, dv, w)
    return dh @ w[: dh.shape[1]] + dv @ w[dh.shape[1] :]


@qkv_rope_norm_bwd.register_fake
def _(dq, dk, dv, x, w, cos, sin, q, k, rstd, w_inv):
    return x.new_empty(x.shape), x.new_empty(w.shape if w_inv is None else w.t().shape)


def _setup_context(ctx, inputs, output):
    x, w, _, _, cos, sin = inputs
    q, k, _, rstd = output
    ctx.save_for_backward(x, w, cos, sin, q, k, rstd)


def _backward(ctx, dq, dk, dv, drstd):
    # rstd is an output only so that the backward can keep it; nothing downstream differentiates it.
    return *qkv_rope_norm_bwd(dq, dk, dv, *ctx.saved_tensors, None), None, None, None, None


qkv_rope_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def qkv_rope_norm(x, wq, wk, wv, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Nq], k [T, Nk] and v [T, Nv] for x [T, C], wq [Nq, C], wk [Nk, C], wv [Nv, C] and each token's
    rotary angles cos, sin [T, head_dim / 2], in x's dtype (the weights are cast to it, as autocast would cast
    them)."""
    q, k, v, _ = qkv_rope_norm_fwd(*_operands(x, wq, wk, wv, cos, sin))
    return q, k, v


def _operands(x, wq, wk, wv, cos, sin):
    """The forward operator's arguments (x, w, nq, nk, cos, sin), the shapes checked."""
    x, cos, sin = _inputs(x, wq, wk, wv, cos, sin)
    # Cast and stacked once (one kernel when compiled; cast first, so that eager makes no fp32 stack): the
    # backward's products read the stack as it is.
    w = torch.cat([w.to(x.dtype) for w in (wq, wk, wv)])
    return x, w, wq.shape[0], wk.shape[0], cos, sin


def _inputs(x, wq, wk, wv, cos, sin):
    """(x, cos, sin) as the operators take them, the shapes checked."""
    T, C = x.shape
    if any(w.shape[1] != C for w in (wq, wk, wv)) or cos.shape != sin.shape or cos.shape[0] != T:
        raise ValueError(
            f"x {tuple(x.shape)}, wq {tuple(wq.shape)}, wk {tuple(wk.shape)}, wv {tuple(wv.shape)}, "
            f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}: expected [T, C], [Nq, C], [Nk, C], [Nv, C], "
            "[T, head_dim / 2] twice"
        )
    head_dim = 2 * cos.shape[1]
    if any(w.shape[0] % head_dim for w in (wq, wk, wv)):
        raise ValueError(
            f"wq {tuple(wq.shape)}, wk {tuple(wk.shape)}, wv {tuple(wv.shape)}: not whole heads of {head_dim}"
        )
    return x.contiguous(), *(t.to(wide(x.dtype)).contiguous() for t in (cos, sin))


# ---- FP8 ------------------------------------------------------------------------------------------------
# The same with FP8 products for the forward and the input gradient (products.py's fp8_rows, fp8_product):
# x's rows quantised to e4m3, and in the backward the rows of [dh | dv] (one scale per row across the three
# outputs' gradients, which one product reads), the stacked weights [Wq; Wk; Wv] per tensor (its transpose
# for dx). The stack is quantised outside the operators (products.py's fp8_weight), from the weights as
# they are stored (float32 masters: one rounding), and only its e4m3 form is made: the backward keeps the
# weights themselves. The q/k product applies x's row scale and the weights' scale before the rotation and
# the norm. The weight gradients are bf16, as above, cast by autograd to the weights' dtype.


def _fp8_rope_norm(x8, x_scale, wq8, wk8, w_scale, cos, sin):
    """(q, k, rstd) from FP8 x8 and weights: gemm_hopper.py's q/k product on Hopper, float32 math
    elsewhere."""
    if fp8_on_hopper(x8):
        from kernels.fused.gemm_hopper import rope_norm_matmul

        return rope_norm_matmul(x8, wq8, wk8, cos, sin, 2 * cos.shape[1], x_scale, w_scale.reshape(1))
    hq, hk = (fp8_product(x8, x_scale, w8, w_scale, "plain") for w8 in (wq8, wk8))
    return _rope_norm(hq, hk, cos, sin)


@torch.library.custom_op("varlen_gpt::qkv_rope_norm_fp8_fwd", mutates_args=())
def qkv_rope_norm_fp8_fwd(
    x: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    w8: torch.Tensor,
    w_inv: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, rstd) as qkv_rope_norm_fwd's, from FP8 products with w8, the stack [Wq; Wk; Wv] in e4m3.
    wq, wk and wv are inputs only so that autograd gives them their gradients."""
    nq, nk = wq.shape[0], wk.shape[0]
    x8, x_scale, _ = fp8_rows(x)
    q, k, rstd = _fp8_rope_norm(x8, x_scale, w8[:nq], w8[nq : nq + nk], w_inv, cos, sin)
    return q, k, fp8_product(x8, x_scale, w8[nq + nk :], w_inv, "plain"), rstd


@qkv_rope_norm_fp8_fwd.register_fake
def _(x, wq, wk, wv, cos, sin, w8, w_inv):
    T = x.shape[0]
    rstd = x.new_empty(T, (wq.shape[0] + wk.shape[0]) // (2 * cos.shape[1]), dtype=torch.float32)
    return x.new_empty(T, wq.shape[0]), x.new_empty(T, wk.shape[0]), x.new_empty(T, wv.shape[0]), rstd


def _fp8_input_grad(
    dh: torch.Tensor, dv: torch.Tensor, w_t8: torch.Tensor, w_inv: torch.Tensor
) -> torch.Tensor:
    """[dh | dv] w from FP8: the rows of [dh | dv] quantised without joining them, w^T in e4m3 (w_t8)."""
    g8, g_scale, _ = fp8_rows(dh, x2=dv)
    return fp8_product(g8, g_scale, w_t8, w_inv, "plain")


def _setup_fp8_context(ctx, inputs, output):
    x, wq, wk, wv, cos, sin = inputs[:6]
    q, k, _, rstd = output
    ctx.save_for_backward(x, wq, wk, wv, cos, sin, q, k, rstd)


def _fp8_backward(ctx, dq, dk, dv, drstd):
    x, wq, wk, wv, cos, sin, q, k, rstd = ctx.saved_tensors
    w_t8, w_inv = fp8_weight(torch.cat([wq, wk, wv]), transposed=True)
    dx, dw = qkv_rope_norm_bwd(dq, dk, dv, x, w_t8, cos, sin, q, k, rstd, w_inv)
    return dx, *dw.split([wq.shape[0], wk.shape[0], wv.shape[0]]), None, None, None, None


qkv_rope_norm_fp8_fwd.register_autograd(_fp8_backward, setup_context=_setup_fp8_context)


def qkv_rope_norm_fp8(x, wq, wk, wv, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv_rope_norm with FP8 products (see above), for a bf16 x: q, k, v and x's gradient in bf16, the
    weights quantised as they are stored."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x {x.dtype}: the FP8 q/k/v take a bfloat16 input")
    x, cos, sin = _inputs(x, wq, wk, wv, cos, sin)
    w8, w_inv = fp8_weight(torch.cat([wq, wk, wv]))
    q, k, v, _ = qkv_rope_norm_fp8_fwd(x, wq, wk, wv, cos, sin, w8, w_inv)
    return q, k, v
