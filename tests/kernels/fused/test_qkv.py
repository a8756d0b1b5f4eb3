"""The q/k/v operator with RoPE and QK-norm (kernels/fused/qkv.py): its autograd against float64 autograd of
the model's own formula, its backward kernel, compile, and (on Hopper) the Gluon products: the forward's
epilogue and the backward's input gradient from two operands."""

import pytest
import torch

from kernels.fused.qkv import qkv_rope_norm, reference_grad, rope_norm_grad
from model.gpt import apply_rotary, rms_norm, rotary_tables

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def inputs(T, C, Nq, Nk, head_dim, dtype, device="cpu", seed=0):
    """x, wq, wk, wv (as many values as keys) and the rotary angles of T tokens at scattered positions (as
    packed documents have)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, C, device=device, generator=gen).to(dtype)
    wq, wk, wv = ((torch.randn(n, C, device=device, generator=gen) * C**-0.5).to(dtype) for n in (Nq, Nk, Nk))
    cos, sin = rotary_tables(2048, head_dim, 10000.0)
    pos = torch.randint(0, 2048, (T,), generator=torch.Generator().manual_seed(seed))
    wide = torch.promote_types(dtype, torch.float32)
    return x, wq, wk, wv, cos[pos].to(device, wide), sin[pos].to(device, wide)


def model_formula(x, wq, wk, wv, cos, sin):
    """The unfused model's queries and keys, rms_norm(apply_rotary(x w^T)) per head, and values x wv^T."""
    head_dim = 2 * cos.shape[1]
    rot = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    q, k = (rms_norm(apply_rotary((x @ w.t()).view(x.shape[0], -1, head_dim), *rot)) for w in (wq, wk))
    return q.flatten(1), k.flatten(1), x @ wv.t()


def values_and_grads(fn, x, wq, wk, wv, cos, sin, *grads):
    leaves = [t.detach().requires_grad_() for t in (x, wq, wk, wv)]
    outs = fn(*leaves, cos, sin)
    torch.autograd.backward(outs, grads)
    return [t.detach() for t in outs] + [t.grad for t in leaves]


def output_grads(T, Nq, Nk, dtype, device="cpu", seed=2):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(T, n, device=device, generator=gen).to(dtype) for n in (Nq, Nk, Nk)]


