"""The weight-gradient product g^T x (kernels/fused/wgrad_hopper.py). Anywhere (Triton's interpreter without a
GPU): its schedule covers every K-step of every tile once, with workspace slots of their own, and its
reduction sums partial tiles (here computed with torch) into the product. On Hopper: the Gluon kernel against
a float64 product, at training sizes and ragged ones, and bitwise the same from run to run."""

import pytest
import torch
import triton
import triton.language as tl

from kernels.fused import wgrad_hopper as wh

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _schedule_kernel(Seg, P, ks, q, q2, R, S, max_seg, split_slots, I0, TB, WIDTH: tl.constexpr):
    """Row p of Seg: program p's number of segments, then (tile, kb, ke, slot) of each, as the kernel
    walks them."""
    p = tl.program_id(0)
    plan = (P, q, q2, R, S, ks, max_seg, split_slots, I0, TB)
    n, lo, hi, first = wh._segments(p, plan)
    row = Seg + p * WIDTH
    tl.store(row, n)
    for s in range(n):
        tile, kb, ke, slot = wh._segment(s, p, lo, hi, first, plan)
        tl.store(row + 1 + 4 * s, tile)
        tl.store(row + 2 + 4 * s, kb)
        tl.store(row + 3 + 4 * s, ke)
        tl.store(row + 4 + 4 * s, slot)


def segments(plan: wh.Plan) -> list[list[tuple[int, int, int, int]]]:
    """Each program's segments (tile, first K-step, end K-step, slot), from the kernel's helpers."""
    width = 1 + 4 * (plan.dp_waves + plan.split_waves + plan.max_seg)
    seg = torch.full((plan.programs, width), -7, dtype=torch.int32, device=DEVICE)
    ks, q, q2, R, S, max_seg, split_slots, I0, TB = wh.plan_args(plan)
    _schedule_kernel[(plan.programs,)](
        seg, plan.programs, ks, q, q2, R, S, max_seg, split_slots, I0, TB, WIDTH=width
    )
    rows = seg.tolist()
    return [[tuple(row[1 + 4 * s : 5 + 4 * s]) for s in range(row[0])] for row in rows]


def check_schedule(M, N, K, sms, **kwargs) -> tuple[wh.Plan, list]:
    """The plan's segments cover each K-step of each tile once, whole tiles alone go straight to C, the
    others to distinct slots in the workspace, and the programs' K-steps differ by little."""
    plan = wh.make_plan(M, N, K, sms, **kwargs)
    n_tiles = triton.cdiv(M, wh.BM) * triton.cdiv(N, wh.BN)
    ks = plan.k_steps
    lanes = segments(plan)
    covered = torch.zeros(n_tiles, ks, dtype=torch.int32)
    slots, direct = [], []
    for lane in lanes:
        for tile, kb, ke, slot in lane:
            assert 0 <= tile < n_tiles and 0 <= kb < ke <= ks, (tile, kb, ke)
            covered[tile, kb:ke] += 1
            if slot < 0:
                assert (kb, ke) == (0, ks)
                direct.append(tile)
            else:
                slots.append(slot)
    assert bool((covered == 1).all()), "each K-step of each tile exactly once"
    assert len(set(slots)) == len(slots) and all(0 <= s < plan.slots for s in slots)
    # A tile written straight to C has no partials.
    partial_tiles = {tile for lane in lanes for tile, _, _, slot in lane if slot >= 0}
    assert not partial_tiles & set(direct)
    steps = [sum(ke - kb for _, kb, ke, _ in lane) for lane in lanes]
    assert max(steps) - min(steps) <= plan.split_waves + 1, steps
    return plan, lanes


@pytest.mark.parametrize(
    "M, N, K, sms",
    [
        (5120, 1280, 65536, 132),
        (3072, 768, 65536, 132),
        (768, 768, 65536, 132),
        (1280, 1280, 65536, 132),
        (6144, 1536, 65536, 132),
        (1536, 1536, 65536, 132),
        (5120, 1280, 8192, 78),
        (200, 136, 1000, 132),
        (200, 136, 64, 132),
        (200, 136, 65, 132),
        (4096, 4096, 4096, 132),
    ],
)
def test_schedule_covers_every_step_once(M, N, K, sms):
    plan, _ = check_schedule(M, N, K, sms)
    # The workspace stays small: a few partial tiles a program.
    assert plan.split_waves <= wh.MAX_SPLIT_WAVES and plan.max_seg <= 2, plan


