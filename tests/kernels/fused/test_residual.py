"""The residual projection operator (kernels/fused/residual.py): its autograd against float64 autograd of
r + y W^T, through torch.compile, and (on Hopper) its Gluon product against float64."""

import pytest
import torch

from kernels.fused.residual import residual_linear

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def inputs(T, N, K, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    r = torch.randn(T, N, device=device, generator=gen).to(dtype)
    y = torch.randn(T, K, device=device, generator=gen).to(dtype)
    w = (torch.randn(N, K, device=device, generator=gen) * K**-0.5).to(dtype)
    return r, y, w


def value_and_grads(fn, r, y, w, dout):
    leaves = [t.detach().requires_grad_() for t in (r, y, w)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def plain(r, y, w):
    return r + y @ w.t()


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def test_operator_matches_autograd_of_the_formula():
    r, y, w = inputs(37, 24, 40, torch.float64)
    dout = torch.randn(37, 24, dtype=torch.float64)
    got = value_and_grads(residual_linear, r, y, w, dout)
    want = value_and_grads(plain, r, y, w, dout)
    for name, a, b in zip(("out", "dr", "dy", "dw"), got, want, strict=True):
        assert rel_err(a, b) < 1e-12, name


def test_weight_takes_the_stream_dtype_and_keeps_its_gradient_dtype():
    """As under autocast: a float32 weight with a float64 stream runs in float64; its gradient is float32."""
    r, y, w = inputs(16, 8, 12, torch.float64)
    out, _, _, dw = value_and_grads(residual_linear, r, y, w.float(), torch.ones(16, 8, dtype=torch.float64))
    assert out.dtype == torch.float64 and dw.dtype == torch.float32
    want = value_and_grads(plain, r, y, w, torch.ones(16, 8, dtype=torch.float64))
    assert rel_err(dw, want[3]) < 1e-6


def test_compiles_without_graph_break():
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = CompileCounterWithBackend("inductor")
    fn = torch.compile(residual_linear, backend=backend, fullgraph=True, dynamic=False)
    r, y, w = inputs(64, 16, 32, torch.float32)
    dout = torch.randn(64, 16)
    got = value_and_grads(fn, r, y, w, dout)
    want = value_and_grads(plain, r.double(), y.double(), w.double(), dout.double())
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-5
    assert backend.frame_count == 1


def test_rejects_mismatched_shapes():
    r, y, w = inputs(8, 16, 32, torch.float32)
    with pytest.raises(ValueError, match=r"expected \[T, N\], \[T, K\], \[N, K\]"):
        residual_linear(r, y, w.t())


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(65536, 1280, 1280), (65536, 768, 768), (1000, 136, 200), (1, 768, 768)])
def test_gluon_product_matches_float64(shape, dtype):
    """The fused product alone against float64 from the same 16-bit inputs: d20 and d12 buffers, sizes
    that are not multiples of the tile, and one token."""
    from kernels.fused.gemm_hopper import residual_matmul

    T, N, K = shape
    r, y, w = inputs(T, N, K, dtype, "cuda")
    got = residual_matmul(r, y, w)
    want = plain(r.double(), y.double(), w.double())
    assert got.dtype == dtype and rel_err(got, want) < 4e-3  # the rounding of the sum to 16 bits


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
def test_operator_on_hopper_matches_float64_autograd():
    r, y, w = inputs(65536, 1280, 1280, torch.bfloat16, "cuda")
    dout = torch.randn(65536, 1280, device="cuda", dtype=torch.bfloat16)
    got = value_and_grads(residual_linear, r, y, w, dout)
    want = value_and_grads(plain, r.double(), y.double(), w.double(), dout.double())
    for name, a, b in zip(("out", "dr", "dy", "dw"), got, want, strict=True):
        assert rel_err(a, b) < 1e-2, name
