"""Varlen FlashAttention kernels on CPU, in Triton's interpreter, against a float64 reference.

kernels.common switches the interpreter on when there is no CUDA; on a GPU machine these tests are
skipped (test_attention_gpu.py covers the compiled kernels) unless TRITON_INTERPRET=1 is set.
The interpreter's bf16 tl.dot is broken, so inputs here are float16 and float32. The interpreter uses
small, unequal blocks (block_config), so these buffers of a few hundred tokens cross many block edges.
"""

import contextlib
import itertools
import math

import pytest
import torch

from kernels.attention import (
    attention_masked,
    attention_reference,
    block_sizes,
    flash_attn_plan,
    flash_attn_varlen,
    plan,
)
from kernels.attention import op as op_module
from kernels.attention.backward import backward
from kernels.attention.block_sizes import block_config
from kernels.attention.op import flash_attn_varlen_fwd
from kernels.attention.plan import longest_first, tile_table
from kernels.attention.tiles import tma_descriptors
from kernels.common import INTERPRET
from tests.kernels.attention.poison import poison_new_buffers

pytestmark = pytest.mark.skipif(not INTERPRET, reason="GPU build: see test_attention_gpu.py")

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}  # relative L2 error against float64


def cu_from(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def random_lengths(total: int, mean: float, seed: int) -> list[int]:
    """Lognormal document lengths filling part of `total` tokens, with a few zero-length documents."""
    gen = torch.Generator().manual_seed(seed)
    lengths, used = [], 0
    while True:
        n = max(1, int(torch.empty(1).log_normal_(math.log(mean), 1.0, generator=gen).item()))
        if used + n > total:
            break
        lengths.append(n)
        used += n
        if torch.rand(1, generator=gen).item() < 0.2:
            lengths.append(0)
    return lengths


# Document mixes for T = 192 tokens. Interpreter blocks are 16 and 32 rows: lengths below are multiples of
# both, of one, of neither, length 1, zero-length documents in the middle and at the end, and tails of
# tokens past cu_seqlens[-1].
T = 192
MIXES = {
    "edges": [0, 1, 17, 32, 0, 48, 63, 0, 0],  # 161 tokens, then a tail of 31
    "one_doc_fills": [T],
    "one_doc_tail": [150, 0, 0],
    "random": random_lengths(T, 18.0, seed=1),  # [34, 0, 23, 31, 56, 3, 26, 5]
    "blocks_exact": [16, 32, 64, 80],
}
WINDOWS = {"causal": (-1, 0), "sliding": (24, 0), "full": (-1, -1), "two_sided": (9, 5)}

# (mix, window, head dim, heads, kv heads, dtype): every mix with every window, rotating the rest.
CASES = []
for i, mix in enumerate(MIXES):
    for j, window in enumerate(WINDOWS):
        d = (64, 128)[(i + j) % 2]
        heads = ((4, 4), (4, 2), (4, 1))[(i + 2 * j) % 3]
        dtype = (torch.float16, torch.float32)[(i * 3 + j) % 2]
        CASES.append((mix, window, d, *heads, dtype))
CASES += [
    ("edges", "causal", 80, 2, 1, torch.float16),
    ("random", "sliding", 256, 2, 2, torch.float32),
    ("edges", "causal", 16, 3, 3, torch.float32),
]


def make_inputs(lengths, d, heads, kv_heads, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, h, d, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    return q, k, v, cu_from(lengths)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def forward_op(q, k, v, cu, window, scale):
    """(out, lse) of the forward op, with the plan it is given in flash_attn_varlen."""
    plan = flash_attn_plan(cu, q.shape[0], q.shape[2], causal=False, window_size=window)
    return flash_attn_varlen_fwd(q, k, v, cu, plan.tables, *window, scale, plan.max_seqlen)


def run_kernel(q, k, v, cu, window, scale, dout, dlse=None):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out, lse = forward_op(q, k, v, cu, window, scale)
    loss = (0 if dout is None else (out.float() * dout).sum()) + (0 if dlse is None else (lse * dlse).sum())
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def run_reference(q, k, v, cu, window, scale, dout, dlse=None):
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    out, lse = attention_reference(q, k, v, cu, causal=False, window_size=window, softmax_scale=scale)
    loss = 0 if dout is None else (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(lse.isfinite(), lse, 0.0) * dlse.double()).sum()
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def test_tile_table_lists_each_block_once():
    # The last two cases have more segments than the table kernel scans at once, the last of unequal sizes.
    cases = [
        *((x, T) for x in MIXES.values()), ([0] * 5, T), ([1] * T, T), ([1] * 300 + [0] * 9, 420),
        ([(7 * i) % 13 for i in range(300)], 1900),
    ]
    for lengths, n in cases:
        cu = cu_from(lengths)
        sizes = [*lengths, n - sum(lengths)]  # the tail is the last segment
        tables = [
            (16, True, 0, None),
            (32, False, 0, None),
            (128, True, 0, None),
            (16, False, 0, 31),
            (32, True, 31, 63),
            (16, True, 40, None),
        ]
        for (block, last_first, shortest, longest), ordered in itertools.product(tables, (False, True)):
            order = longest_first(cu, n) if ordered else None
            table = tile_table(cu, n, block, last_first, shortest, longest, order=order)
            bound = math.ceil(n / block) + min(len(lengths), n // (shortest + 1))
            assert table.shape == (2, bound) and table.dtype == torch.int32
            # The tail (segment len(lengths)) belongs to the tables with shortest 0, whatever its length.
            expected = sorted(
                (s, b)
                for s, size in enumerate(sizes)
                if shortest < size <= (longest or n) or (s == len(lengths) and shortest == 0)
                for b in range(math.ceil(size / block))
            )
            real = table[0] >= 0
            assert sorted(zip(table[0, real].tolist(), table[1, real].tolist(), strict=True)) == expected
            assert not real[real.sum() :].any()  # real tiles first, padding after
            segment, index = table[:, real]
            same = segment[1:] == segment[:-1]
            assert ((index[1:] - index[:-1])[same] == (-1 if last_first else 1)).all()
            # Segments whole, in their own order or from the longest to the shortest (equal sizes in their
            # own order).
            ranked = sorted((-sizes[s] if ordered else 0, s) for s in {s for s, _ in expected})
            assert torch.unique_consecutive(segment).tolist() == [s for _, s in ranked]


@pytest.mark.parametrize(
    "mix,window,d,heads,kv_heads,dtype",
    CASES,
    ids=[f"{m}-{w}-d{d}-h{h}kv{kv}-{str(t)[6:]}" for m, w, d, h, kv, t in CASES],
)
def test_matches_reference(mix, window, d, heads, kv_heads, dtype):
    lengths = MIXES[mix]
    q, k, v, cu = make_inputs(lengths, d, heads, kv_heads, dtype)
    scale = 0.5 / math.sqrt(d) if mix == "random" else 1.0 / math.sqrt(d)
    dout = torch.randn(T, heads, d)
    got = run_kernel(q, k, v, cu, WINDOWS[window], scale, dout)
    want = run_reference(q, k, v, cu, WINDOWS[window], scale, dout)
    for name, x, ref in zip(["out", "dq", "dk", "dv"], got[:1] + got[2:], want[:1] + want[2:], strict=True):
        assert torch.isfinite(x).all(), name
        assert rel_err(x, ref) < TOL[dtype], (name, rel_err(x, ref))
    lse, ref_lse = got[1], want[1]
    assert torch.equal(lse.isinf(), ref_lse.isinf())
    finite = ref_lse.isfinite()
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-4
    # Tokens past the last document attend to nothing: zero output and zero gradients, never NaN.
    end = cu[-1].item()
    for x in (got[0], *got[2:]):
        assert torch.equal(x[end:], torch.zeros_like(x[end:]))


@pytest.mark.parametrize("window", [(-1, 0), (24, 0), (5, 0)], ids=["causal", "sliding", "narrow"])
def test_passes_read_only_what_they_wrote(window, monkeypatch):
    """Every float buffer that torch.empty(_like) makes while the passes run starts as NaN (the stored dS
    among them, whose slots a window leaves partly unwritten): a pass that read memory no pass wrote would
    carry NaN into the gradients. Documents of the stored-dS length class and longer ones."""
    lengths = [34, 0, 23, 31, 56, 3, 26, 5, 1]
    q, k, v, cu = make_inputs(lengths, 64, 4, 2, torch.float32)
    dout = torch.randn(T, 4, 64)
    want = run_reference(q, k, v, cu, window, 0.125, dout)

    poison_new_buffers(monkeypatch)
    got = run_kernel(q, k, v, cu, window, 0.125, dout)
    monkeypatch.undo()
    for name, x, ref in zip(["out", "dq", "dk", "dv"], got[:1] + got[2:], want[:1] + want[2:], strict=True):
        assert torch.isfinite(x).all(), name
        assert rel_err(x, ref) < 1e-5, (name, rel_err(x, ref))


@pytest.mark.parametrize("window", ["causal", "sliding"])
def test_passes_take_documents_in_any_order(window, monkeypatch):
    """Every pass reads its documents from the table entries, never from their place in it: with every
    table listing the documents longest first (as the Hopper dK/dV pass's does), the gradients match
    float64."""
    launches = plan._launches

    def longest_first_everywhere(*args):
        return [launch._replace(longest_first=True) for launch in launches(*args)]

    monkeypatch.setattr(plan, "_launches", longest_first_everywhere)
    plan._layout.cache_clear()
    try:
        q, k, v, cu = make_inputs(MIXES["random"], 64, 4, 2, torch.float32)
        dout = torch.randn(T, 4, 64)
        got = run_kernel(q, k, v, cu, WINDOWS[window], 0.125, dout)
    finally:
        plan._layout.cache_clear()
    want = run_reference(q, k, v, cu, WINDOWS[window], 0.125, dout)
    for name, x, ref in zip(["out", "dq", "dk", "dv"], got[:1] + got[2:], want[:1] + want[2:], strict=True):
        assert rel_err(x, ref) < 1e-5, (name, rel_err(x, ref))


@pytest.mark.parametrize("out_used", [True, False], ids=["out-and-lse", "lse-only"])
def test_lse_gradient(out_used):
    """A gradient on lse beside out's, or alone: then out's reaches the backward as None."""
    q, k, v, cu = make_inputs(MIXES["edges"], 64, 4, 2, torch.float32)
    dout, dlse = (torch.randn(T, 4, 64) if out_used else None), torch.randn(4, T)
    got = run_kernel(q, k, v, cu, (20, 0), 0.125, dout, dlse)
    want = run_reference(q, k, v, cu, (20, 0), 0.125, dout, dlse)
    dq, dk, dv = got[2:]
    for x, ref in ((dq, want[2]), (dk, want[3])):
        assert rel_err(x, ref) < 1e-5
    if out_used:
        assert rel_err(dv, want[4]) < 1e-5
    else:  # lse does not depend on v
        assert want[4] is None and torch.equal(dv, torch.zeros_like(dv))


def test_unused_lse_gets_no_gradient_buffer(monkeypatch):
    """Where only out is used, the backward gets dlse None: no buffer of zeros allocated and read per call."""
    q, k, v, cu = make_inputs(MIXES["edges"], 64, 4, 2, torch.float32)
    seen = []

    def spy(dout, q, k, v, out, lse, dlse, *args):
        seen.append(dlse)
        return backward(dout, q, k, v, out, lse, dlse, *args)

    monkeypatch.setattr(op_module, "backward", spy)
    q.requires_grad_()
    flash_attn_varlen(q, k, v, cu, max(MIXES["edges"]), window_size=(20, 0)).sum().backward()
    assert len(seen) == 1 and seen[0] is None


@pytest.mark.parametrize("heads,kv_heads,d,rows", [(16, 16, 128, 64), (6, 2, 64, 128)])
def test_tma_descriptor_geometry_is_that_of_the_tensor(heads, kv_heads, d, rows):
    """The Gluon passes' descriptors take their ragged geometry from a cache made on a meta tensor: it is
    triton's for the real tensor, including views of a fused QKV projection (strides of the whole row)."""
    from triton.tools.ragged_tma import create_ragged_descriptor

    from kernels.attention.hopper import tma_descriptor

    qkv = torch.empty(80, (heads + 2 * kv_heads) * d, dtype=torch.bfloat16)
    q = qkv[:, : heads * d].view(80, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(80, kv_heads, d)
    for x in (q, k, torch.empty(80, heads, d, dtype=torch.float16)):
        got, want = tma_descriptor(x, rows), create_ragged_descriptor(x, [rows, 1, d])
        assert got.base is x
        assert (list(got.shape), list(got.strides), list(got.block_shape)) == (
            list(want.shape), list(want.strides), list(want.block_shape)
        )


def test_dispatch_modes_see_the_custom_ops():
    """Eager calls skip the ops' dispatch; under a dispatch mode (as tracing, fake tensors or a flop counter
    use) the forward and backward run as the custom ops, with the same results."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    q, k, v, cu = make_inputs(MIXES["edges"], 64, 4, 2, torch.float32)
    grads = []
    for mode in (None, Recorder()):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with mode if mode is not None else contextlib.nullcontext():
            out = flash_attn_varlen(*leaves, cu, max(MIXES["edges"]), window_size=(20, 0))
            out.square().sum().backward()
        grads.append([out.detach()] + [x.grad for x in leaves])
    assert {"varlen_gpt.flash_attn_varlen_fwd", "varlen_gpt.flash_attn_varlen_bwd"} <= mode.ops
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_strided_inputs_and_public_api():
    """q, k, v as views of one fused projection, through flash_attn_varlen with causal=True."""
    heads, kv_heads, d = 4, 2, 64
    qkv = torch.randn(T, (heads + 2 * kv_heads) * d, dtype=torch.float16)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q, k, v = q.view(T, heads, d), k.view(T, kv_heads, d), v.view(T, kv_heads, d)
    cu = cu_from(MIXES["random"])
    out = flash_attn_varlen(q, k, v, cu, max(MIXES["random"]), causal=True, window_size=(30, -1))
    ref, _ = attention_reference(q.double(), k.double(), v.double(), cu, causal=True, window_size=(30, -1))
    assert rel_err(out, ref) < TOL[torch.float16]


def test_unaligned_inputs_take_pointer_loads():
    """TMA needs 16-byte aligned bases and strides: inputs offset by one element fall back to pointer loads
    in the classes configured for TMA, with the same results."""
    heads, d = 2, 32
    flat = torch.randn(3 * T * heads * d + 1, dtype=torch.float16)
    q, k, v = (flat[1 + i * T * heads * d :][: T * heads * d].view(T, heads, d) for i in range(3))
    tma_blocks = block_config(d)["fwd"][0][1]
    assert tma_blocks.tma
    assert tma_descriptors(tma_blocks, 16, d, q, k) == (None, None)
    assert None not in tma_descriptors(tma_blocks, 16, d, q.clone(), k.clone())
    cu = cu_from(MIXES["edges"])
    dout = torch.randn(T, heads, d)
    got = run_kernel(q, k, v, cu, (-1, 0), d**-0.5, dout)
    want = run_reference(q, k, v, cu, (-1, 0), d**-0.5, dout)
    for x, ref in zip((got[0], *got[2:]), (want[0], *want[2:]), strict=True):  # out, dq, dk, dv
        assert rel_err(x, ref) < TOL[torch.float16]


def test_backward_is_deterministic():
    q, k, v, cu = make_inputs(MIXES["random"], 64, 4, 1, torch.float16)
    dout = torch.randn(T, 4, 64)
    first = run_kernel(q, k, v, cu, (-1, 0), 0.125, dout)
    second = run_kernel(q, k, v, cu, (-1, 0), 0.125, dout)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_compile_has_no_graph_break_and_no_recompile():
    """fullgraph=True traces through the custom ops' fake implementations; new document boundaries (same
    number of documents) and a new max_seqlen reuse the first graph. aot_eager also traces the backward.
    The compiled function shares one plan per window between two layers, as the model does; the eager one
    plans every call, and both give the same gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    n, d = 64, 64

    def loss_fn(q, k, v, cu_seqlens, max_seqlen, shared):
        plans = {
            w: flash_attn_plan(cu_seqlens, n, d, window_size=(w, 0)) if shared else None for w in (-1, 16)
        }
        x = q
        # Documents of up to 56 tokens take the stored-dS backward, the 64-token one the recomputing dQ pass.
        for w in (-1, 16, -1):
            x = flash_attn_varlen(x, k, v, cu_seqlens, max_seqlen, window_size=(w, 0), plan=plans[w])
        return x.float().square().sum()

    compiled = torch.compile(loss_fn, fullgraph=True, dynamic=False, backend=counter)
    for lengths in ([10, 20, 34, 0], [5, 1, 34, 10], [n, 0, 0, 0]):
        cu = cu_from(lengths)
        q, k, v = (torch.randn(n, h, d, dtype=torch.float16, requires_grad=True) for h in (2, 1, 1))
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled(q, k, v, cu, max(lengths), True).backward()
        grads = [x.grad for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        loss_fn(q, k, v, cu, max(lengths), False).backward()
        assert all(torch.equal(g, x.grad) for g, x in zip(grads, (q, k, v), strict=True))
    assert counter.frame_count == 1


def test_plan_bounded_by_max_seqlen_skips_the_longer_classes():
    """Documents of at most 24 tokens and a tail of 120: a plan bounded by max_seqlen=24 launches none of
    the interpreter config's classes above 24 (40 for the forward, 56 for dK/dV), so it is smaller, yet it
    gives the same outputs and gradients bitwise, the tail's zeros included, and they match float64. A
    document longer than the bound is refused."""
    lengths = [24, 3, 17, 0, 24, 1, 3]
    q, k, v, cu = make_inputs(lengths, 32, 2, 1, torch.float16)
    dout = torch.randn(T, 2, 32)

    def run(max_seqlen):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        plan = flash_attn_plan(cu, T, 32, window_size=(-1, 0), max_seqlen=max_seqlen)
        out = flash_attn_varlen(*x, cu, 24, window_size=(-1, 0), plan=plan)
        (out.float() * dout).sum().backward()
        return plan, [out.detach(), *(t.grad for t in x)]

    bounded, got = run(24)
    unbounded, want = run(None)
    assert bounded.max_seqlen == 24 and unbounded.max_seqlen == T
    assert bounded.tables.numel() < unbounded.tables.numel()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all((x[sum(lengths) :] == 0).all() for x in got)
    ref = run_reference(q, k, v, cu, (-1, 0), 32**-0.5, dout)
    for x, r in zip(got, (ref[0], *ref[2:]), strict=True):
        assert rel_err(x, r) < TOL[torch.float16]
    with pytest.raises(RuntimeError, match="a document is longer than max_seqlen=23"):
        flash_attn_plan(cu, T, 32, window_size=(-1, 0), max_seqlen=23)
    with pytest.raises(ValueError, match="max_seqlen must be positive"):
        flash_attn_plan(cu, T, 32, max_seqlen=0)


@pytest.mark.parametrize("left", [65536, 512], ids=["past", "w512"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_plan_feeds_the_gluon_backward_what_it_needs(left, head_dim, monkeypatch):
    """The launches of a Hopper GPU at head dims 64 and 128 (the interpreter runs other blocks, and no
    Gluon): the dK/dV pass, which there also writes dQ, takes every document, in query blocks of 8,192
    elements (the only ones it runs); it must list each document's key tiles from the last to the first
    (its dQ adds wait for the tiles after them, which must have started), and delta, which it reads, and the
    dQ table of the same documents, from which its float32 sums are scaled into dQ, must come before it.
    Other GPUs run the Triton passes: at 128 they store the short documents' dS for a dQ pass of its own."""
    monkeypatch.setattr(block_sizes, "INTERPRET", False)
    config = block_sizes.block_config(head_dim, on_hopper=True)
    assert plan.fused_shortest(config, right=0) == 0
    launches = plan._launches(config, 65536, 65536, left, 0)
    kernels = [launch.kernel for launch in launches]
    assert "dq_stored" not in kernels
    gluon = [i for i, launch in enumerate(launches) if launch.kernel == "dkdv" and launch.blocks.gluon]
    assert gluon == [kernels.index("dkdv")] and kernels.count("dkdv") == 1
    assert launches[gluon[0]].last_block_first and launches[gluon[0]].blocks.m * head_dim == 8192
    # Its documents run longest first without a window, in their own order under one.
    assert launches[gluon[0]].longest_first == (left == 65536)
    assert not any(launch.longest_first for launch in launches if launch.kernel != "dkdv")
    assert (launches[gluon[0]].shortest, launches[gluon[0]].longest) == (0, 65536)
    delta = kernels.index("delta")
    assert (launches[delta].shortest, launches[delta].longest) == (0, 65536) and delta < gluon[0]
    dq = kernels.index("dq")
    assert kernels.count("dq") == 1 and dq < gluon[0]
    assert (launches[dq].shortest, launches[dq].longest) == (0, 65536)
    # Two-sided windows have no Gluon pass, and their dQ pass writes delta.
    assert plan.fused_shortest(config, right=64) is None
    other = block_sizes.block_config(head_dim, on_hopper=False)
    assert plan.fused_shortest(other, right=0) is None
    other_kernels = [launch.kernel for launch in plan._launches(other, 65536, 65536, left, 0)]
    assert ("dq_stored" in other_kernels) == (head_dim == 128) and "dq" in other_kernels


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("window", ["causal", "sliding"])
def test_triton_forward_runs_tiles_of_several_blocks(window, tma, monkeypatch):
    """A forward class whose tiles are not a power of two (on Hopper, 192 query rows for three warpgroups)
    runs in the Triton kernel as programs of the largest power-of-two divisor: here 48-row tiles as three
    16-row programs each, against float64."""
    config = dict(block_sizes.block_config(64))
    config["fwd"] = [(None, block_sizes.Blocks(48, 16, 4, 1, tma))]
    monkeypatch.setattr(block_sizes, "block_config", lambda head_dim, on_hopper=False: config)
    q, k, v, cu = make_inputs(MIXES["random"], 64, 4, 2, torch.float16)
    out, lse = forward_op(q, k, v, cu, WINDOWS[window], 0.125)
    ref_out, ref_lse, *_ = run_reference(q, k, v, cu, WINDOWS[window], 0.125, torch.zeros(T, 4, 64))
    assert rel_err(out, ref_out) < TOL[torch.float16]
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite)
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-4


@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_forward_classes_are_gluon_tiles_of_64_row_parts(head_dim, monkeypatch):
    """The forward launches of a Hopper GPU: every class runs the Gluon kernel on 128-key blocks with a
    warpgroup (4 warps) per 64 query rows; at head dim 64 documents longer than 2,048 tokens take 192-row
    tiles, which a plan bounded by a max_seqlen of 2,048 does not launch."""
    monkeypatch.setattr(block_sizes, "INTERPRET", False)
    config = block_sizes.block_config(head_dim, on_hopper=True)
    launches = [launch for launch in plan._launches(config, 65536, 65536, 65536, 0) if launch.kernel == "fwd"]
    for launch in launches:
        b = launch.blocks
        assert b.gluon and b.tma and b.n == 128 and b.m in (128, 192) and b.warps == b.m // 16, b
        assert launch.block == b.m and launch.last_block_first
    rows = [(launch.shortest, launch.blocks.m) for launch in launches]
    assert rows == ([(0, 128), (2048, 192)] if head_dim == 64 else [(0, 128)])
    bounded = [launch for launch in plan._launches(config, 65536, 2048, 65536, 0) if launch.kernel == "fwd"]
    assert [launch.blocks.m for launch in bounded] == [128]


def test_plan_that_does_not_fit_the_call_is_refused():
    q, k, v, cu = make_inputs(MIXES["edges"], 64, 2, 1, torch.float16)
    plan = flash_attn_plan(cu, T, 64, window_size=(24, 0))
    assert torch.equal(
        flash_attn_varlen(q, k, v, cu, 63, window_size=(24, 0), plan=plan),
        flash_attn_varlen(q, k, v, cu, 63, window_size=(24, 0)),
    )
    with pytest.raises(ValueError, match="plan was made for 192 tokens, head dim 64, window \\(24, 0\\)"):
        flash_attn_varlen(q, k, v, cu, 63, window_size=(-1, 0), plan=plan)
    with pytest.raises(ValueError, match="head dim 64"):
        flash_attn_varlen(q[..., :32], k[..., :32], v[..., :32], cu, 63, window_size=(24, 0), plan=plan)
    more_docs = cu_from(MIXES["edges"] + [0])
    with pytest.raises(ValueError, match="was not made for this call: 192 tokens, 10 documents"):
        flash_attn_varlen(q, k, v, more_docs, 63, window_size=(24, 0), plan=plan)


@pytest.mark.parametrize("window", list(WINDOWS.values()), ids=list(WINDOWS))
def test_attention_masked_matches_reference(window):
    q, k, v, cu = make_inputs(MIXES["edges"], 32, 4, 2, torch.float64)
    got = attention_masked(q, k, v, cu, causal=False, window_size=window)
    want, _ = attention_reference(q, k, v, cu, causal=False, window_size=window)
    assert rel_err(got, want) < 1e-12