@pytest.mark.parametrize("split", [1, 2, 3, 7])
@pytest.mark.parametrize("sms", [3, 7, 16, 40])
def test_schedule_with_forced_splits(sms, split):
    check_schedule(640, 768, 64 * 50 + 5, sms, split=split)


@pytest.mark.parametrize("sms", [2, 7, 16, 40, 1000])
def test_plain_stream_k_schedule(sms):
    check_schedule(640, 768, 64 * 50 + 5, sms, stream_k_only=True)


@pytest.mark.parametrize(
    "M, N, K, sms, kwargs",
    [
        (640, 768, 64 * 50 + 5, 7, {}),  # whole tiles and a wave of pieces
        (640, 768, 64 * 50 + 5, 132, dict(programs=16, split=3)),  # pieces and stream-K
        (640, 768, 64 * 50 + 5, 132, dict(programs=14, split=15)),  # stream-K with idle programs
        (300, 520, 64 * 9, 132, dict(programs=40)),  # many programs a tile
        (300, 520, 64 * 9, 5, dict(stream_k_only=True)),  # some tiles whole from one segment
        (300, 520, 64 * 9, 132, dict(programs=40, stream_k_only=True)),
        (128, 256, 64 * 3, 4, dict(split=2)),  # one tile
    ],
)
def test_reduction_sums_partials_in_schedule_order(M, N, K, sms, kwargs):
    """The GEMM kernel's stores emulated with torch (each segment's partial product), then the reduction."""
    plan, lanes = check_schedule(M, N, K, sms, **kwargs)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(K, M, generator=gen, dtype=torch.float64)
    x = torch.randn(K, N, generator=gen, dtype=torch.float64)
    # Zero rows and columns past the edges, as TMA fills them.
    gp = torch.zeros(plan.k_steps * wh.BK, triton.cdiv(M, wh.BM) * wh.BM, dtype=torch.float64)
    xp = torch.zeros(plan.k_steps * wh.BK, triton.cdiv(N, wh.BN) * wh.BN, dtype=torch.float64)
    gp[:K, :M], xp[:K, :N] = g, x
    out = torch.full((M, N), float("nan"), dtype=torch.float32)
    outp = torch.full((gp.shape[1], xp.shape[1]), float("nan"), dtype=torch.float32)
    part = torch.full((max(plan.slots, 1), wh.BM, wh.BN), float("nan"), dtype=torch.float32)
    n_tiles_n = triton.cdiv(N, wh.BN)
    for lane in lanes:
        for tile, kb, ke, slot in lane:
            m0, n0 = tile // n_tiles_n * wh.BM, tile % n_tiles_n * wh.BN
            ks = slice(kb * wh.BK, ke * wh.BK)
            acc = (gp[ks, m0 : m0 + wh.BM].t() @ xp[ks, n0 : n0 + wh.BN]).float()
            if slot < 0:
                outp[m0 : m0 + wh.BM, n0 : n0 + wh.BN] = acc
            else:
                part[slot] = acc
    out.copy_(outp[:M, :N])
    out, part = out.to(DEVICE), part.to(DEVICE)
    wh.reduce_partials(plan, part, out)
    ref = g.t() @ x
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-4)


