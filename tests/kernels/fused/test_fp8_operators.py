"""The FP8 operators (kernels/fused: mlp.py's relu2_mlp_fp8, residual.py's residual_linear_fp8): outputs and
gradients against a float64 statement of their recipe (each left operand quantised per row, each weight
per tensor, the MLP's a and dh rounded to bf16 before they are quantised), on the CPU (their PyTorch
formulas) and on Hopper (the Gluon FP8 products); and against the float64 operation itself, within FP8's
rounding."""

import pytest
import torch
import torch.nn.functional as F

from kernels.fused.mlp import relu2_mlp_fp8
from kernels.fused.numerics import E4M3, RMS_EPS, quantize
from kernels.fused.qkv import qkv_rope_norm_fp8
from kernels.fused.residual import residual_linear_fp8

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
# Each check runs on the CPU (the operators' PyTorch formulas, small sizes) and, marked, on Hopper (the Gluon
# FP8 products, at d20's widths).
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")]
    ),
]
MLP_SIZES = {"cpu": (96, 64, 256, 1e-2), "cuda": (4096, 1280, 5120, 2e-2)}
RESIDUAL_SIZES = {"cpu": (96, 64, 128, 1e-2), "cuda": (4096, 1280, 1280, 2e-2)}
QKV_SIZES = {"cpu": (96, 128, 2, 1e-2), "cuda": (4096, 1280, 10, 2e-2)}


def inputs(T, C, H, device):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, C, device=device, generator=gen) * torch.rand(T, 1, device=device, generator=gen) * 4
    w1 = torch.randn(H, C, device=device, generator=gen) * C**-0.5
    w2 = torch.randn(C, H, device=device, generator=gen) * H**-0.5
    g = torch.randn(T, C, device=device, generator=gen) * 1e-3
    return x.bfloat16(), w1, w2, g.bfloat16()


def rows(t: torch.Tensor) -> torch.Tensor:
    """t quantised per row to e4m3 and back, in float64."""
    t8, inv = quantize(t, E4M3, dim=-1)
    return t8.double() * inv.double()


def whole(w: torch.Tensor) -> torch.Tensor:
    """w quantised per tensor to e4m3 as it is stored (float32: one rounding) and back, in float64."""
    w8, inv = quantize(w, E4M3)
    return w8.double() * inv.double()


def recipe(x, w1, w2, g):
    """(out, dx, dW1, dW2) of the FP8 recipe in float64, the norm's backward by autograd."""
    xd = x.double().requires_grad_()
    rstd = torch.rsqrt(xd.detach().square().mean(dim=1) + RMS_EPS)
    w1q, w2q = whole(w1), whole(w2)
    a = (torch.relu((rows(x) @ w1q.t()) * rstd[:, None]).square()).bfloat16()
    out = x.double() + rows(a) @ w2q.t()
    dh = ((rows(g) @ w2q) * 2 * a.double().sqrt() * rstd[:, None]).bfloat16()
    u = rows(dh) @ w1q  # rstd times the normalised input's gradient
    normed = F.rms_norm(xd, (x.shape[1],), eps=RMS_EPS)
    (normed * (u / rstd[:, None])).sum().backward()
    dx = g.double() + xd.grad
    return out, dx, dh.double().t() @ x.double(), g.double().t() @ a.double()


def run(op, g, *tensors):
    """[out, grads of tensors] of op(*tensors) with out's gradient g."""
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = op(*leaves)
    out.backward(g)
    return [out.detach()] + [t.grad for t in leaves]


