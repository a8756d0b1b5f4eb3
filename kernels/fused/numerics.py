"""The numerics that the fused operators and the model share. Plain PyTorch: the model imports it on the
CPU too, where the operators run their PyTorch formulas and Gluon need not be there."""

import torch

# RMSNorm's epsilon wherever the model normalises (model/gpt.py's rms_norm, the products' epilogues, the
# operators' formulas): float32's machine epsilon, whatever the dtype.
RMS_EPS = torch.finfo(torch.float32).eps


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the norms' and rotations' math: float32, or dtype where that is wider."""
    return torch.promote_types(dtype, torch.float32)