def rel_err(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


NAMES = ("q", "k", "v", "dx", "dwq", "dwk", "dwv")


def test_operator_matches_autograd_of_the_model_formula():
    """float64 on the CPU, with grouped keys (2 key heads for 6 query heads): values and gradients."""
    x, wq, wk, wv, cos, sin = inputs(37, 24, 96, 32, 16, torch.float64)
    grads = output_grads(37, 96, 32, torch.float64)
    got = values_and_grads(qkv_rope_norm, x, wq, wk, wv, cos, sin, *grads)
    want = values_and_grads(model_formula, x, wq, wk, wv, cos, sin, *grads)
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert rel_err(a, b) < 1e-12, name


def test_backward_kernel_matches_the_formula():
    """The Triton backward (the interpreter on CPU) against the formula in float64, over a ragged last block
    of rows and grouped keys; each head's gradient lands in its own columns of dh."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T, head_dim, Nq, Nk = 100, 32, 128, 32
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, dq, dk = (torch.randn(T, n, device=device, generator=gen) for n in (Nq, Nk, Nq, Nk))
    rstd = torch.rand(T, (Nq + Nk) // head_dim, device=device, generator=gen) + 0.5
    angles = torch.rand(T, head_dim // 2, device=device, generator=gen) * 6.3
    cos, sin = angles.cos(), angles.sin()
    got = rope_norm_grad(dq, dk, q, k, rstd, cos, sin)
    want = reference_grad(*(t.double() for t in (dq, dk, q, k, rstd, cos, sin)))
    assert got.shape == (T, Nq + Nk)
    assert rel_err(got, want) < 1e-6


def test_compiles_without_graph_break():
    from torch._dynamo.testing import CompileCounterWithBackend

    backend = CompileCounterWithBackend("inductor")
    fn = torch.compile(qkv_rope_norm, backend=backend, fullgraph=True, dynamic=False)
    x, wq, wk, wv, cos, sin = inputs(64, 32, 64, 32, 16, torch.float32)
    grads = output_grads(64, 64, 32, torch.float32)
    got = values_and_grads(fn, x, wq, wk, wv, cos, sin, *grads)
    want = values_and_grads(model_formula, *(t.double() for t in (x, wq, wk, wv, cos, sin, *grads)))
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert rel_err(a, b) < 1e-5, name
    assert backend.frame_count == 1


def test_rejects_partial_heads_and_mismatched_shapes():
    x, wq, wk, wv, cos, sin = inputs(8, 16, 32, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="not whole heads of 16"):
        qkv_rope_norm(x, wq, wk[:8], wv, cos, sin)
    with pytest.raises(ValueError, match="not whole heads of 16"):
        qkv_rope_norm(x, wq, wk, wv[:8], cos, sin)
    with pytest.raises(ValueError, match=r"expected \[T, C\], \[Nq, C\], \[Nk, C\], \[Nv, C\]"):
        qkv_rope_norm(x, wq, wk, wv, cos[:4], sin[:4])
    with pytest.raises(ValueError, match=r"expected \[T, C\], \[Nq, C\], \[Nk, C\], \[Nv, C\]"):
        qkv_rope_norm(x, wq, wk, wv[:, :8], cos, sin)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape",
    [
        (65536, 768, 768, 768, 128),  # d12
        (4096, 1280, 1280, 1280, 128),  # d20's width
        (1000, 128, 384, 128, 128),  # ragged rows; one key head, so the keys' tile is half outside
        (1, 768, 768, 256, 128),  # one token (sampling)
        (300, 64, 256, 64, 64),  # a single step of K; heads of 64
    ],
)
def test_gluon_product_matches_float64(shape, dtype):
    """The fused product alone against float64 from the same inputs, with its output rounded to 16 bits
    before the rotation as the kernel rounds it."""
    from kernels.fused.gemm_hopper import rope_norm_matmul

    T, C, Nq, Nk, head_dim = shape
    x, wq, wk, _, cos, sin = inputs(T, C, Nq, Nk, head_dim, dtype, "cuda")
    q, k, rstd = rope_norm_matmul(x, wq, wk, cos, sin, head_dim)
    refs, ref_rstd = [], []
    for w in (wq, wk):
        h = (x.double() @ w.double().t()).to(dtype).double().view(T, -1, head_dim)
        h1, h2 = h.chunk(2, dim=-1)
        c, s = cos.double()[:, None], sin.double()[:, None]
        u = torch.cat([h1 * c - h2 * s, h1 * s + h2 * c], dim=-1)
        r = torch.rsqrt(u.square().mean(dim=-1) + torch.finfo(torch.float32).eps)
        refs.append((u * r[..., None]).flatten(1))
        ref_rstd.append(r)
    assert q.dtype == k.dtype == dtype and rstd.shape == (T, (Nq + Nk) // head_dim)
    assert rel_err(q, refs[0]) < 4e-3 and rel_err(k, refs[1]) < 4e-3  # the rounding to 16 bits
    assert rel_err(rstd, torch.cat(ref_rstd, dim=1)) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize(
    "C, Nq, Nk",
    [
        (768, 768, 256),  # grouped keys
        (1280, 1280, 1280),  # d20
        (640, 640, 128),  # C not in whole tiles of 256: the weight gradients are cuBLAS's two products
    ],
)
def test_operator_on_hopper_matches_float64_autograd(C, Nq, Nk):
    """The whole operator at a 65,536-token buffer in bf16, forward and backward, against float64 autograd
    of the model's formula."""
    from kernels.fused import wgrad_hopper

    T = 65536
    x, wq, wk, wv, cos, sin = inputs(T, C, Nq, Nk, 128, torch.bfloat16, "cuda")
    grads = output_grads(T, Nq, Nk, torch.bfloat16, "cuda")
    dh, dv = (torch.empty(T, n, device="cuda", dtype=torch.bfloat16) for n in (Nq + Nk, Nk))
    assert wgrad_hopper.preferred(dh, x, dv) == (C != 640)
    got = values_and_grads(qkv_rope_norm, x, wq, wk, wv, cos, sin, *grads)
    want = values_and_grads(model_formula, *(t.double() for t in (x, wq, wk, wv, cos, sin, *grads)))
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert rel_err(a, b) < 1e-2, name


def test_joined_product_rejects_a_split_inside_a_k_step():
    from kernels.fused.gemm_hopper import BK, joined_matmul

    a1, a2, b = torch.zeros(8, BK + 8), torch.zeros(8, 8), torch.zeros(BK + 16, 16)
    with pytest.raises(ValueError, match=f"K1 a multiple of {BK}"):
        joined_matmul(a1, a2, b)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "M, K1, K2, N",
    [
        (65536, 2560, 1280, 1280),  # d20's input gradient
        (65536, 1536, 768, 768),  # d12's
        (1000, 128, 72, 136),  # ragged rows, a ragged last step of K, N not in whole tiles
        (1, 256, 128, 768),  # one token
    ],
)
def test_joined_product_matches_float64(M, K1, K2, N, dtype):
    """[a1 | a2] b from two operands against float64 of the joined product."""
    from kernels.fused.gemm_hopper import joined_matmul

    gen = torch.Generator(device="cuda").manual_seed(3)
    a1, a2 = (torch.randn(M, k, device="cuda", generator=gen).to(dtype) for k in (K1, K2))
    b = (torch.randn(K1 + K2, N, device="cuda", generator=gen) * (K1 + K2) ** -0.5).to(dtype)
    got = joined_matmul(a1, a2, b)
    want = torch.cat([a1, a2], dim=1).double() @ b.double()
    assert got.shape == (M, N) and got.dtype == dtype
    assert rel_err(got, want) < 4e-3  # the rounding to 16 bits
