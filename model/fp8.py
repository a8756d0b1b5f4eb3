"""FP8 matrix products for the model's linear layers, through torch._scaled_mm (cuBLASLt on the GPU).

`linear(x, w, mode)` is x W^T with both operands cast to float8 e4m3 and scaled so that their largest
magnitude lands on e4m3's largest finite value (448), per tensor (`tensorwise`, as nanochat's `--fp8`) or
per row of each operand along the product's reduction (`rowwise`). The scales are computed on the device
(amax, divide): nothing waits for the host. The backward quantises the output gradient too: to e5m2
(range 57,344, two mantissa bits) for `tensorwise`; to e4m3 with row scales for `rowwise`, which cuBLAS
takes only in e4m3. Each operand is quantised along the axis its product reduces, from the high-precision
tensors saved by the forward, so the weights and the optimiser states stay as they are.

Values beyond the format's range after scaling are saturated at its largest finite value. A non-finite
input makes its scale 0 or NaN and so its product non-finite: the loss shows it at once instead of training
on silently clipped values.
"""

import torch

from configs.schema import ConfigError

FP8_MODES = ("none", "tensorwise", "rowwise")
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# Below this amax a tensor counts as zero: its scale stays finite and its product is exactly zero.
AMAX_FLOOR = 1e-12


def scale(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> torch.Tensor:
    """float32 s with max |x * s| = dtype's largest finite value: one for the tensor, or one per slice along
    `dim` (keepdim)."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    return torch.finfo(dtype).max / amax.float().clamp_min(AMAX_FLOOR)


def cast(x: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * s in dtype, saturated at its largest finite value (beyond it a plain cast may give inf)."""
    top = torch.finfo(dtype).max
    return (x.float() * s).clamp(-top, top).to(dtype)


def quantize(
    x: torch.Tensor, dtype: torch.dtype, dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x scaled into dtype, 1 / s): x is about `x8.float() * inv_scale`."""
    s = scale(x, dtype, dim)
    return cast(x, s, dtype), s.reciprocal()


def _product(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, rowwise: bool, grad_dtype=None):
    """a [M, K] b^T for b [N, K] in FP8: a's scale per row (or tensor), b's per row (or tensor). a is cast
    to grad_dtype where given (an output gradient), else to e4m3."""
    a8, a_inv = quantize(a, grad_dtype or E4M3, -1 if rowwise else None)
    b8, b_inv = quantize(b, E4M3, -1 if rowwise else None)
    # cuBLASLt takes the first operand row-major and the second column-major: with b8 row-major, b8.t() is.
    a8, b8, b_inv = a8.contiguous(), b8.contiguous(), b_inv.t() if rowwise else b_inv
    return torch._scaled_mm(a8, b8.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


# Custom ops: the quantisation (amax, scale, cast, the transposed copies of the backward) runs in eager
# PyTorch inside them, out of the compiler's reach. Correct, but each pass reads and writes whole
# activations: at d20 it costs more than FP8 saves (see the README), until it is fused into the kernels.
@torch.library.custom_op("varlen_gpt::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, w: torch.Tensor, rowwise: bool) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return _product(x2, w, x.dtype, rowwise).view(*x.shape[:-1], w.shape[0])


@fp8_linear.register_fake
def _(x, w, rowwise):
    return x.new_empty(*x.shape[:-1], w.shape[0])


@torch.library.custom_op("varlen_gpt::fp8_linear_bwd", mutates_args=())
def fp8_linear_bwd(
    g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rowwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    grad_dtype = E4M3 if rowwise else E5M2
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    # dx = g W: reduces over the output features, so W enters as W^T [K, N], quantised along N.
    dx = _product(g2, w.t(), x.dtype, rowwise, grad_dtype)
    # dW = g^T x: reduces over the tokens; both operands are quantised along them.
    dw_dtype = torch.bfloat16 if rowwise and g.is_cuda else torch.float32  # cuBLAS: row scales give bf16
    dw = _product(g2.t(), x2.t(), dw_dtype, rowwise, grad_dtype)
    return dx.view(x.shape), dw.to(w.dtype)


@fp8_linear_bwd.register_fake
def _(g, x, w, rowwise):
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    x, w, rowwise = inputs
    ctx.save_for_backward(x, w)
    ctx.rowwise = rowwise


def _backward(ctx, g):
    x, w = ctx.saved_tensors
    dx, dw = fp8_linear_bwd(g, x, w, ctx.rowwise)
    return dx, dw, None


# torch's compiled-graph cache does not key on the formula registered here: after changing _backward,
# compile into a fresh TORCHINDUCTOR_CACHE_DIR, or the old backward graph is silently reused.
fp8_linear.register_autograd(_backward, setup_context=_setup_context)


def linear(x: torch.Tensor, w: torch.Tensor, mode: str) -> torch.Tensor:
    """x W^T (nn.Linear without bias) in `mode`: one of FP8_MODES."""
    if mode == "none":
        return torch.nn.functional.linear(x, w)
    if torch.is_autocast_enabled(x.device.type):  # as autocast's linear: the output in its dtype (bf16)
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return fp8_linear(x, w, mode == "rowwise")


def check_mode(cfg, device: torch.device) -> None:
    """Refuse, at start-up, an FP8 mode the device cannot run, or one the fused Hopper operators would
    bypass (they have no FP8 variant: their products run in bf16)."""
    mode = cfg.fp8
    if mode not in FP8_MODES:
        raise ConfigError(f"model.fp8={mode!r} must be one of {', '.join(FP8_MODES)}")
    if mode == "none" or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ConfigError(
            f"model.fp8={mode} needs FP8 tensor cores (compute capability 8.9 or later); "
            f"{torch.cuda.get_device_name(device)} has none: use model.fp8=none"
        )
    fused = [key for key in ("fused_mlp", "fused_rope_norm", "fused_residual") if cfg[key]]
    if capability[0] == 9 and fused:
        raise ConfigError(
            f"model.fp8={mode} runs the linear layers through torch._scaled_mm, and on Hopper "
            f"{', '.join('model.' + k for k in fused)} would run them as bf16 fused products instead: "
            f"add {' '.join('model.' + k + '=false' for k in fused)}, or use model.fp8=none"
        )
