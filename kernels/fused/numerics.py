"""The numerics that the fused operators and the model share. Plain PyTorch: the model imports it on the
CPU too, where the operators run their PyTorch formulas and Gluon need not be there."""

import torch

# RMSNorm's epsilon wherever the model normalises (model/gpt.py's rms_norm, the products' epilogues, the
# operators' formulas): float32's machine epsilon, whatever the dtype.
RMS_EPS = torch.finfo(torch.float32).eps


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the norms' and rotations' math: float32, or dtype where that is wider."""
    return torch.promote_types(dtype, torch.float32)


# FP8 (model/fp8.py, the FP8 products of gemm_hopper.py): e4m3 for weights and activations, e5m2 (range
# 57,344, two mantissa bits) for gradients where wanted.
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# Below this amax a tensor counts as zero: its scale stays finite and its product is exactly zero.
AMAX_FLOOR = 1e-12


def scale(x: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> torch.Tensor:
    """float32 s with max |x * s| = dtype's largest finite value: one for the tensor, or one per slice along
    `dim` (keepdim)."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    amax = amax.float().clamp_min(AMAX_FLOOR)
    # A division of tensors, correctly rounded (`top / amax` would be top * (1 / amax), rounded twice).
    return torch.full_like(amax, torch.finfo(dtype).max) / amax


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
