"""`residual_linear`: a block's output projection added to the residual stream, out = r + y W^T, as a
PyTorch custom operator with autograd.

Compiled from PyTorch, r + y W^T becomes cuBLAS's addmm, which first copies r into its output (a read and a
write of the whole stream) and reads it back in its epilogue. On Hopper this operator runs
gemm_hopper.py's product, whose epilogue reads r's tile and adds it: the copy is gone. Elsewhere it
runs torch.addmm. The backward is PyTorch's: dr = g, dy = g W, dW = g^T y.
The operator has a fake implementation, so torch.compile traces through it without a graph break.
"""

import torch

from kernels.fused.products import fp8_product, fp8_rows, fp8_weight, on_hopper_product, weight_grad


@torch.library.custom_op("varlen_gpt::residual_linear", mutates_args=())
def residual_linear_op(r: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if on_hopper_product(r, y, w):
        from kernels.fused.gemm_hopper import residual_matmul

        return residual_matmul(r, y, w)
    return torch.addmm(r, y, w.t())


@residual_linear_op.register_fake
def _(r, y, w):
    return r.new_empty(r.shape)


def _setup_context(ctx, inputs, output):
    _, y, w = inputs
    ctx.save_for_backward(y, w)


def _backward(ctx, g):
    y, w = ctx.saved_tensors
    return g, g @ w, g.t() @ y


residual_linear_op.register_autograd(_backward, setup_context=_setup_context)


def _check_shapes(r: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> None:
    if r.dim() != 2 or y.dim() != 2 or w.shape != (r.shape[1], y.shape[1]) or y.shape[0] != r.shape[0]:
        raise ValueError(
            f"r {tuple(r.shape)}, y {tuple(y.shape)}, w {tuple(w.shape)}: expected [T, N], [T, K], [N, K]"
        )


def residual_linear(r: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """r + y w^T for r [T, N], y [T, K] and w [N, K] (an nn.Linear weight), in r's dtype: y and w are cast
    to it, as autocast would cast them for the product."""
    _check_shapes(r, y, w)
    return residual_linear_op(r.contiguous(), y.to(r.dtype).contiguous(), w.to(r.dtype))


# ---- FP8 ------------------------------------------------------------------------------------------------
# The same with FP8 products (products.py's fp8_rows, fp8_product): y and, in the backward, g quantised row
# by row to e4m3, W per tensor as it is stored (its transpose for dy = g W) outside the operators
# (products.py's fp8_weight), the rows' and W's scales applied and r added in the epilogue; dW = g^T y in
# bf16 (wgrad_hopper.py where it is preferred), which autograd casts to W's dtype.


@torch.library.custom_op("varlen_gpt::residual_linear_fp8", mutates_args=())
def residual_linear_fp8_op(
    r: torch.Tensor, y: torch.Tensor, w: torch.Tensor, w8: torch.Tensor, w_inv: torch.Tensor
) -> torch.Tensor:
    """r + y W^T from an FP8 product with w8, W in e4m3. w itself is an input only so that autograd gives
    it its gradient."""
    y8, y_scale, _ = fp8_rows(y)
    return fp8_product(y8, y_scale, w8, w_inv, "residual", r)


@residual_linear_fp8_op.register_fake
def _(r, y, w, w8, w_inv):
    return r.new_empty(r.shape)


@torch.library.custom_op("varlen_gpt::residual_linear_fp8_bwd", mutates_args=())
def residual_linear_fp8_bwd(
    g: torch.Tensor, y: torch.Tensor, w_t8: torch.Tensor, w_inv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, dW): dy = g W from an FP8 product with w_t8, W^T in e4m3; dW = g^T y in bf16. An operator of its
    own, so that the compiled backward calls the quantisation kernel instead of tracing into it."""
    g8, g_scale, _ = fp8_rows(g)
    return fp8_product(g8, g_scale, w_t8, w_inv, "plain"), weight_grad(g, y)


@residual_linear_fp8_bwd.register_fake
def _(g, y, w_t8, w_inv):
    return torch.empty_like(y), y.new_empty(w_t8.t().shape)


def _setup_fp8_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[1:3])


def _fp8_backward(ctx, g):
    y, w = ctx.saved_tensors
    dy, dw = residual_linear_fp8_bwd(g.contiguous(), y, *fp8_weight(w, transposed=True))
    return g, dy, dw, None, None


residual_linear_fp8_op.register_autograd(_fp8_backward, setup_context=_setup_fp8_context)


def residual_linear_fp8(r: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """residual_linear with FP8 products (see above) for a bf16 r: out and r's and y's gradients in bf16."""
    _check_shapes(r, y, w)
    if r.dtype != torch.bfloat16:
        raise ValueError(f"r {r.dtype}: the FP8 projection takes a bfloat16 residual stream")
    return residual_linear_fp8_op(r.contiguous(), y.to(r.dtype).contiguous(), w, *fp8_weight(w))
