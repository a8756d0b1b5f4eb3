"""FP8 matrix products for the model's linear layers, through torch._scaled_mm (cuBLASLt on the GPU).

`linear(x, w, mode)` is x W^T with both operands cast to float8 e4m3 and scaled so that their largest
magnitude lands on e4m3's largest finite value (448), per tensor (`tensorwise`, as nanochat's `--fp8`) or
per row of each operand along the product's reduction (`rowwise`). The scales are computed on the device
(amax, divide): nothing waits for the host. The backward quantises the output gradient too: to e5m2
(range 57,344, two mantissa bits) for `tensorwise`; to e4m3 with row scales for `rowwise`, which cuBLAS
takes only in e4m3. Each operand is quantised along the axis its product reduces; the weights and the
optimiser states stay as they are. The quantisation is plain PyTorch, which torch.compile fuses into the
kernels that produce and read the operands. `ChunkedLinear` runs the same products chunk by chunk of
tokens, for the LM head's loss.

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


def _operands(x: torch.Tensor, w: torch.Tensor, mode: str) -> tuple[torch.Tensor, ...]:
    """What x W^T and its gradients read in `mode`, x first. `tensorwise`: x and W in e4m3 with their
    1 / s, one scale per tensor, which holds along either axis, so the backward reuses them. `rowwise`
    scales along the reduction of each product, which differs between the forward and the backward: x and
    W as they are, quantised in each product. `none`: x and W in x's dtype."""
    if mode == "tensorwise":
        return (*quantize(x, E4M3), *quantize(w, E4M3))
    return (x, w) if mode == "rowwise" else (x, w.to(x.dtype))


def _forward(operands: tuple[torch.Tensor, ...], out_dtype: torch.dtype, mode: str) -> torch.Tensor:
    """x W^T of `_operands`, in out_dtype."""
    if mode == "tensorwise":
        x8, x_inv, w8, w_inv = operands
        return torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=out_dtype)
    x, w = operands
    return _product(x, w, out_dtype, rowwise=True) if mode == "rowwise" else x @ w.t()


def _tensorwise_backward(
    g8, g_inv, operands: tuple[torch.Tensor, ...], dx_dtype: torch.dtype, w8_columns=None
):
    """(g W, g^T x) for g in e5m2 (g8, with its 1 / s) and tensorwise `_operands`: g W in dx_dtype, g^T x in
    float32. w8_columns: W8 already stored column-major, where the caller has it."""
    x8, x_inv, w8, w_inv = operands
    w8_columns = _column_major(w8) if w8_columns is None else w8_columns
    dx = torch._scaled_mm(g8, w8_columns, scale_a=g_inv, scale_b=w_inv, out_dtype=dx_dtype)
    dw = torch._scaled_mm(
        g8.t().contiguous(), _column_major(x8), scale_a=g_inv, scale_b=x_inv, out_dtype=torch.float32
    )
    return dx, dw


def _backward(g: torch.Tensor, operands: tuple[torch.Tensor, ...], mode: str):
    """(g W, g^T x) for the output gradient g of x W^T with `_operands`: g W in g's dtype, g^T x in float32
    (`tensorwise`), bf16 on CUDA (`rowwise`) or g's dtype (`none`)."""
    if mode == "tensorwise":
        return _tensorwise_backward(*quantize(g, E5M2), operands, g.dtype)
    x, w = operands
    if mode == "none":
        return g @ w, g.t() @ x
    # dx = g W reduces over the output features, so W enters as W^T [K, N], quantised along N.
    dx = _product(g, w.t(), g.dtype, rowwise=True, grad_dtype=E4M3)
    # dW = g^T x reduces over the tokens; both operands are quantised along them. cuBLAS gives row-scaled
    # products only in bf16.
    dw_dtype = torch.bfloat16 if g.is_cuda else torch.float32
    return dx, _product(g.t(), x.t(), dw_dtype, rowwise=True, grad_dtype=E4M3)


