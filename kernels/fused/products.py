"""Which matrix product runs where: the Gluon products of gemm_hopper.py and wgrad_hopper.py on Hopper
where they take the tensors, cuBLAS's otherwise. The Hopper modules are imported only for CUDA tensors, so
the operators run their PyTorch formulas on the CPU without them."""

import torch


def on_hopper_product(*tensors: torch.Tensor) -> bool:
    """Whether gemm_hopper.py's product takes these tensors (`gemm_hopper.supported`)."""
    if not tensors[0].is_cuda:
        return False
    from kernels.fused import gemm_hopper

    return gemm_hopper.supported(*tensors)


def weight_grad(g: torch.Tensor, x: torch.Tensor, g2: torch.Tensor | None = None) -> torch.Tensor:
    """g^T x summed over the tokens, or with g2 [g | g2]^T x: wgrad_hopper.py's stream-K product where it
    is `preferred` over cuBLAS, else cuBLAS's (one product per gradient)."""
    if g.is_cuda:
        from kernels.fused import wgrad_hopper

        if wgrad_hopper.preferred(g, x, g2):
            return wgrad_hopper.weight_grad(g, x, g2=g2)
    if g2 is None:
        return g.t() @ x
    return torch.cat([g.t() @ x, g2.t() @ x])
