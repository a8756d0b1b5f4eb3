"""FP8 matrix products for the model's linear layers, through torch._scaled_mm (cuBLASLt on the GPU).

`linear(x, w, mode)` is x W^T with both operands cast to float8 e4m3 and scaled so that their largest
magnitude lands on e4m3's largest finite value (448), per tensor (`tensorwise`, as nanochat's `--fp8`) or
per row of each operand along the product's reduction (`rowwise`). The scales are computed on the device
(amax, divide): nothing waits for the host. The backward quantises the output gradient too: to e5m2
(range 57,344, two mantissa bits) for `tensorwise`; to e4m3 with row scales for `rowwise`, which cuBLAS
takes only in e4m3. Each operand is quantised along the axis its product reduces; the weights and the
optimiser states stay as they are. The quantisation is plain PyTorch, which torch.compile fuses into the
kernels that produce and read the operands.

Values beyond the format's range after scaling are saturated at its largest finite value. A non-finite
input makes its scale 0 or NaN and so its product non-finite: the loss shows it at once instead of training
on silently clipped values.
"""

import torch

from configs.schema import ConfigError
from kernels.fused.numerics import E4M3, E5M2, quantize

FP8_MODES = ("none", "tensorwise", "rowwise")


def _product(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    rowwise: bool,
    grad_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """a [M, K] b^T for b [N, K] in FP8: a's scale per row (or tensor), b's per row (or tensor). a is cast
    to grad_dtype where given (an output gradient), else to e4m3."""
    a8, a_inv = quantize(a, grad_dtype or E4M3, -1 if rowwise else None)
    b8, b_inv = quantize(b, E4M3, -1 if rowwise else None)
    # cuBLASLt takes the first operand row-major and the second column-major: with b8 row-major, b8.t() is.
    a8, b8, b_inv = a8.contiguous(), b8.contiguous(), b_inv.t() if rowwise else b_inv
    return torch._scaled_mm(a8, b8.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


def _column_major(b: torch.Tensor) -> torch.Tensor:
    """b with the same shape, stored column-major, as cuBLASLt takes the second operand."""
    return b.t().contiguous().t()


class _Linear(torch.autograd.Function):
    """x W^T in FP8, forward and backward. Plain PyTorch ops that torch.compile traces: inductor fuses each
    quantisation (amax, scale, cast, transposed copy) into the kernels around it.

    `tensorwise` saves the FP8 operands of the forward and their scales for the backward: one scale per
    tensor holds along either axis, so g8^T x8 and g8 W8 reuse them, and the saved activation is half the
    bytes of bf16. `rowwise` scales along the reduction of each product, which differs between the forward
    and the backward, so it saves x and W and quantises them again there."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, rowwise: bool) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ctx.rowwise, ctx.x_shape, ctx.w_dtype = rowwise, x.shape, w.dtype
        if rowwise:
            ctx.save_for_backward(x2, w)
            y = _product(x2, w, x.dtype, rowwise=True)
        else:
            x8, x_inv = quantize(x2, E4M3)
            w8, w_inv = quantize(w, E4M3)
            ctx.save_for_backward(x8, x_inv, w8, w_inv)
            y = torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype)
        return y.view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.rowwise:
            x2, w = ctx.saved_tensors
            # dx = g W reduces over the output features, so W enters as W^T [K, N], quantised along N.
            dx = _product(g2, w.t(), g.dtype, rowwise=True, grad_dtype=E4M3)
            # dW = g^T x reduces over the tokens; both operands are quantised along them. cuBLAS gives
            # row-scaled products only in bf16.
            dw_dtype = torch.bfloat16 if g.is_cuda else torch.float32
            dw = _product(g2.t(), x2.t(), dw_dtype, rowwise=True, grad_dtype=E4M3)
        else:
            x8, x_inv, w8, w_inv = ctx.saved_tensors
            g8, g_inv = quantize(g2, E5M2)
            dx = torch._scaled_mm(g8, _column_major(w8), scale_a=g_inv, scale_b=w_inv, out_dtype=g.dtype)
            dw = torch._scaled_mm(
                g8.t().contiguous(), _column_major(x8), scale_a=g_inv, scale_b=x_inv, out_dtype=torch.float32
            )
        return dx.view(ctx.x_shape), dw.to(ctx.w_dtype), None


def linear(x: torch.Tensor, w: torch.Tensor, mode: str) -> torch.Tensor:
    """x W^T (nn.Linear without bias) in `mode`: one of FP8_MODES."""
    if mode == "none":
        return torch.nn.functional.linear(x, w)
    if torch.is_autocast_enabled(x.device.type):  # as autocast's linear: the output in its dtype (bf16)
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return _Linear.apply(x, w, mode == "rowwise")


def check_mode(cfg, device: torch.device) -> None:
    """Refuse, at start-up, an FP8 mode the device cannot run."""
    mode = cfg.fp8
    if mode not in FP8_MODES:
        raise ConfigError(f"model.fp8={mode!r} must be one of {', '.join(FP8_MODES)}")
    if mode == "none" or device.type != "cuda":
        return
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(
            f"model.fp8={mode} needs FP8 tensor cores (compute capability 8.9 or later); "
            f"{torch.cuda.get_device_name(device)} has none: use model.fp8=none"
        )
