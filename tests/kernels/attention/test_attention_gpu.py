"""Varlen FlashAttention kernels on the GPU at realistic sizes (65,536 tokens, 16 heads), in bf16.

Run on a CUDA machine: python -m pytest -m gpu tests/kernels/attention/test_attention_gpu.py
"""

import pytest
import torch

from kernels.attention import (
    attention_reference,
    flash_attn_plan,
    flash_attn_varlen,
    hopper,
    hopper_forward,
    plan,
)
from kernels.attention import backward as backward_module
from kernels.attention.backward import backward
from kernels.attention.forward import forward
from kernels.attention.op import flash_attn_varlen_fwd
from kernels.common import INTERPRET, l2_bytes
from scripts.bench_attention import document_lengths
from tests.kernels.attention.poison import poison_new_buffers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA"),
]

T = 65536
# Long documents (the fp32 reference holds [H, L, L] scores per document, so at most 8192 here), a
# document of length 1, zero-length documents, and 1,205 tokens past the last document.
LONG = [8192, 8192, 7000, 6001, 4096, 129, 1, 0, *[2048] * 15, 0, 0]


def lengths_of(mix: str) -> list[int]:
    return LONG if mix == "long" else document_lengths(mix, T)


def make_inputs(lengths, heads, kv_heads, d, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (
        torch.randn(T, h, d, device="cuda", dtype=dtype, generator=gen) for h in (heads, kv_heads, kv_heads)
    )
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


def grads(fn, q, k, v, cu, dout):
    """(out, lse, dq, dk, dv) of fn(q, k, v, cu) for the output gradient dout."""
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    out, lse = fn(*inputs, cu)
    return (out.detach(), lse, *torch.autograd.grad(out, inputs, dout))


def ours(window):
    def run(q, k, v, cu):
        plan = flash_attn_plan(cu, q.shape[0], q.shape[2], causal=False, window_size=window)
        return flash_attn_varlen_fwd(q, k, v, cu, plan.tables, *window, q.shape[-1] ** -0.5, plan.max_seqlen)

    return run


def reference(window):
    return lambda q, k, v, cu: attention_reference(q, k, v, cu, causal=False, window_size=window)


def torch_varlen(window, lengths):
    from torch.nn.attention.varlen import varlen_attn

    longest = max(lengths)
    return lambda q, k, v, cu: (varlen_attn(q, k, v, cu, cu, longest, longest, window_size=window), None)


def rel_err(x, ref):
    return ((x.float() - ref).norm() / ref.norm()).item()


CASES = [  # mix, head dim, heads, kv heads, window
    ("a_nanochat", 128, 16, 16, (-1, 0)),
    ("a_nanochat", 64, 16, 16, (-1, 0)),
    ("b_short", 128, 16, 4, (-1, 0)),
    ("a_nanochat", 128, 16, 16, (512, 0)),
    ("long", 128, 16, 4, (700, 0)),  # a window that is no multiple of the blocks, GQA
    ("long", 64, 16, 2, (1024, 0)),
    ("long", 128, 16, 16, (-1, 0)),
    ("b_short", 96, 16, 8, (-1, 0)),  # padded head dim
    ("a_nanochat", 256, 8, 8, (-1, 0)),
]


@pytest.mark.parametrize(
    "mix,d,heads,kv_heads,window", CASES, ids=[f"{m}-d{d}-h{h}kv{kv}-w{w[0]}" for m, d, h, kv, w in CASES]
)
def test_bf16_matches_fp32_reference_and_varlen_attn(mix, d, heads, kv_heads, window):
    lengths = lengths_of(mix)
    q, k, v, cu = make_inputs(lengths, heads, kv_heads, d)
    dout = torch.randn(T, heads, d, device="cuda", dtype=torch.bfloat16)
    got = grads(ours(window), q, k, v, cu, dout)
    want = grads(reference(window), q.float(), k.float(), v.float(), cu, dout.float())
    end = sum(lengths)
    assert all(torch.equal(x[end:], torch.zeros_like(x[end:])) for x in (got[0], *got[2:]))
    finite = want[1].isfinite()
    assert torch.equal(got[1].isfinite(), finite)
    assert (got[1][finite] - want[1][finite]).abs().max() < 1e-2
    # Errors over the tokens inside documents (varlen_attn leaves the others unwritten).
    errors = [
        rel_err(x[:end], ref[:end]) for x, ref in zip(got[:1] + got[2:], want[:1] + want[2:], strict=True)
    ]
    assert errors[0] < 1e-2 and max(errors[1:]) < 2e-2, errors
    if kv_heads == heads:  # torch 2.11's varlen_attn has no GQA
        theirs = grads(torch_varlen(window, lengths), q, k, v, cu, dout)
        their_errors = [
            rel_err(x[:end], ref[:end])
            for x, ref in zip(theirs[:1] + theirs[2:], want[:1] + want[2:], strict=True)
        ]
        assert all(e <= 1.5 * t + 1e-3 for e, t in zip(errors, their_errors, strict=True)), (
            errors,
            their_errors,
        )


# Documents whose scores rise along the keys by this much (in nats) from first to last: by more than 2^8 a
# key block of 128, by about 1, and by less, so that the forward's row maxima jump in some blocks only.
RISING = [(8192, 400.0), (8192, 40.0), (8192, 4.0), (4096, 150.0), (1000, 60.0)]


@pytest.mark.parametrize("window", [(-1, 0), (512, 0)], ids=["past", "w512"])
@pytest.mark.parametrize("d", [64, 128])
def test_scores_rising_along_the_keys_match_fp32_reference(d, window):
    lengths = [n for n, _ in RISING]
    q, k, v, cu = make_inputs(lengths, 8, 8, d)
    end = sum(lengths)
    ramp = torch.cat([torch.arange(n, device="cuda") * (rise * d**0.5 / n) for n, rise in RISING])
    q[:end, :, 0] = 1.0
    k[:end, :, 0] = ramp[:, None].to(k.dtype)
    dout = torch.randn(T, 8, d, device="cuda", dtype=torch.bfloat16)
    got = grads(ours(window), q, k, v, cu, dout)
    want = grads(reference(window), q.float(), k.float(), v.float(), cu, dout.float())
    finite = want[1].isfinite()
    assert torch.equal(got[1].isfinite(), finite)
    assert (got[1][finite] - want[1][finite]).abs().max() < 1e-2
    out, _, dq, dk, dv = (x[:end] for x in got)
    ref_out, _, ref_dq, ref_dk, ref_dv = (x[:end] for x in want)
    pairs = [(out, ref_out), (dq[..., 1:], ref_dq[..., 1:]), (dk, ref_dk), (dv, ref_dv)]
    errors = [rel_err(x, ref) for x, ref in pairs]
    assert errors[0] < 1e-2 and max(errors[1:]) < 2e-2, errors
    # dQ along the ramp is k's ramp (up to 400 sqrt(d)) weighted by dS, summed to a small difference: a
    # bf16 dS loses it to rounding in any kernel (about 0.7 relative error here), so that component is held
    # to torch's varlen_attn on the same inputs instead.
    theirs = grads(torch_varlen(window, lengths), q, k, v, cu, dout)[2][:end]
    ours_ramp, their_ramp = (rel_err(x[..., 0], ref_dq[..., 0]) for x in (dq, theirs))
    assert ours_ramp <= 1.1 * their_ramp, (ours_ramp, their_ramp)


@pytest.mark.parametrize("left", [-1, 512, 100], ids=["past", "w512", "w100"])
@pytest.mark.parametrize("as_other_gpu", [False, True], ids=["this_gpu", "other_gpu"])
@pytest.mark.parametrize("d", [64, 128])
def test_passes_read_only_what_they_wrote(left, as_other_gpu, d, monkeypatch):
    """As the CPU test of the same name, at the GPU's block sizes: every float buffer that torch.empty(_like)
    makes while the passes run starts as NaN, so a pass that read memory no pass wrote (a dS slot that a
    window leaves unwritten, a float32 dQ sum that nothing stored, a tail row) would carry NaN into the
    gradients. GQA. On Hopper every document takes the Gluon passes; as another GPU (its launches, which
    store the dS of documents of up to 2,048 tokens), the Triton ones."""
    q, k, v, cu = make_inputs(LONG, 16, 4, d)
    dout = torch.randn(T, 16, d, device="cuda", dtype=torch.bfloat16)
    want = grads(reference((left, 0)), q.float(), k.float(), v.float(), cu, dout.float())

    if as_other_gpu:
        monkeypatch.setattr(plan, "is_hopper", lambda device: False)
        monkeypatch.setattr(backward_module, "is_hopper", lambda device: False)
    poison_new_buffers(monkeypatch)
    got = grads(ours((left, 0)), q, k, v, cu, dout)
    monkeypatch.undo()
    end = sum(LONG)
    for x, ref in zip(got[:1] + got[2:], want[:1] + want[2:], strict=True):
        assert torch.isfinite(x).all()
        assert rel_err(x[:end], ref[:end]) < 2e-2


def test_fp16():
    q, k, v, cu = make_inputs(lengths_of("a_nanochat"), 16, 8, 128, torch.float16)
    out = flash_attn_varlen(q, k, v, cu, 2048, causal=True)
    ref, _ = attention_reference(q.float(), k.float(), v.float(), cu, causal=True)
    assert rel_err(out, ref) < 2e-3


@pytest.mark.parametrize("mix", ["a_nanochat", "long"])
@pytest.mark.parametrize("d", [64, 128])
def test_backward_is_bitwise_deterministic(mix, d):
    q, k, v, cu = make_inputs(lengths_of(mix), 16, 4, d)
    dout = torch.randn(T, 16, d, device="cuda", dtype=torch.bfloat16)
    first = grads(ours((-1, 0)), q, k, v, cu, dout)
    for _ in range(3):
        again = grads(ours((-1, 0)), q, k, v, cu, dout)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_compiled_model_has_no_graph_break_and_no_recompile():
    """torch.compile(fullgraph=True, dynamic=False) with inductor over a block that calls the kernel: new
    document boundaries and a new max_seqlen every batch, one graph, forward and backward."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    heads, d, n_tokens, n_docs = 8, 64, 4096, 16

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(heads * d, 3 * heads * d, bias=False)
            self.proj = torch.nn.Linear(heads * d, heads * d, bias=False)

        def forward(self, x, cu_seqlens, max_seqlen):
            q, k, v = self.qkv(x).view(n_tokens, 3, heads, d).unbind(1)
            y = flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen, causal=True, window_size=(256, 0))
            return self.proj(y.reshape(n_tokens, heads * d))

    torch._dynamo.reset()
    counters.clear()
    model = Block().cuda().bfloat16()
    backend = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, fullgraph=True, dynamic=False, backend=backend)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        cuts = torch.randperm(n_tokens - 1, generator=gen)[: n_docs - 4].add(1).sort().values
        cu = torch.cat([torch.tensor([0]), cuts, torch.full((4,), n_tokens)]).int().cuda()  # 3 zero-length
        max_seqlen = int(cu.diff().max())
        x = torch.randn(n_tokens, heads * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            y = compiled(x, cu, max_seqlen)
            y.float().square().mean().backward()
        grad = x.grad
        x.grad = None
        y_eager = model(x, cu, max_seqlen)
        y_eager.float().square().mean().backward()
        assert rel_err(y, y_eager.float()) < 1e-2 and rel_err(grad, x.grad.float()) < 2e-2
    assert backend.frame_count == 1
    assert not counters["graph_break"]


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs Hopper"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("left", [-1, 512, 100], ids=["past", "w512", "w100"])
@pytest.mark.parametrize("d", [64, 128])
def test_gluon_kernels_agree_with_triton_kernels(dtype, left, d, monkeypatch):
    """The warp-specialised forward and dK/dV (with dQ) passes against the Triton kernels they replace,
    with GQA, over the whole past and causal windows (one shorter than a key block, so that some
    blocks hold no key of some rows): the forward and dV are the same sums in the same order (bitwise
    equal); the dQ pass sums delta in another order, so dQ and dK agree to rounding. A tail of 3,000 tokens
    past the last document. Over the whole past the forward's items run in sections of one kv group (no
    max_seqlen bounds the keys); with an L2 as large as every head's K and V, in one: the same outputs."""
    lengths = [9000, 2049, 30000, 100, 4500, 17000, 2047]
    q, k, v, cu = make_inputs(lengths, 16, 4, d, dtype)
    cu = cu[:-1].contiguous()
    dout = torch.randn_like(q)
    assert hopper.supported(q, k, v, dout)

    def run():
        out, lse = forward(q, k, v, cu, left, 0, d**-0.5)
        return out, lse, *backward(dout, q, k, v, out, lse, None, cu, left, 0, d**-0.5)

    gluon, again = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(gluon, again, strict=True))
    assert hopper_forward.section_heads(4, 4, T, d, 2, l2_bytes(q.device)) == 4
    with monkeypatch.context() as patch:
        patch.setattr(hopper_forward, "l2_bytes", lambda device: 1 << 40)
        one_section = forward(q, k, v, cu, left, 0, d**-0.5)
    assert torch.equal(gluon[0], one_section[0]) and torch.equal(gluon[1], one_section[1])
    monkeypatch.setattr(hopper, "supported", lambda *tensors: False)
    triton_ = run()
    assert torch.equal(gluon[0], triton_[0]) and torch.equal(gluon[1], triton_[1])
    assert torch.equal(gluon[4], triton_[4])  # dV does not depend on delta
    for got, want in zip(gluon[2:4], triton_[2:4], strict=True):
        assert rel_err(got, want.float()) < 2e-3
