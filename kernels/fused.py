"""What the operators around kernels/gemm_hopper.py's products share. Plain PyTorch: the operators import
it on the CPU too, where they run their PyTorch formulas and Gluon need not be there."""

import torch

# RMSNorm's epsilon wherever the model normalises (model/gpt.py's rms_norm, the products' epilogues, the
# operators' formulas): float32's machine epsilon, whatever the dtype.
RMS_EPS = torch.finfo(torch.float32).eps


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the norms' and rotations' math: float32, or dtype where that is wider."""
    return torch.promote_types(dtype, torch.float32)


def on_hopper_product(*tensors: torch.Tensor) -> bool:
    """Whether kernels/gemm_hopper.py's product takes these tensors (`gemm_hopper.supported`), importing
    it only for CUDA tensors."""
    if not tensors[0].is_cuda:
        return False
    from kernels import gemm_hopper

    return gemm_hopper.supported(*tensors)


def weight_grad(g: torch.Tensor, x: torch.Tensor, g2: torch.Tensor | None = None) -> torch.Tensor:
    """g^T x summed over the tokens, or with g2 [g | g2]^T x: kernels/wgrad_hopper.py's stream-K product
    where it is `preferred` over cuBLAS, else cuBLAS's (one product per gradient)."""
    if g.is_cuda:
        from kernels import wgrad_hopper

        if wgrad_hopper.preferred(g, x, g2):
            return wgrad_hopper.weight_grad(g, x, g2=g2)
    if g2 is None:
        return g.t() @ x
    return torch.cat([g.t() @ x, g2.t() @ x])
