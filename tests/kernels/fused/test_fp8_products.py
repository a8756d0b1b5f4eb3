"""FP8 products of kernels/fused/gemm_hopper.py and the row quantisation that feeds them
(kernels/fused/fp8_rows.py): against float64 math on the dequantised operands. On the CPU the quantisation
kernel runs in Triton's interpreter for its scales and 1/rms (the interpreter's FP8 casts round wrongly at
a power of two, so the FP8 bits are checked on the GPU); the products need Hopper."""

import pytest
import torch

from kernels.fused import gemm_hopper
from kernels.fused.fp8_rows import quantize_rows
from kernels.fused.numerics import AMAX_FLOOR, E4M3, E5M2, RMS_EPS, quantize

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rows_of_many_sizes(T: int, C: int, device: str = DEVICE) -> torch.Tensor:
    """bf16 rows whose magnitudes span 1e-3 .. 1e3, and a row of zeros."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, C, device=device, generator=gen) * torch.logspace(-3, 3, T, device=device)[:, None]
    x[T // 2] = 0
    return x.bfloat16()


def reference_scales(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (dequantisation scale, 1/rms) of each row."""
    xd = x.double()
    amax = xd.abs().amax(dim=1).clamp_min(AMAX_FLOOR)
    return amax / torch.finfo(dtype).max, torch.rsqrt(xd.square().mean(dim=1) + RMS_EPS)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("C", [300, 1280])
def test_row_scales_and_rms(dtype, C):
    x = rows_of_many_sizes(33, C)
    _, scale, rstd = quantize_rows(x, dtype, rstd=True)
    want_scale, want_rstd = reference_scales(x, dtype)
    assert torch.allclose(rstd.double(), want_rstd, rtol=1e-6)
    assert torch.allclose(scale.double(), want_scale * want_rstd, rtol=1e-6)
    _, plain, none = quantize_rows(x, dtype)
    assert none is None and torch.allclose(plain.double(), want_scale, rtol=1e-6)


@pytest.mark.parametrize("widths", [(256, 128), (300, 45)])
def test_rows_of_two_tensors_are_the_rows_of_their_join(widths):
    x = rows_of_many_sizes(33, sum(widths))
    a, b = x[:, : widths[0]].contiguous(), x[:, widths[0] :].contiguous()
    got = quantize_rows(a, E4M3, x2=b)
    want = quantize_rows(x, E4M3)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got[1], want[1])
    assert torch.allclose(got[1].double(), reference_scales(x, E4M3)[0], rtol=1e-6)
    with pytest.raises(ValueError, match="x2"):
        quantize_rows(a, E4M3, x2=b[:-1].contiguous())


def test_fp8_and_16_bit_operands_do_not_mix():
    x, w = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(256, 64, dtype=E4M3)
    with pytest.raises(ValueError, match="FP8 products take FP8 operands"):
        gemm_hopper.relu2_matmul(x, w, torch.ones(128), torch.ones(1))
    with pytest.raises(ValueError, match="FP8 products take FP8 operands"):
        gemm_hopper.relu2_matmul(x.to(E4M3), w, torch.ones(128))


gpu = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantised_rows_are_torch_casts(dtype):
    x = rows_of_many_sizes(4096, 1280)
    x8, scale, _ = quantize_rows(x, dtype)
    top = torch.finfo(dtype).max
    # The quotients correctly rounded to float32 (by way of float64, which rounds them exactly enough):
    # torch's `top / t` is top * (1 / t), rounded twice, an ulp off at times, enough to move a cast.
    s = (top / x.double().abs().amax(dim=1).clamp_min(AMAX_FLOOR)).float()
    want = (x.float() * s[:, None]).clamp(-top, top).to(dtype)
    assert torch.equal(x8.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(scale, (1 / s.double()).float())


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def fp8_inputs(M=8192, C=1280, H=5120):
    """d20's MLP at 8,192 tokens: x and g (rows of their own sizes), W1 [H, C], W2 [C, H]."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(M, C, device="cuda", generator=gen) * 3).bfloat16()
    g = (torch.randn(M, C, device="cuda", generator=gen) * 1e-4).bfloat16()
    w1 = (torch.randn(H, C, device="cuda", generator=gen) * C**-0.5).bfloat16()
    w2 = (torch.randn(C, H, device="cuda", generator=gen) * H**-0.5).bfloat16()
    return x, g, w1, w2


def dequantised(x8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 x8 * scale: rows for a [rows] scale, the whole for one scale."""
    return x8.double() * (scale.double()[:, None] if scale.numel() > 1 else scale.double())


# FP8 products accumulate on Hopper's tensor cores with fewer bits than fp32 (triton's default for FP8, as
# cuBLAS's fast accumulation); the outputs are bf16.
TOLERANCE = 1e-2


@pytest.mark.gpu
@gpu
def test_relu2_product_from_fp8_rows():
    x, _, w1, _ = fp8_inputs()
    x8, row_scale, rstd = quantize_rows(x, E4M3, rstd=True)
    w8, w_scale = quantize(w1, E4M3)
    a = gemm_hopper.relu2_matmul(x8, w8, row_scale, w_scale.reshape(1))
    want = torch.relu(dequantised(x8, row_scale) @ dequantised(w8, w_scale).t()).square()
    assert a.dtype == torch.bfloat16 and rel_err(a, want) < TOLERANCE
    # What the products stand for: relu(rms_norm(x) W1^T)^2, within FP8's rounding of x and W1.
    exact = torch.relu((x.double() * rstd.double()[:, None]) @ w1.double().t()).square()
    assert rel_err(a, exact) < 0.1


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2])
def test_relu2_grad_product_from_fp8_rows(grad_dtype):
    x, g, w1, w2 = fp8_inputs()
    rstd = torch.rsqrt(x.float().square().mean(dim=1) + RMS_EPS)
    a = torch.relu((x.float() * rstd[:, None]) @ w1.float().t()).square().bfloat16()
    g8, g_scale, _ = quantize_rows(g, grad_dtype)
    w2t8, w_scale = quantize(w2.t().contiguous(), E4M3)
    dh = gemm_hopper.relu2_grad_matmul(g8, w2t8, a, g_scale * rstd, w_scale.reshape(1))
    da = dequantised(g8, g_scale) @ dequantised(w2t8, w_scale).t()
    want = da * 2 * a.double().sqrt() * rstd.double()[:, None]
    assert dh.dtype == torch.bfloat16 and rel_err(dh, want) < TOLERANCE


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("residual", [False, True])
def test_scaled_product(residual):
    x, _, w1, w2 = fp8_inputs()
    a = torch.relu(x.float() @ w1.float().t()).square().bfloat16()
    a8, a_scale, _ = quantize_rows(a, E4M3)
    w8, w_scale = quantize(w2, E4M3)
    r = x if residual else None
    out = gemm_hopper.scaled_matmul(a8, w8, a_scale, w_scale.reshape(1), r)
    want = dequantised(a8, a_scale) @ dequantised(w8, w_scale).t()
    if residual:
        want = want + x.double()
    assert out.dtype == torch.bfloat16 and rel_err(out, want) < TOLERANCE