def test_shape_errors_raise_before_cuda():
    g = torch.zeros(64, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="expected"):
        wh.weight_grad(g, torch.zeros(65, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="expected"):
        wh.weight_grad(g, torch.zeros(64, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="expected"):
        wh.weight_grad(g[None], torch.zeros(64, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out_dtype"):
        wh.weight_grad(g, torch.zeros(64, 16, dtype=torch.bfloat16), torch.int32)
    x = torch.zeros(64, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="M a multiple of 128"):  # a tile would straddle g and g2
        wh.weight_grad(g, x, g2=torch.zeros(64, 128, dtype=torch.bfloat16))
    g = torch.zeros(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"expected \[K, M\] and \[K, M2\]"):  # g2 over other tokens
        wh.weight_grad(g, x, g2=torch.zeros(63, 8, dtype=torch.bfloat16))


def test_two_sources_on_cpu_take_one_product_each():
    """kernels/fused/products.py's chooser off Hopper: [g | g2]^T x as two products, against float64."""
    from kernels.fused.products import weight_grad

    gen = torch.Generator().manual_seed(0)
    g, g2, x = (torch.randn(50, n, generator=gen) for n in (24, 8, 12))
    ref = torch.cat([g, g2], dim=1).double().t() @ x.double()
    torch.testing.assert_close(weight_grad(g, x, g2).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight_grad(g, x).double(), ref[:24], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# On Hopper: the Gluon kernel.
# ---------------------------------------------------------------------------------------------------------


def inputs(K, M, N, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g = torch.randn(K, M, device="cuda", generator=gen).to(dtype)
    x = torch.randn(K, N, device="cuda", generator=gen).to(dtype)
    return g, x


def rel_error(out, g, x):
    ref = g.double().t() @ x.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def bound(out_dtype, K):
    """Relative Frobenius error allowed: rounding the output to bf16 (8 bits) leaves ~2e-3, to fp16 ~3e-4;
    the fp32 sums of K products (exact in fp32) ~6e-8 sqrt(K) with random signs, allowed a few times that."""
    return {torch.bfloat16: 5e-3, torch.float16: 1e-3}.get(out_dtype, 4e-7 * K**0.5 + 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("M, N", [(3072, 768), (768, 768), (5120, 1280), (1280, 1280), (6144, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_training_shapes(M, N, dtype):
    g, x = inputs(8192, M, N, dtype)
    assert wh.supported(g, x)
    for out_dtype in (dtype, torch.float32):
        out = wh.weight_grad(g, x, out_dtype)
        assert out.shape == (M, N) and out.dtype == out_dtype
        assert rel_error(out, g, x) < bound(out_dtype, 8192), (M, N, out_dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize(
    "K, M, N", [(1000, 200, 136), (64, 200, 136), (65, 200, 136), (1, 8, 8), (4096, 8, 264)]
)
@pytest.mark.parametrize(
    "kwargs", [{}, dict(programs=3), dict(split=3, programs=5), dict(stream_k_only=True)]
)
def test_ragged_shapes(K, M, N, kwargs):
    g, x = inputs(K, M, N, torch.bfloat16)
    out = wh.weight_grad(g, x, torch.float32, **kwargs)
    assert rel_error(out, g, x) < bound(torch.float32, K), (K, M, N, kwargs)
    out = wh.weight_grad(g, x, **kwargs)
    assert rel_error(out, g, x) < bound(torch.bfloat16, K), (K, M, N, kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("kwargs", [{}, dict(split=1), dict(split=5), dict(stream_k_only=True)])
def test_schedules_agree_at_full_depth(kwargs):
    """(5120, 1280) over 65,536 tokens: each schedule (data-parallel, split, stream-K phases) is right."""
    g, x = inputs(65536, 5120, 1280, torch.bfloat16)
    out = wh.weight_grad(g, x, torch.float32, **kwargs)
    assert rel_error(out, g, x) < bound(torch.float32, 65536), kwargs
    assert rel_error(wh.weight_grad(g, x, **kwargs), g, x) < bound(torch.bfloat16, 65536), kwargs


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("K, M, N", [(65536, 5120, 1280), (8192, 768, 768), (1000, 200, 136)])
def test_deterministic(K, M, N):
    g, x = inputs(K, M, N, torch.bfloat16, seed=1)
    for out_dtype in (torch.bfloat16, torch.float32):
        first = wh.weight_grad(g, x, out_dtype)
        for _ in range(2):
            assert torch.equal(wh.weight_grad(g, x, out_dtype), first), out_dtype


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
def test_strided_rows():
    """Row-major views with padded rows (16-byte aligned strides) read only their own columns."""
    base = torch.randn(512, 400, device="cuda").to(torch.bfloat16)
    g, x = base[:, :200], base[:, 208:344]
    assert wh.supported(g, x)
    assert rel_error(wh.weight_grad(g, x, torch.float32), g, x) < bound(torch.float32, 512)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize(
    "K, M1, M2, N",
    [(65536, 2560, 1280, 1280), (65536, 1536, 768, 768), (8192, 1024, 256, 768), (1000, 128, 72, 136)],
)
def test_two_sources(K, M1, M2, N):
    """[g | g2]^T x from two tensors: bitwise the product over their joined copy (the same schedule sums
    the same blocks), and within rounding of float64; `preferred` takes every such shape of whole tiles."""
    g, x = inputs(K, M1 + M2, N, torch.bfloat16, seed=2)
    g1, g2 = g[:, :M1].contiguous(), g[:, M1:].contiguous()
    for out_dtype in (torch.bfloat16, torch.float32):
        out = wh.weight_grad(g1, x, out_dtype, g2=g2)
        assert out.shape == (M1 + M2, N)
        assert torch.equal(out, wh.weight_grad(g, x, out_dtype)), out_dtype
        assert rel_error(out, g, x) < bound(out_dtype, K), out_dtype
    assert wh.preferred(g1, x, g2) == (K >= wh.MIN_TOKENS and (M1 + M2) % wh.BM == 0 and N % wh.BN == 0)
