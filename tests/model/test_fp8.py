"""FP8 linear layers and the LM head's FP8 loss (model/fp8.py) against float64 math: the scales, saturation,
zeros and non-finite inputs, and the products, forward and backward, against an independent float64
rounding to the FP8 grids."""

import math

import pytest
import torch
import torch.nn.functional as F

from configs.schema import ConfigError, ModelConfig
from kernels.fused.numerics import E4M3, E5M2, cast, quantize, scale
from model.fp8 import check_mode, linear
from model.gpt import GPT, ChunkedCrossEntropy, softcap

# (mantissa bits, smallest normal exponent, largest finite value) of each format.
FORMATS = {E4M3: (3, -6, 448.0), E5M2: (2, -14, 57344.0)}


def round_to_grid(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 v rounded to the nearest value of the FP8 format (ties to even), saturated: the format's
    grid written out, independent of torch's float8 casts."""
    mantissa, min_exp, top = FORMATS[dtype]
    v = v.double().clamp(-top, top)
    exp = torch.floor(torch.log2(v.abs().clamp_min(2.0**min_exp))).clamp_min(min_exp)
    step = torch.exp2(exp - mantissa)
    return torch.round(v / step) * step  # torch.round rounds half to even


def reference_quantize(x: torch.Tensor, dtype: torch.dtype, dim: int | None) -> torch.Tensor:
    """x as the FP8 product sees it: scaled by max / amax (correctly rounded to float32, as the scale is
    float32 in the product), rounded to the grid, scaled back. The scaled value is the float32 product, as
    every cast to FP8 sees it: rounding the exact product instead moves the odd one that lands on a tie."""
    top = FORMATS[dtype][2]
    amax = x.double().abs().amax() if dim is None else x.double().abs().amax(dim=dim, keepdim=True)
    s = (top / amax.clamp_min(1e-12)).float()
    return round_to_grid((x.float() * s).double(), dtype) / s.double()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dim", [None, -1])
def test_scale_puts_the_largest_magnitude_on_the_format_max(dtype, dim):
    x = torch.randn(24, 40) * torch.logspace(-3, 3, 40)
    x8, inv = quantize(x, dtype, dim)
    s = scale(x, dtype, dim)
    amax = x.double().abs().amax() if dim is None else x.double().abs().amax(dim=dim, keepdim=True)
    assert torch.allclose(s.double(), FORMATS[dtype][2] / amax, rtol=1e-6)
    assert torch.equal(inv, s.reciprocal())
    top = x8.float().abs().amax() if dim is None else x8.float().abs().amax(dim=dim)
    assert torch.all(top == FORMATS[dtype][2])  # every slice reaches the max, none passes it


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_cast_rounds_to_the_format_grid_and_saturates(dtype):
    x = torch.randn(4096, dtype=torch.float64) * 300
    s = torch.tensor(2.0)  # half of |2x| is beyond e4m3's 448; e5m2 overflows at the big ones below
    x[:4] = torch.tensor([1e6, -1e6, 3e4, -3e4], dtype=torch.float64)
    got = cast(x.float(), s, dtype).double()
    assert torch.isfinite(got).all()
    assert torch.equal(got, round_to_grid(x.float().double() * 2.0, dtype))


def test_zeros_get_a_finite_scale_and_a_zero_product():
    x = torch.zeros(16, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    for mode in ("tensorwise", "rowwise"):
        x8, inv = quantize(x.detach(), E4M3, -1 if mode == "rowwise" else None)
        assert torch.isfinite(inv).all() and not x8.float().any()
        y = linear(x, w, mode)
        y.backward(torch.randn_like(y))
        assert not y.any() and torch.isfinite(x.grad).all() and not w.grad.any()
        x.grad = w.grad = None


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_a_non_finite_input_makes_the_product_non_finite(bad, mode):
    x, w = torch.randn(16, 32), torch.randn(48, 32)
    x[3, 5] = bad
    assert not torch.isfinite(linear(x, w, mode)).all()


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_products_equal_float64_products_of_the_rounded_operands(mode):
    """Forward, dx and dW, each against float64 math on operands rounded independently: only float32
    accumulation separates them."""
    torch.manual_seed(0)
    x = torch.randn(3, 32, 64, requires_grad=True)  # leading dims are flattened into tokens
    w = torch.randn(80, 64, requires_grad=True)
    g = torch.randn(3, 32, 80)
    y = linear(x, w, mode)
    y.backward(g)
    dim = -1 if mode == "rowwise" else None
    grad_dtype = E4M3 if mode == "rowwise" else E5M2
    x2, g2 = x.detach().reshape(-1, 64), g.reshape(-1, 80)
    w_ = w.detach()
    ref_y = reference_quantize(x2, E4M3, dim) @ reference_quantize(w_, E4M3, dim).t()
    ref_dx = reference_quantize(g2, grad_dtype, dim) @ reference_quantize(w_.t(), E4M3, dim).t()
    ref_dw = reference_quantize(g2.t(), grad_dtype, dim) @ reference_quantize(x2.t(), E4M3, dim).t()
    assert rel(y.reshape(-1, 80), ref_y) < 1e-5
    assert rel(x.grad.reshape(-1, 64), ref_dx) < 1e-5
    assert rel(w.grad, ref_dw) < 1e-5
    # ... and within the formats' rounding of the exact products (e4m3: 2^-4 relative; e5m2: 2^-3).
    exact = x2.double() @ w_.double().t()
    assert rel(y.reshape(-1, 80), exact) < 2**-4
    assert rel(x.grad.reshape(-1, 64), g2.double() @ w_.double()) < (2**-4 if mode == "rowwise" else 2**-3)


def reference_head(h, weight, targets, cap: float, chunk: int, vocab_size: int, mode: str):
    """The head's mean loss and its gradients (h, W) by the recipe, in float64: per chunk, logits of the
    rounded operands, soft-cap, cross-entropy, the logits' gradient g, and g's two products, of rounded
    operands. tensorwise rounds h (the whole buffer) and W once, one scale each, and g to e5m2 with the
    scale of its bound: every element of g lies within 1 / n_valid, which goes to e5m2's largest value;
    rowwise rounds each product's operands per row along its reduction, g to e4m3; none rounds nothing."""
    h, w = h.double(), weight[:vocab_size].double()

    def rounded(x, dtype, dim):
        return x if mode == "none" else reference_quantize(x, dtype, dim if mode == "rowwise" else None)

    grad_dtype = E4M3  # rowwise's
    hq, wq = rounded(h, E4M3, -1), rounded(w, E4M3, -1)
    valid = targets >= 0
    n_valid = valid.sum()
    loss, grad_h, grad_w = 0.0, torch.zeros_like(h), torch.zeros(weight.shape, dtype=torch.float64)
    for start in range(0, h.shape[0], chunk):
        rows = slice(start, start + chunk)
        capped = cap * torch.tanh(hq[rows] @ wq.t() / cap)
        onehot = F.one_hot(targets[rows].clamp_min(0), vocab_size).double()
        lse = capped.logsumexp(dim=-1)
        loss += torch.where(valid[rows], lse - (capped * onehot).sum(dim=-1), 0.0).sum()
        g = (capped.softmax(dim=-1) - onehot) * (1 - (capped / cap).square()) * valid[rows, None] / n_valid
        # g W reduces over the vocabulary, g^T h over the chunk's tokens; tensorwise reuses the forward's h.
        if mode == "tensorwise":
            top = FORMATS[E5M2][2]
            gq = round_to_grid((g * n_valid * top).float().double(), E5M2) / (n_valid * top)
            grad_h[rows] = gq @ wq
            grad_w[:vocab_size] += gq.t() @ hq[rows]
            continue
        grad_h[rows] = rounded(g, grad_dtype, -1) @ rounded(w.t(), E4M3, -1).t()
        grad_w[:vocab_size] += rounded(g.t(), grad_dtype, -1) @ rounded(h[rows].t(), E4M3, -1).t()
    return loss / n_valid, grad_h, grad_w


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_head_loss_and_gradients_follow_the_float64_recipe(mode):
    """ChunkedCrossEntropy's FP8 products (three chunks, the last a short one) against the recipe in float64.
    float32 math moves the logits' gradient by about 1e-7, which can carry an odd element across a rounding
    boundary of the FP8 grid (1e-4 of the weight gradient's norm, the most in 40 seeds): the bound is 1e-3,
    while FP8's rounding alone moves the gradients by 3e-2 and more."""
    torch.manual_seed(0)
    T, d, vocab, padded, cap, chunk = 96, 64, 304, 320, 15.0, 40
    h = torch.randn(T, d, requires_grad=True)
    weight = (torch.randn(padded, d) * 0.3).requires_grad_()
    with torch.no_grad():
        weight[vocab:] = 100.0  # rows that are never predicted, nor part of the weight's scale
    targets = torch.randint(0, vocab, (T,))
    targets[::7] = -1
    loss = ChunkedCrossEntropy.apply(h, weight, targets, cap, chunk, vocab, mode)
    loss.backward()
    ref_loss, ref_h, ref_w = reference_head(h.detach(), weight.detach(), targets, cap, chunk, vocab, mode)
    assert abs(loss.item() - ref_loss.item()) < 1e-6 * ref_loss.item()
    assert rel(h.grad, ref_h) < 1e-3
    assert rel(weight.grad, ref_w) < 1e-3
    assert not weight.grad[vocab:].any()
    # The reference's math is the head's: unrounded, it gives the plain head's loss and gradients in
    # float64 (mode none) ...
    h64, w64 = h.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    plain = ChunkedCrossEntropy.apply(h64, w64, targets, cap, chunk, vocab, "none")
    plain.backward()
    exact = reference_head(h64.detach(), w64.detach(), targets, cap, chunk, vocab, "none")
    assert abs(plain.item() - exact[0].item()) < 1e-12 * exact[0].item()
    assert rel(h64.grad, exact[1]) < 1e-12 and rel(w64.grad, exact[2]) < 1e-12
    # ... which the FP8 rounding moves by far more than the bound.
    assert rel(ref_h, exact[1]) > 1e-2 and rel(ref_w, exact[2]) > 1e-2


def test_mode_none_is_the_plain_linear_layer():
    x, w = torch.randn(16, 32), torch.randn(48, 32)
    assert torch.equal(linear(x, w, "none"), F.linear(x, w))


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="model.fp8='e4m3' must be one of none, tensorwise, rowwise"):
        check_mode(ModelConfig(fp8="e4m3"), torch.device("cpu"), 32768)
    check_mode(ModelConfig(fp8="tensorwise"), torch.device("cpu"), 97)  # CPU runs _scaled_mm for tests
    with pytest.raises(ConfigError, match="model.fp8=rowwise needs data.vocab_size=50257 to be a multiple"):
        check_mode(ModelConfig(fp8="rowwise"), torch.device("cuda"), 50257)
    with pytest.raises(ConfigError, match="needs model.loss_chunk_tokens=1000 to be a multiple of 16"):
        check_mode(ModelConfig(fp8="tensorwise", loss_chunk_tokens=1000), torch.device("cuda"), 32768)


def test_fp8_model_trains_like_the_float32_one():
    """The whole model with FP8 layers: its loss and gradients follow the float32 model's within the
    formats' rounding, and it compiles in one graph."""
    torch.manual_seed(0)
    cfg = dict(depth=2, head_dim=16, aspect_ratio=32, loss_chunk_tokens=64)
    ids, targets = torch.randint(0, 97, (128,)), torch.randint(0, 97, (128,))
    cu, pos = torch.tensor([0, 50, 128], dtype=torch.int32), torch.cat([torch.arange(50), torch.arange(78)])
    losses, grads = {}, {}
    for mode in ("none", "tensorwise", "rowwise"):
        torch.manual_seed(0)
        model = GPT(ModelConfig(**cfg, fp8=mode), vocab_size=97, attention="reference", max_seqlen=128)
        with torch.no_grad():  # zero-initialised projections would leave the FP8 products out of the loss
            for p in model.parameters():
                p.normal_(0, 0.3)
        forward = torch.compile(model, fullgraph=True, dynamic=False) if mode == "tensorwise" else model
        loss = forward(ids, pos, cu, 128, targets)
        loss.backward()
        losses[mode] = loss.item()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    for mode in ("tensorwise", "rowwise"):
        assert abs(losses[mode] - losses["none"]) < 0.05 * losses["none"]
        assert rel(grads[mode], grads["none"].double()) < 0.2


def test_fp8_is_for_training_and_evaluation_runs_the_bf16_products():
    """With autograd off (evaluation, sampling) an FP8 model's per-token losses are the bf16 model's with the
    same weights, bit for bit, compiled as train.py compiles its evaluation, and so are its loss and logits;
    with autograd on, its loss is FP8's, the head's products included. Training then evaluating compiles
    each function once."""
    from torch._dynamo.testing import CompileCounterWithBackend

    cfg = dict(depth=2, head_dim=16, aspect_ratio=32, loss_chunk_tokens=64)
    ids, targets = torch.randint(0, 97, (128,)), torch.randint(0, 97, (128,))
    cu, pos = torch.tensor([0, 50, 128], dtype=torch.int32), torch.cat([torch.arange(50), torch.arange(78)])
    models = {}
    for mode in ("none", "tensorwise"):
        torch.manual_seed(0)
        models[mode] = GPT(ModelConfig(**cfg, fp8=mode), vocab_size=97, attention="reference", max_seqlen=128)
    with torch.no_grad():
        for p in models["none"].parameters():
            p.normal_(0, 0.3)
        models["tensorwise"].load_state_dict(models["none"].state_dict())
    torch._dynamo.reset()
    train_backend, eval_backend = CompileCounterWithBackend("inductor"), CompileCounterWithBackend("inductor")
    fp8 = models["tensorwise"]
    step = torch.compile(fp8, backend=train_backend, fullgraph=True, dynamic=False)
    evaluate = torch.compile(fp8.token_losses, backend=eval_backend, fullgraph=True, dynamic=False)
    bf16_evaluate = torch.compile(models["none"].token_losses, fullgraph=True, dynamic=False)
    bf16_loss = models["none"](ids, pos, cu, 128, targets)
    for _ in range(2):
        fp8_loss = step(ids, pos, cu, 128, targets)
        fp8_loss.backward()
        with torch.no_grad():
            assert torch.equal(
                evaluate(ids, pos, cu, 128, targets), bf16_evaluate(ids, pos, cu, 128, targets)
            )
            want = models["none"].token_losses(ids, pos, cu, 128, targets)
            assert torch.equal(fp8.token_losses(ids, pos, cu, 128, targets), want)
    assert (
        fp8_loss.item() != bf16_loss.item()
        and abs(fp8_loss.item() - bf16_loss.item()) < 0.05 * bf16_loss.item()
    )
    assert train_backend.frame_count == 1 and eval_backend.frame_count == 1
    h, w, cap = fp8.hidden_states(ids, pos, cu, 128), fp8.lm_head.weight, fp8.logit_softcap
    loss = fp8(ids, pos, cu, 128, targets)
    assert torch.equal(loss, ChunkedCrossEntropy.apply(h, w, targets, cap, 64, 97, "tensorwise"))
    assert not torch.equal(loss, ChunkedCrossEntropy.apply(h, w, targets, cap, 64, 97, "none"))
    assert torch.equal(fp8(ids, pos, cu, 128), softcap(linear(h, w, "tensorwise"), cap)[:, :97])
    with torch.no_grad():
        assert torch.equal(fp8(ids, pos, cu, 128, targets), models["none"](ids, pos, cu, 128, targets))
        assert torch.equal(fp8(ids, pos, cu, 128), models["none"](ids, pos, cu, 128))


def test_fp8_head_false_keeps_the_head_in_bf16():
    """model.fp8_head=false: the blocks' products in FP8, the head's three in the weights' precision. The
    training loss is the plain head's on the FP8 blocks' hidden states, bit for bit, and no longer the FP8
    head's; the blocks are those of the FP8 model (the same hidden states)."""
    cfg = dict(depth=2, head_dim=16, aspect_ratio=32, loss_chunk_tokens=64, fp8="tensorwise")
    ids, targets = torch.randint(0, 97, (128,)), torch.randint(0, 97, (128,))
    cu, pos = torch.tensor([0, 50, 128], dtype=torch.int32), torch.cat([torch.arange(50), torch.arange(78)])
    models = {}
    for head in (True, False):
        torch.manual_seed(0)
        models[head] = GPT(
            ModelConfig(**cfg, fp8_head=head), vocab_size=97, attention="reference", max_seqlen=128
        )
    with torch.no_grad():
        for p in models[True].parameters():
            p.normal_(0, 0.3)
        models[False].load_state_dict(models[True].state_dict())
    plain_head, fp8_head = models[False], models[True]
    h = plain_head.hidden_states(ids, pos, cu, 128)
    assert torch.equal(h, fp8_head.hidden_states(ids, pos, cu, 128))
    w, cap = plain_head.lm_head.weight, plain_head.logit_softcap
    loss = plain_head(ids, pos, cu, 128, targets)
    assert torch.equal(loss, ChunkedCrossEntropy.apply(h, w, targets, cap, 64, 97, "none"))
    assert not torch.equal(loss, fp8_head(ids, pos, cu, 128, targets))
    assert torch.equal(plain_head(ids, pos, cu, 128), softcap(linear(h, w, "none"), cap)[:, :97])


FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason="needs FP8 tensor cores")
@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_gpu_products_at_training_size(mode):
    """d20's MLP input product on 16,384 bf16 tokens, forward and backward, against float64 products of the
    independently rounded operands (cuBLAS accumulates in float32, then rounds the output to bf16)."""
    torch.manual_seed(0)
    x = torch.randn(16384, 1280, device="cuda").bfloat16().requires_grad_()
    w = torch.randn(5120, 1280, device="cuda", requires_grad=True)
    g = torch.randn(16384, 5120, device="cuda").bfloat16()
    y = linear(x, w, mode)
    y.backward(g)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    dim = -1 if mode == "rowwise" else None
    grad_dtype = E4M3 if mode == "rowwise" else E5M2
    x64, g64, w64 = x.detach().double(), g.double(), w.detach().double()
    # bf16 outputs (2^-9 relative rounding) and float32 scales applied in cuBLAS's epilogue.
    assert rel(y, reference_quantize(x64, E4M3, dim) @ reference_quantize(w64, E4M3, dim).t()) < 1e-2
    ref_dx = reference_quantize(g64, grad_dtype, dim) @ reference_quantize(w64.t(), E4M3, dim).t()
    assert rel(x.grad, ref_dx) < 1e-2
    ref_dw = reference_quantize(g64.t(), grad_dtype, dim) @ reference_quantize(x64.t(), E4M3, dim).t()
    assert rel(w.grad, ref_dw) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason="needs FP8 tensor cores")
