"""The fused soft-capped cross-entropy kernel (kernels/fused/cross_entropy.py) against float64 autograd.

Without CUDA it runs in Triton's interpreter; the kernel has no tl.dot, so bf16 works there too. The
GPU build of the same kernel is checked at training sizes by the gpu-marked test at the end.
"""

import pytest
import torch

from kernels.fused.cross_entropy import softcap_cross_entropy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative error of the losses and of the gradient (L2) against float64: the inputs are rounded to the
# dtype first, so this is the kernel's own error plus the rounding of the gradient it writes.
# On the GPU tanh is PTX's tanh.approx (see the kernel's docstring), which shows in fp32.
TOL = {torch.float32: 1e-5 if DEVICE == "cpu" else 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def reference(logits, targets, scale: float, cap: float):
    """Per-row losses and d(scale * sum(losses)) / d(logits) in float64, by autograd."""
    z = logits.double().detach().requires_grad_()
    c = cap * torch.tanh(z / cap) if cap > 0 else z
    valid = targets >= 0
    picked = c.gather(1, targets.clamp_min(0)[:, None])[:, 0]
    losses = torch.where(valid, torch.logsumexp(c, 1) - picked, 0.0)
    (scale * losses.sum()).backward()
    return losses.detach(), z.grad


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("n", "V", "cap", "spread"),
    [
        (33, 97, 15.0, 4.0),
        (16, 256, 15.0, 60.0),
        (20, 300, 0.0, 30.0),
        (8, 1000, 30.0, 10.0),
        (9, 5000, 100.0, 80.0),
        (6, 4096, 15.0, 8.0),  # whole blocks of the row: no masks
    ],
)
def test_losses_and_gradient_match_float64(dtype, n, V, cap, spread):
    gen = torch.Generator().manual_seed(V)
    logits = (torch.randn(n, V, generator=gen) * spread).to(dtype)
    targets = torch.randint(0, V, (n,), generator=gen)
    targets[::3] = -1
    targets[1] = V - 1  # the last column, next to the padding of the row's block
    scale = 1.0 / 7
    losses, grad = softcap_cross_entropy(
        logits.to(DEVICE), targets.to(DEVICE), torch.tensor(scale, device=DEVICE), cap, dtype
    )
    ref_losses, ref_grad = reference(logits, targets, scale, cap)
    assert losses.dtype == torch.float32 and grad.dtype == dtype and grad.shape == logits.shape
    assert rel_err(losses.cpu(), ref_losses) < TOL[torch.float32]
    assert rel_err(grad.cpu(), ref_grad) < TOL[dtype]
    assert (losses.cpu()[targets < 0] == 0).all() and (grad.cpu()[targets < 0] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the interpreter's FP8 casts round wrongly)"
)
@pytest.mark.parametrize(("cap", "spread"), [(15.0, 4.0), (0.0, 30.0)])
def test_gradient_in_e5m2_is_the_float32_gradient_rounded_once(cap, spread):
    """grad_dtype e5m2 with scale = its largest value: every element of the gradient lies within 1 (a
    softmax minus a one-hot, through tanh' <= 1), so the scaled gradient fits the format, and each element
    is the float32 gradient rounded to e5m2 once. The reference rounds the float64 gradient with torch's
    cast; the kernel's float32 math (tanh.approx on the GPU) may move an element across a rounding
    boundary, by one grid step."""
    e5m2 = torch.float8_e5m2
    top = torch.finfo(e5m2).max
    gen = torch.Generator().manual_seed(3)
    n, V = 24, 300
    logits = torch.randn(n, V, generator=gen) * spread
    targets = torch.randint(0, V, (n,), generator=gen)
    targets[::5] = -1
    losses, grad = softcap_cross_entropy(
        logits.cuda(), targets.cuda(), torch.tensor(top, device="cuda"), cap, e5m2
    )
    ref_losses, ref_grad = reference(logits, targets, top, cap)
    assert grad.dtype == e5m2 and rel_err(losses.cpu(), ref_losses) < TOL[torch.float32]
    got, want = grad.cpu().double(), ref_grad.float().to(e5m2).double()
    assert got.isfinite().all() and got.abs().max() <= top
    # One e5m2 step (2 mantissa bits) at each element's magnitude.
    step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0**-16))) - 2)
    assert ((got - want).abs() <= step).all()
    assert (got == want).double().mean() > 0.98
    # The rounding is e5m2's, not a finer format's: it moves the gradient by percents.
    assert rel_err(got, ref_grad) > 1e-2 and (got[targets < 0] == 0).all()


@pytest.mark.parametrize("layout", ["rows 128 apart", "columns 2 apart"])
def test_strided_logits_and_empty_input(layout):
    logits = torch.randn(12, 2, 64)[:, 0] if layout == "rows 128 apart" else torch.randn(12, 64, 2)[..., 0]
    targets = torch.randint(0, 64, (12,))
    losses, grad = softcap_cross_entropy(
        logits.to(DEVICE), targets.to(DEVICE), torch.tensor(1.0, device=DEVICE), 15.0, logits.dtype
    )
    ref_losses, ref_grad = reference(logits, targets, 1.0, 15.0)
    assert rel_err(losses.cpu(), ref_losses) < TOL[torch.float32]
    assert rel_err(grad.cpu(), ref_grad) < TOL[torch.float32]
    losses, grad = softcap_cross_entropy(
        torch.empty(0, 64, device=DEVICE),
        torch.empty(0, dtype=torch.long, device=DEVICE),
        torch.tensor(1.0, device=DEVICE),
        15.0,
        torch.float32,
    )
    assert losses.shape == (0,) and grad.shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_cross_entropy_at_training_size():
    """One loss chunk of a d12 step: 8,192 tokens x 32,768 bf16 logits, against float64."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, V = 8192, 32768
    logits = (torch.randn(n, V, device="cuda", generator=gen) * 4).bfloat16()
    targets = torch.randint(0, V, (n,), device="cuda", generator=gen)
    targets[::7] = -1
    scale = 1.0 / (targets >= 0).sum().double()
    losses, grad = softcap_cross_entropy(logits, targets, scale.float(), 15.0, logits.dtype)
    z = logits.double().requires_grad_()
    c = 15.0 * torch.tanh(z / 15.0)
    picked = c.gather(1, targets.clamp_min(0)[:, None])[:, 0]
    ref_losses = torch.where(targets >= 0, torch.logsumexp(c, 1) - picked, 0.0)
    (scale * ref_losses.sum()).backward()
    assert rel_err(losses, ref_losses) < 1e-5
    assert rel_err(grad, z.grad) < 1e-2  # bf16 rounding of the written gradient
