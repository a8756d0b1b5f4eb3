"""Which matrix product runs where: the Gluon products of gemm_hopper.py and wgrad_hopper.py on Hopper
where they take the tensors, cuBLAS's otherwise; and the FP8 operators' row quantisation and products
(fp8_rows.py and gemm_hopper.py's FP8 products on Hopper, the same formulas in PyTorch elsewhere). The
Hopper modules are imported only for CUDA tensors, so the operators run their PyTorch formulas on the CPU
without them."""

import torch

from kernels.fused.numerics import E4M3, RMS_EPS, quantize


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


def fp8_rows(x: torch.Tensor, with_rstd: bool = False, x2: torch.Tensor | None = None):
    """(x8, row scale, 1/rms or None) of x's rows, or with x2 of [x | x2]'s: fp8_rows.py on the GPU, the
    same formula in PyTorch elsewhere."""
    if x.is_cuda:
        from kernels.fused.fp8_rows import quantize_rows

        return quantize_rows(x, E4M3, with_rstd, x2)
    if x2 is not None:
        x = torch.cat([x, x2], dim=1)
    x8, inv = quantize(x, E4M3, dim=-1)
    rstd = torch.rsqrt(x.float().square().mean(dim=-1) + RMS_EPS) if with_rstd else None
    return x8, inv[:, 0] * (1 if rstd is None else rstd), rstd


def fp8_weight(w: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(W, or with transposed W^T, in e4m3 and row-major; W's 1 / s): one scale holds for a tensor and its
    transpose. The operators take their weights so quantised, by the model's graph (forward) and their
    registered backward: there torch.compile fuses the quantisation into a reduction and a cast. Inside an
    operator it would run as eager PyTorch, about 150 us of host time a weight at d12's sizes (an H200),
    and d12's FP8 step is bound by host time."""
    w8, inv = quantize(w.detach().t() if transposed else w.detach(), E4M3)
    return w8.contiguous(), inv


def fp8_on_hopper(t: torch.Tensor) -> bool:
    """Whether FP8 products of t run as gemm_hopper.py's (a Hopper GPU), else as float32 math."""
    if not t.is_cuda:
        return False
    from kernels.common import capability

    return capability(t.device)[0] == 9


def fp8_product(a8, row_scale, b8, b_scale, epilogue: str, extra: torch.Tensor | None = None) -> torch.Tensor:
    """row_scale * b_scale * a8 b8^T through `epilogue` (relu2: relu()^2; relu2_grad: times 2 sqrt(extra);
    residual: plus extra; plain), in bf16: gemm_hopper.py's FP8 product on Hopper, float32 math elsewhere."""
    w_scale = b_scale.reshape(1)
    if fp8_on_hopper(a8):
        from kernels.fused import gemm_hopper as gh

        if epilogue == "relu2":
            return gh.relu2_matmul(a8, b8, row_scale, w_scale)
        if epilogue == "relu2_grad":
            return gh.relu2_grad_matmul(a8, b8, extra, row_scale, w_scale)
        return gh.scaled_matmul(a8, b8, row_scale, w_scale, extra)
    p = (a8.float() @ b8.float().t()) * row_scale[:, None] * w_scale
    if epilogue == "relu2":
        p = torch.relu(p).square()
    elif epilogue == "relu2_grad":
        p = p * (2 * extra.float().sqrt())
    elif epilogue == "residual":
        p = p + extra.float()
    return p.bfloat16()