def test_compiled_d12_step_with_fp8_has_no_graph_break_and_no_recompile():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    cfg = ModelConfig(depth=12, fp8="tensorwise")  # with fused_rope_norm's bf16 q/k/v operator beside it
    model = GPT(cfg, vocab_size=32768, attention="triton", max_seqlen=2048).cuda()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    T = 16384
    ids, targets = torch.randint(0, 32768, (T,), device="cuda"), torch.randint(0, 32768, (T,), device="cuda")
    for lengths in ([2048] * 8, [1500] * 10 + [1384], [2048] * 7 + [1000, 1000, 48]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        cu = torch.cat([cu, cu[-1:].repeat(16 - len(lengths))])  # a fixed length, as the loader pads it
        pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(ids, pos, cu, 2048, targets)
        loss.backward()
        assert torch.isfinite(loss)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


@pytest.mark.gpu
@pytest.mark.skipif(not FP8_GPU, reason="needs FP8 tensor cores")
def test_compiled_fp8_head_holds_no_more_memory_than_the_bf16_one():
    """The compiled head loss at d12's size (65,536 tokens, 32,768 words, chunks of 8,192), forward and
    backward: its peak under tensorwise FP8 is no higher than in bf16. Each chunk's e5m2 gradient (0.27 GB)
    has to be read by that chunk's products before the next chunk's is written; eight held to the end of the
    loop would add 2.1 GB."""

    def peak(mode: str) -> int:
        torch._dynamo.reset()
        torch.manual_seed(0)
        h = torch.randn(65536, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(32768, 768, device="cuda") * 0.02).requires_grad_()
        targets = torch.randint(0, 32768, (65536,), device="cuda")
        head = torch.compile(
            lambda h, w, t: ChunkedCrossEntropy.apply(h, w, t, 15.0, 8192, 32768, mode),
            fullgraph=True,
            dynamic=False,
        )
        head(h, w, targets).backward()  # compiles
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        head(h, w, targets).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    bf16, fp8 = peak("none"), peak("tensorwise")
    assert fp8 <= bf16, f"FP8 head peak {fp8 / 1e9:.2f} GB above bf16's {bf16 / 1e9:.2f} GB"