class _Linear(torch.autograd.Function):
    """x W^T in FP8, forward and backward. Plain PyTorch ops that torch.compile traces: inductor fuses each
    quantisation (amax, scale, cast, transposed copy) into the kernels around it. `tensorwise` saves the
    FP8 operands of the forward for the backward: the saved activation is half the bytes of bf16."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, mode: str) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ctx.mode, ctx.x_shape, ctx.w_dtype = mode, x.shape, w.dtype
        operands = _operands(x2, w, mode)
        ctx.save_for_backward(*operands)
        return _forward(operands, x.dtype, mode).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        dx, dw = _backward(g.reshape(-1, g.shape[-1]), ctx.saved_tensors, ctx.mode)
        return dx.view(ctx.x_shape), dw.to(ctx.w_dtype), None


@torch.library.custom_op("varlen_gpt::quantize_weight", mutates_args=())
def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W in e4m3 row-major, the same column-major, 1 / s) with one scale for W, as one step the compiler
    cannot look into. Quantised in plain PyTorch, W8 is a pointwise expression that inductor writes anew for
    every product that reads it: two for each loss chunk of the head (16 copies of [V, d] at 8 chunks)."""
    w8, w_inv = quantize(w, E4M3)
    return w8, _column_major(w8), w_inv


@quantize_weight.register_fake
def _(w):
    rows, cols = w.shape
    column_major = w.new_empty_strided((rows, cols), (1, rows), dtype=E4M3)
    return w.new_empty((rows, cols), dtype=E4M3), column_major, w.new_empty((), dtype=torch.float32)


class ChunkedLinear:
    """x W^T of x [T, K] and W [N, K] in `mode`, and its gradients, chunk by chunk of x's rows: the LM head's
    loss (model/gpt.py's ChunkedCrossEntropy), whose logits [T, N] never exist at once. Each chunk runs
    _Linear's products on its rows. x and W are quantised once for all chunks (`tensorwise`: one scale
    each, the whole buffer's, as _Linear's); each chunk's output gradient on its own, as it is all there is
    of the gradient at a time, or by its caller (backward's g_inv)."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, mode: str):
        self.dtype, self.mode, self.w8_columns = x.dtype, mode, None
        if mode == "tensorwise":
            w8, self.w8_columns, w_inv = quantize_weight(w)
            self.operands = (*quantize(x, E4M3), w8, w_inv)
        else:
            self.operands = _operands(x, w, mode)

    def chunk(self, rows: slice) -> tuple[torch.Tensor, ...]:
        x, *rest = self.operands
        return x[rows], *rest

    def forward(self, rows: slice) -> torch.Tensor:
        """x[rows] W^T in x's dtype."""
        return _forward(self.chunk(rows), self.dtype, self.mode)

    def backward(self, g: torch.Tensor, rows: slice, g_inv: torch.Tensor | None = None):
        """(g W, g^T x[rows]) for the gradient g of forward(rows), in the dtypes of _backward. With g_inv
        (`tensorwise`), g is already in e5m2 and g_inv its 1 / s: a gradient whose bound is known before it
        is computed can be written in FP8 by the pass that computes it."""
        if g_inv is not None:
            return _tensorwise_backward(g, g_inv, self.chunk(rows), self.dtype, self.w8_columns)
        if self.mode == "tensorwise":
            return _tensorwise_backward(*quantize(g, E5M2), self.chunk(rows), g.dtype, self.w8_columns)
        return _backward(g, self.chunk(rows), self.mode)


def linear(x: torch.Tensor, w: torch.Tensor, mode: str) -> torch.Tensor:
    """x W^T (nn.Linear without bias) in `mode`: one of FP8_MODES."""
    if mode == "none":
        return torch.nn.functional.linear(x, w)
    if torch.is_autocast_enabled(x.device.type):  # as autocast's linear: the output in its dtype (bf16)
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return _Linear.apply(x, w, mode)


def check_mode(cfg, device: torch.device, vocab_size: int) -> None:
    """Refuse, at start-up, an FP8 mode the device cannot run."""
    mode = cfg.fp8
    if mode not in FP8_MODES:
        raise ConfigError(f"model.fp8={mode!r} must be one of {', '.join(FP8_MODES)}")
    if mode == "none" or device.type != "cuda":
        return
    # cuBLASLt takes FP8 products whose dimensions are multiples of 16; the head's reduce over the
    # vocabulary and over a chunk's tokens (the buffer's token count is a multiple of data's block size).
    for key, value in (("data.vocab_size", vocab_size), ("model.loss_chunk_tokens", cfg.loss_chunk_tokens)):
        if value % 16:
            raise ConfigError(f"model.fp8={mode} needs {key}={value} to be a multiple of 16 on CUDA")
    if torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(
            f"model.fp8={mode} needs FP8 tensor cores (compute capability 8.9 or later); "
            f"{torch.cuda.get_device_name(device)} has none: use model.fp8=none"
        )
