"""The pre-norm ReLU^2 MLP operator with its residual (kernels/fused/mlp.py): its autograd against float64
autograd of the plain formula (F.rms_norm, then the products, plus x), through torch.compile, its 1/rms kernel
in Triton's interpreter, and (on Hopper) its Gluon products at training sizes."""

import pytest
import torch
import torch.nn.functional as F

from kernels.fused.mlp import relu2_mlp, rstd_kernel
from kernels.fused.numerics import RMS_EPS

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def plain_mlp(x, w1, w2):
    return x + F.relu(F.rms_norm(x, (x.shape[1],), eps=RMS_EPS) @ w1.t()).square() @ w2.t()


def inputs(T, C, H, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, C, device=device, generator=gen).to(dtype)
    w1 = (torch.randn(H, C, device=device, generator=gen) * C**-0.5).to(dtype)
    w2 = (torch.randn(C, H, device=device, generator=gen) * H**-0.5).to(dtype)
    return x, w1, w2


def value_and_grads(fn, x, w1, w2, dout):
    leaves = [t.detach().requires_grad_() for t in (x, w1, w2)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def test_operator_matches_autograd_of_the_formula():
    """float64 on the CPU: the operator's backward (with sqrt(a) for relu(h), the norm's rows scaled into the
    products) equals autograd's."""
    x, w1, w2 = inputs(37, 24, 96, torch.float64)
    dout = torch.randn(37, 24, dtype=torch.float64)
    got = value_and_grads(relu2_mlp, x, w1, w2, dout)
    want = value_and_grads(plain_mlp, x, w1, w2, dout)
    for name, a, b in zip(("out", "dx", "dw1", "dw2"), got, want, strict=True):
        assert rel_err(a, b) < 1e-12, name


def test_weights_take_the_input_dtype_and_keep_their_own_gradient_dtype():
    """As under autocast: float32 weights with a float64 input run in float64, and their gradients come
    back in float32."""
    x, w1, w2 = inputs(16, 8, 32, torch.float64)
    w1, w2 = w1.float(), w2.float()
    out, dx, dw1, dw2 = value_and_grads(relu2_mlp, x, w1, w2, torch.ones(16, 8, dtype=torch.float64))
    assert out.dtype == dx.dtype == torch.float64 and dw1.dtype == dw2.dtype == torch.float32
    want = value_and_grads(plain_mlp, x, w1.double(), w2.double(), torch.ones(16, 8, dtype=torch.float64))
    assert rel_err(dw1, want[2]) < 1e-6 and rel_err(dw2, want[3]) < 1e-6


def test_compiles_without_graph_break():
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = CompileCounterWithBackend("inductor")
    fn = torch.compile(relu2_mlp, backend=backend, fullgraph=True, dynamic=False)
    x, w1, w2 = inputs(64, 16, 64, torch.float32)
    dout = torch.randn(64, 16)
    got = value_and_grads(fn, x, w1, w2, dout)
    want = value_and_grads(plain_mlp, x.double(), w1.double(), w2.double(), dout.double())
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-5
    assert backend.frame_count == 1


@pytest.mark.parametrize("T, C", [(37, 24), (5, 1300), (16, 512)])
def test_rstd_kernel_matches_float64(T, C):
    """The Triton 1/rms kernel (interpreter on CPU): rows that are not a whole number of programs, and widths
    below, above and at its column block."""
    x = torch.randn(T, C, dtype=torch.float16) * 3
    want = torch.rsqrt(x.double().square().mean(dim=-1) + RMS_EPS)
    got = rstd_kernel(x)
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-6


def test_rejects_mismatched_shapes():
    x, w1, w2 = inputs(8, 16, 64, torch.float32)
    with pytest.raises(ValueError, match=r"expected \[T, C\], \[H, C\], \[C, H\]"):
        relu2_mlp(x, w1, w2.t())


def test_product_rejects_a_residual_of_another_shape():
    from kernels.fused.gemm_hopper import matmul

    a, b = torch.zeros(8, 64), torch.zeros(64, 16)
    with pytest.raises(ValueError, match=r"r \(8, 17\): expected \[8, 16\]"):
        matmul(a, b, torch.zeros(8, 17))


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape", [(65536, 768, 3072), (4096, 1280, 5120), (1000, 128, 200), (1, 768, 3072), (7, 64, 256)]
)
def test_gluon_products_match_float64(shape, dtype):
    """The two fused products alone, with and without their rows scaled, and the plain products of their
    outputs, against float64 from the same 16-bit inputs: a d12 buffer, a d20 width, sizes that are not
    multiples of the tile (the TMA copies clip the edges), one token (sampling) and a single step of K."""
    from kernels.fused.gemm_hopper import matmul, relu2_grad_matmul, relu2_matmul

    T, C, H = shape
    x, w1, w2 = inputs(T, C, H, dtype, "cuda")
    g = torch.randn(T, C, device="cuda", dtype=dtype)
    for rstd in (None, torch.rand(T, device="cuda") + 0.5):
        scale = 1.0 if rstd is None else rstd.double()[:, None]
        a = relu2_matmul(x, w1, rstd)
        ref_a = F.relu((x.double() @ w1.double().t()) * scale).square()
        assert a.dtype == dtype and rel_err(a, ref_a) < 4e-3  # the rounding of a to 16 bits
        dh = relu2_grad_matmul(g, w2.t().contiguous(), a, rstd)
        ref_dh = (g.double() @ w2.double()) * 2 * a.double().sqrt() * scale
        assert rel_err(dh, ref_dh) < 4e-3
        assert (dh[a == 0] == 0).all()  # where relu(h) = 0, so is the gradient
        # The products over the hidden width that follow them, with the weight as stored ([K, N]): the
        # residual's x added in the epilogue, and plain.
        out = matmul(a, w2.t().contiguous(), x)
        ref_out = x.double() + a.double() @ w2.double().t()
        assert out.dtype == dtype and rel_err(out, ref_out) < 4e-3
        u = matmul(dh, w1)
        assert rel_err(u, dh.double() @ w1.double()) < 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("C, stream_k", [(768, False), (1280, True)])
def test_operator_on_hopper_matches_float64_autograd(C, stream_k):
    """The whole operator at a d12 and a d20 buffer in bf16, forward and backward, against float64 autograd;
    d20's weight gradients take kernels/fused/wgrad_hopper.py."""
    from kernels.fused import wgrad_hopper

    x, w1, w2 = inputs(65536, C, 4 * C, torch.bfloat16, "cuda")
    dout = torch.randn(65536, C, device="cuda", dtype=torch.bfloat16)
    assert wgrad_hopper.preferred(x.new_empty(65536, 4 * C), x) == stream_k
    got = value_and_grads(relu2_mlp, x, w1, w2, dout)
    want = value_and_grads(plain_mlp, x.double(), w1.double(), w2.double(), dout.double())
    for name, a, b in zip(("out", "dx", "dw1", "dw2"), got, want, strict=True):
        assert rel_err(a, b) < 1e-2, name