def compiled(op):
    """op compiled as the model compiles (fullgraph, static shapes), with a counter of the frames compiled."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("inductor")
    return torch.compile(op, backend=backend, fullgraph=True, dynamic=False), backend


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def check(device, T, C, H, tolerance, op=relu2_mlp_fp8):
    x, w1, w2, g = inputs(T, C, H, device)
    got = run(op, g, x, w1, w2)
    want = recipe(x, w1, w2, g)
    for name, a, b in zip(("out", "dx", "dW1", "dW2"), got, want, strict=True):
        assert rel_err(a, b) < tolerance, (name, rel_err(a, b))
    # The MLP itself in float64: FP8's rounding of every operand, nothing worse.
    leaves = [t.double().requires_grad_() for t in (x, w1, w2)]
    exact = (
        leaves[0] + F.relu(F.rms_norm(leaves[0], (C,), eps=RMS_EPS) @ leaves[1].t()).square() @ leaves[2].t()
    )
    exact.backward(g.double())
    for name, a, b in zip(("out", "dx", "dW1", "dW2"), got, [exact, *(t.grad for t in leaves)], strict=True):
        assert rel_err(a, b) < 0.1, (name, rel_err(a, b))


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_recipe(device):
    check(device, *MLP_SIZES[device])


def assert_recipe(names, got, recipe_, exact, tolerance):
    """Each output within tolerance of the recipe's float64 value, and within FP8's rounding of the exact."""
    for name, a, b, c in zip(names, got, recipe_, exact, strict=True):
        assert rel_err(a, b) < tolerance, (name, rel_err(a, b))
        assert rel_err(a, c) < 0.1, (name, rel_err(a, c))


def check_residual(device, T, C, K, tolerance, op=residual_linear_fp8):
    gen = torch.Generator(device=device).manual_seed(0)
    r = torch.randn(T, C, device=device, generator=gen).bfloat16()
    y = (
        torch.randn(T, K, device=device, generator=gen) * torch.rand(T, 1, device=device, generator=gen)
    ).bfloat16()
    w = torch.randn(C, K, device=device, generator=gen) * K**-0.5
    g = (torch.randn(T, C, device=device, generator=gen) * 1e-3).bfloat16()
    got = run(op, g, r, y, w)
    wq = whole(w)
    recipe_ = [r.double() + rows(y) @ wq.t(), g.double(), rows(g) @ wq, g.double().t() @ y.double()]
    exact = [
        r.double() + y.double() @ w.double().t(),
        g.double(),
        g.double() @ w.double(),
        g.double().t() @ y.double(),
    ]
    assert_recipe(("out", "dr", "dy", "dW"), got, recipe_, exact, tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_residual_recipe(device):
    check_residual(device, *RESIDUAL_SIZES[device])


def qkv_inputs(T, C, heads, head_dim, device):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, C, device=device, generator=gen) * torch.rand(T, 1, device=device, generator=gen) * 4
    wq, wk, wv = (torch.randn(heads * head_dim, C, device=device, generator=gen) * C**-0.5 for _ in range(3))
    angles = (
        torch.rand(T, 1, device=device, generator=gen)
        * 100
        * torch.logspace(0, -3, head_dim // 2, device=device)
    )
    grads = [torch.randn(T, heads * head_dim, device=device, generator=gen) * 1e-3 for _ in range(3)]
    return x.bfloat16(), wq, wk, wv, angles.cos(), angles.sin(), [g.bfloat16() for g in grads]


def rope_then_norm(h, cos, sin, head_dim):
    """rms_norm(rope(h)) per head of h [T, N], in h's dtype (float64 here)."""
    u = h.view(h.shape[0], -1, head_dim)
    u1, u2 = u[..., : head_dim // 2], u[..., head_dim // 2 :]
    c, s = cos[:, None].double(), sin[:, None].double()
    u = torch.cat([u1 * c - u2 * s, u1 * s + u2 * c], dim=-1)
    return (u * torch.rsqrt(u.square().mean(dim=-1, keepdim=True) + RMS_EPS)).flatten(1)


def qkv_float64(x, wq, wk, wv, cos, sin, grads, quantised):
    """(q, k, v, dx, dW of the stack) in float64: of the FP8 recipe (x's rows and the stacked weights
    quantised, the gradient's input product over the rows of [dh | dv] quantised, dh in bf16), or of the
    exact math."""
    head_dim = 2 * cos.shape[1]
    stack = torch.cat([wq, wk, wv])
    xq, wsq = (rows(x), whole(stack)) if quantised else (x.double(), stack.double())
    nq, nk = wq.shape[0], wk.shape[0]
    h = (xq @ wsq[: nq + nk].t()).requires_grad_()
    q, k = rope_then_norm(h[:, :nq], cos, sin, head_dim), rope_then_norm(h[:, nq:], cos, sin, head_dim)
    v = xq @ wsq[nq + nk :].t()
    torch.autograd.backward([q, k], [grads[0].double(), grads[1].double()])
    joined = torch.cat([h.grad, grads[2].double()], dim=1)
    # The operator writes dh in bf16 before it quantises the rows.
    dx = (rows(torch.cat([h.grad.bfloat16(), grads[2]], dim=1)) if quantised else joined) @ wsq
    return q.detach(), k.detach(), v, dx, joined.t() @ x.double()


def check_qkv(device, T, C, heads, tolerance, op=qkv_rope_norm_fp8):
    head_dim = 64 if device == "cpu" else 128
    x, wq, wk, wv, cos, sin, grads = qkv_inputs(T, C, heads, head_dim, device)
    leaves = [t.detach().requires_grad_() for t in (x, wq, wk, wv)]
    q, k, v = op(*leaves, cos, sin)
    torch.autograd.backward([q, k, v], grads)
    dw = torch.cat([t.grad for t in leaves[1:]])
    got = [q.detach(), k.detach(), v.detach(), leaves[0].grad, dw]
    recipe_ = qkv_float64(x, wq, wk, wv, cos, sin, grads, quantised=True)
    exact = qkv_float64(x, wq, wk, wv, cos, sin, grads, quantised=False)
    assert_recipe(("q", "k", "v", "dx", "dW"), got, recipe_, exact, tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_qkv_recipe(device):
    check_qkv(device, *QKV_SIZES[device])


# Compiled as the model compiles them: one frame each, the quantisation and products inside opaque operators
# (a Triton launch traced by the compiler fails on fake tensors), the same recipe as eager.
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_operators_keep_the_recipe(device):
    fn, backend = compiled(relu2_mlp_fp8)
    check(device, *MLP_SIZES[device], op=fn)
    assert backend.frame_count == 1
    fn, backend = compiled(residual_linear_fp8)
    check_residual(device, *RESIDUAL_SIZES[device], op=fn)
    assert backend.frame_count == 1
    fn, backend = compiled(qkv_rope_norm_fp8)
    check_qkv(device, *QKV_SIZES[device], op=fn)
    assert backend.frame_count == 1
