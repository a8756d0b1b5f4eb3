"""Weight gradients C = G^T X over all tokens: a persistent, warp-specialised matmul in Gluon for Hopper,
balanced across the SMs by stream-K and deterministic.

G [K, M] and X [K, N] are row-major activations or their gradients over K tokens (65,536 in training), so
C [M, N] is small next to the depth of its sum. In 128 x 256 tiles the MLP's products at width 1280 have 200
tiles for 132 SMs: 1.5 waves, of which cuBLAS leaves the second half empty. Here every program (one per SM)
runs the same number of K-steps (BK tokens each), the fp32 partial sums of tiles shared between programs go
to a workspace, and a second kernel adds them up in a fixed order: no atomics, bitwise the same every run.

Plain stream-K (program p takes K-steps [p T / P, (p + 1) T / P) of the tiles laid end to end) starts the
programs at scattered depths of K, and at K = 65,536 that costs the L2 its reuse: the programs running side
by side read the same blocks of G and X only if they are at the same depth at the same time, and without
that the loads (48 KB a K-step and SM) ask for more than the HBM gives. So the work comes in three phases,
the first two in lockstep across the programs:
- whole tiles, one wave after another (tile p + w P), written straight to C (as a data-parallel GEMM);
- the R tiles left over, each cut into S pieces along K (piece-major: unit c R + r is piece c of tile r):
  whole waves of units (unit p + w P), each unit's fp32 sum to a workspace slot of its own;
- the units left after that are shared out stream-K, in K-steps: each program's last few dozen steps, at
  scattered depths, with at most max_seg segments a program (a workspace slot each).
S is chosen per shape (`_choose_split`) to keep the last phase short without too many partial tiles; a
phase may be empty. Each output tile that was not written whole is then summed by `_reduce_kernel`: its
pieces in order of K, each piece's stream-K segments in program order. Where the stream-K phase covers a
whole tile with one segment (S = 1), that segment goes straight to C too.

G may also lie in two tensors, [G1 | G2] with G1's width a multiple of BM, so that each tile reads one of
them: attention's q/k/v operator (qkv.py) takes its three weight gradients from dh and dv so,
where cuBLAS would need them copied side by side first.

Three partitions, as in gemm_hopper.py: a load warp streams each segment's blocks of G (two [BK, 64]
blocks, one per warpgroup) and X ([BK, 256]) by TMA into a ring of STAGES slots, running on into the next
segment while the warpgroups store the last; two warpgroups own 64 rows of M each and accumulate with
asynchronous products, one in flight. G's blocks are M-major for the product (a permuted view in shared
memory; wgmma reads 16-bit operands either way). The segments' sums are stored from registers. Both the
kernel and the reduction walk the schedule with the same scalar helpers (`_segments`, `_segment`,
`_unit`), which the CPU tests run in Triton's interpreter.
"""

from functools import cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from kernels.common import max_registers, sm_count
from kernels.fused import gemm_hopper
from kernels.fused.gemm_hopper import descriptor, tma_load

# Block choice, the one place it is made: 128 x 256 output tiles (two warpgroups of 64 rows; a [64, 256]
# fp32 accumulator is 128 registers a thread), 64 tokens a K-step, 4 ring slots of 48 KB (G 2 x 8 KB, X 32
# KB): 192 KB, with no output buffer (the sums are stored from registers).
BM, BN, BK, STAGES = 128, 256, 64, 4
WARPS = 4
# Two warpgroups and the load warp: 168 registers a thread, shared out as 240 / 240 / 24.
MAX_REGISTERS = max_registers(3)
# Rows of a tile that one program of the reduction sums: many small programs keep more loads in flight (on
# an H200 at [5120, 1280], 30 us with 8 rows against 47 us with 32).
REDUCE_ROWS = 8
# The choice of S (pieces a left-over tile is cut into), in K-steps of a program's time: a stream-K step,
# at scattered depth, costs MISALIGNED_COST more than one in lockstep; writing a partial tile and reading
# it back costs FLUSH_STEPS. Rough: on an H200 at [5120, 1280] x 65,536 tokens every S whose stream-K
# phase is short (2, 4, 6, 8, 16) measured within 10% of the others, and S = 1 or 3 (hundreds of stream-K
# steps) 10-30% slower. S at most MAX_SPLIT, with at most MAX_SPLIT_WAVES waves of units (the workspace:
# P (waves + 2) tiles of 128 KB).
MISALIGNED_COST, FLUSH_STEPS, MAX_SPLIT, MAX_SPLIT_WAVES = 0.7, 14, 16, 4
# Fewer programs than SMs where each would run fewer K-steps than this (small products).
MIN_PROGRAM_STEPS = 2 * FLUSH_STEPS
# Tokens below which `preferred` leaves the product to cuBLAS: at [5120, 1280] it was 10% faster at 65,536
# and 32,768 tokens, even at 16,384.
MIN_TOKENS = 32768


# ---------------------------------------------------------------------------------------------------------
# The schedule: scalar helpers shared by the Gluon kernel, the reduction and (interpreted) the tests.
# plan = (P, q, q2, R, S, ks, max_seg, split_slots, I0, TB): P programs; q waves of whole tiles; q2 waves of
# units; R left-over tiles of S pieces; ks K-steps a tile; max_seg stream-K segments a program at most;
# split_slots workspace slots of the unit waves; stream-K over iterations [I0, I0 + TB) of the units'
# piece-major order (piece c of all R tiles, then piece c + 1; K-steps innermost).
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _unit(u, R, ks, S):
    """Unit u = piece u // R of left-over tile u % R: (that tile, its first and end K-step, the unit's first
    iteration in piece-major order). Piece c covers K-steps [c ks / S, (c + 1) ks / S)."""
    c = u // R
    r = u - c * R
    kb = c * ks // S
    ke = (c + 1) * ks // S
    return r, kb, ke, R * kb + r * (ke - kb)


@triton.jit
def _unit_at(i, R, ks, S):
    """The unit holding iteration i of the piece-major order."""
    # Piece c spans iterations [R kb(c), R kb(c + 1)): i // R is a K-step of piece c.
    c = ((i // R + 1) * S - 1) // ks
    kb = c * ks // S
    ke = (c + 1) * ks // S
    return c * R + (i - R * kb) // (ke - kb)


@triton.jit
def _lane_start(p, P, TB):
    """floor(p TB / P): the first stream-K iteration of program p (relative to I0), without overflow."""
    return p * (TB // P) + p * (TB % P) // P


@triton.jit
def _segments(p, plan):
    """Program p's number of segments, its stream-K iterations [lo, hi) and the unit it starts them in."""
    P, q, q2, R, S, ks, max_seg, split_slots, I0, TB = plan
    lo = I0 + _lane_start(p, P, TB)
    hi = I0 + _lane_start(p + 1, P, TB)
    n = p * 0 + q + q2
    first = p * 0
    if hi > lo:
        first = _unit_at(lo, R, ks, S)
        n += _unit_at(hi - 1, R, ks, S) - first + 1
    return n, lo, hi, first


@triton.jit
def _segment(s, p, lo, hi, first, plan):
    """Segment s of program p: (tile, first and end K-step, workspace slot or -1 for straight to C).
    Never empty."""
    P, q, q2, R, S, ks, max_seg, split_slots, I0, TB = plan
    tile = p + s * P
    kb = s * 0
    ke = kb + ks
    slot = kb - 1
    if s >= q:
        if s < q + q2:
            u = p + (s - q) * P
            r, kb, ke, start = _unit(u, R, ks, S)
            tile = q * P + r
            if S > 1:
                slot = u
        else:
            j = s - q - q2
            r, ukb, uke, start = _unit(first + j, R, ks, S)
            a = start
            if lo > a:
                a = lo
            b = start + uke - ukb
            if hi < b:
                b = hi
            kb = ukb + a - start
            ke = ukb + b - start
            tile = q * P + r
            slot = split_slots + p * max_seg + j
            if S == 1:
                if kb == 0:
                    if ke == ks:
                        slot = kb - 1
    return tile, kb, ke, slot


# ---------------------------------------------------------------------------------------------------------
# The Gluon kernel.
# ---------------------------------------------------------------------------------------------------------


@gluon.jit
def _load_partition(args):
    """One warp: the blocks of G and X of every K-step of this program's segments, slot after slot."""
    g_desc, g2_desc, x_desc, Out, Part, a_smem, b_smem, ready, free, M, M1, N, n_tiles_n, plan = args
    BKc: gl.constexpr = g_desc.block_type.shape[0]
    HALF: gl.constexpr = g_desc.block_type.shape[1]
    BNc: gl.constexpr = x_desc.block_type.shape[1]
    NS: gl.constexpr = b_smem.type.shape[0]
    p = gl.program_id(0)
    n_seg, lo, hi, first = _segments(p, plan)
    j = 0
    for s in range(n_seg):
        tile, kb, ke, slot = _segment(s, p, lo, hi, first, plan)
        m0 = (tile // n_tiles_n) * (2 * HALF)
        n0 = (tile % n_tiles_n) * BNc
        for kk in range(kb, ke):
            st = j % NS
            # A slot's first use waits on phase 1, which a fresh mbarrier counts as complete.
            mbarrier.wait(free.index(st), ((j // NS) & 1) ^ 1)
            mbarrier.expect(ready.index(st), 2 * g_desc.block_type.nbytes + x_desc.block_type.nbytes)
            k0 = kk * BKc
            if m0 < M1:
                tma_load(g_desc, [k0, m0], ready.index(st), a_smem.index(2 * st))
                tma_load(g_desc, [k0, m0 + HALF], ready.index(st), a_smem.index(2 * st + 1))
            else:
                tma_load(g2_desc, [k0, m0 - M1], ready.index(st), a_smem.index(2 * st))
                tma_load(g2_desc, [k0, m0 - M1 + HALF], ready.index(st), a_smem.index(2 * st + 1))
            tma_load(x_desc, [k0, n0], ready.index(st), b_smem.index(st))
            j += 1


@gluon.jit
def _mma_partition(args, WG: gl.constexpr):
    """Warpgroup WG: rows 64 WG .. 64 WG + 63 of each segment's tile, summed over its K-steps and stored
    to C (masked, in C's dtype) or to its workspace slot (fp32, whole)."""
    g_desc, g2_desc, x_desc, Out, Part, a_smem, b_smem, ready, free, M, M1, N, n_tiles_n, plan = args
    HALF: gl.constexpr = g_desc.block_type.shape[1]
    BNc: gl.constexpr = x_desc.block_type.shape[1]
    NS: gl.constexpr = b_smem.type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BNc, 16])
    p = gl.program_id(0)
    n_seg, lo, hi, first = _segments(p, plan)
    rows = gl.arange(0, HALF, layout=gl.SliceLayout(1, mma))
    cols = gl.arange(0, BNc, layout=gl.SliceLayout(0, mma))
    j = 0
    for s in range(n_seg):
        tile, kb, ke, slot = _segment(s, p, lo, hi, first, plan)
        acc = gl.zeros([HALF, BNc], gl.float32, mma)
        for kk in range(kb, ke):
            st = j % NS
            mbarrier.wait(ready.index(st), (j // NS) & 1)
            # G's block [BK, 64] read M-major: the product's [64, BK] operand.
            a = a_smem.index(2 * st + WG).permute((1, 0))
            acc = warpgroup_mma(a, b_smem.index(st), acc, is_async=True)
            # One product stays in flight: the previous one is done reading its slot.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if kk > kb:
                mbarrier.arrive(free.index((j - 1) % NS), count=1)
            j += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(free.index((j - 1) % NS), count=1)
        if slot < 0:
            r = (tile // n_tiles_n) * (2 * HALF) + WG * HALF + rows
            c = (tile % n_tiles_n) * BNc + cols
            ptrs = Out + r.to(gl.int64)[:, None] * N + c[None, :]
            gl.store(ptrs, acc.to(Out.dtype.element_ty), mask=(r[:, None] < M) & (c[None, :] < N))
        else:
            base = Part + slot.to(gl.int64) * (2 * HALF * BNc)
            gl.store(base + (WG * HALF + rows)[:, None] * BNc + cols[None, :], acc)


@gluon.jit
def _second_mma_partition(args):
    _mma_partition(args, 1)


@gluon.jit
def _wgrad_kernel(g_desc, g2_desc, x_desc, Out, Part, M, M1, N, n_tiles_n, ks, q, q2, R, S, max_seg,
                  split_slots, I0, TB, STAGES: gl.constexpr):
    a_smem = gl.allocate_shared_memory(g_desc.dtype, [2 * STAGES] + g_desc.block_type.shape, g_desc.layout)
    b_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)  # both warpgroups read every slot
    plan = (gl.num_programs(0), q, q2, R, S, ks, max_seg, split_slots, I0, TB)
    args = (g_desc, g2_desc, x_desc, Out, Part, a_smem, b_smem, ready, free, M, M1, N, n_tiles_n, plan)
    gl.warp_specialize([
        (_mma_partition, (args, 0)),
        (_second_mma_partition, (args, )),
        (_load_partition, (args, )),
    ], [4, 1], [240, 24])


# ---------------------------------------------------------------------------------------------------------
# The reduction.
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _owner(i, P, TB):
    """The program whose stream-K iterations hold i (relative to I0): the last p with lane_start(p) <= i."""
    return (((i.to(tl.int64) + 1) * P - 1) // TB).to(tl.int32)


@triton.jit
def _reduce_kernel(Part, Out, M, N, n_tiles_n, P, ks, q, q2, R, S, max_seg, split_slots, I0, TB,
                   BM: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr):
    """Rows ROWS (pid % (BM / ROWS)) .. of left-over tile pid // (BM / ROWS): the sum of its partial tiles,
    pieces in order, each piece's stream-K segments in program order, to C unless written there whole."""
    plan = (P, q, q2, R, S, ks, max_seg, split_slots, I0, TB)
    pid = tl.program_id(0)
    r = pid // (BM // ROWS)
    tile = q * P + r
    rows = (pid % (BM // ROWS)) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BN)
    offs = rows[:, None] * BN + cols[None, :]
    acc = tl.zeros([ROWS, BN], tl.float32)
    whole = r * 0  # the tile went to C from one segment
    for c in range(S):
        u = c * R + r
        if u < q2 * P:
            if S == 1:
                whole = r * 0 + 1
            else:
                acc += tl.load(Part + u.to(tl.int64) * (BM * BN) + offs)
        else:
            _, kb, ke, start = _unit(u, R, ks, S)
            a = start - I0
            first = _owner(a, P, TB)
            last = _owner(a + ke - kb - 1, P, TB)
            if (S == 1) & (first == last):
                whole = r * 0 + 1
            else:
                for p in range(first, last + 1):
                    n, lo, hi, p_first = _segments(p, plan)
                    if hi > lo:  # programs with no stream-K work own no iterations
                        slot = split_slots + p * max_seg + u - p_first
                        acc += tl.load(Part + slot.to(tl.int64) * (BM * BN) + offs)
    if whole == 0:
        m = (tile // n_tiles_n) * BM + rows
        n = (tile % n_tiles_n) * BN + cols
        mask = (m[:, None] < M) & (n[None, :] < N)
        tl.store(Out + m.to(tl.int64)[:, None] * N + n[None, :], acc.to(Out.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# The host side.
# ---------------------------------------------------------------------------------------------------------


class Plan(NamedTuple):
    """The schedule of one product (see the module's docstring); `slots`: workspace tiles of BM x BN fp32."""

    programs: int
    dp_waves: int  # q
    split_waves: int  # q2
    rest: int  # R
    split: int  # S
    k_steps: int  # ks
    max_seg: int
    split_slots: int
    sk_start: int  # I0
    sk_iters: int  # TB
    slots: int


def _unit_span(u: int, R: int, ks: int, S: int) -> tuple[int, int]:
    """First iteration and length of unit u (as `_unit`)."""
    c, r = divmod(u, R)
    kb, ke = c * ks // S, (c + 1) * ks // S
    return R * kb + r * (ke - kb), ke - kb


def _phases(n_tiles: int, ks: int, P: int, S: int, dp: bool, split_waves: bool) -> tuple[int, ...]:
    """(q, R, q2, I0, TB) for S pieces a left-over tile."""
    q = n_tiles // P if dp else 0
    R = n_tiles - q * P
    q2 = R * S // P if split_waves else 0
    I0 = _unit_span(q2 * P, R, ks, S)[0] if q2 * P < R * S else R * ks
    return q, R, q2, I0, R * ks - I0


def _choose_split(n_tiles: int, ks: int, P: int) -> int:
    """The S (1 .. MAX_SPLIT) that costs least: stream-K steps at scattered depths and partial tiles."""

    def cost(S):
        q, R, q2, I0, TB = _phases(n_tiles, ks, P, S, True, True)
        flushes = (q2 if S > 1 else 0) + (2 if TB else 0)
        too_many = float("inf") if q2 > MAX_SPLIT_WAVES else 0
        return MISALIGNED_COST * TB / P + FLUSH_STEPS * flushes + too_many

    return min(range(1, min(MAX_SPLIT, ks) + 1), key=cost)


@cache  # a pure function of its arguments, asked again for every layer and micro-step
def make_plan(M: int, N: int, K: int, sms: int, programs: int | None = None, split: int | None = None,
              stream_k_only: bool = False) -> Plan:
    """The schedule of C [M, N] = G^T X over K tokens on `sms` SMs. `programs` and `split` (S) override the
    choice; `stream_k_only`: plain stream-K over all tiles (S = 1, no lockstep phases), to compare."""
    ks = triton.cdiv(K, BK)
    n_tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    if n_tiles * ks >= 2**31 - 1:
        raise ValueError(f"M={M}, N={N}, K={K}: too large for 32-bit schedule arithmetic")
    P = max(1, min(programs, n_tiles * ks) if programs else min(sms, n_tiles * ks // MIN_PROGRAM_STEPS))
    if stream_k_only:
        S = 1
    else:
        S = min(split or _choose_split(n_tiles, ks, P), ks)
    q, R, q2, I0, TB = _phases(n_tiles, ks, P, S, not stream_k_only, not stream_k_only)
    if TB:
        widest, shortest = triton.cdiv(TB, P), ks // S
        max_seg = 1 if widest <= 1 else (widest - 2) // shortest + 2
    else:
        max_seg = 0
    split_slots = q2 * P if S > 1 else 0
    return Plan(P, q, q2, R, S, ks, max_seg, split_slots, I0, TB, split_slots + P * max_seg)


def plan_args(plan: Plan) -> tuple[int, ...]:
    """The kernels' schedule arguments after n_tiles_n: ks, q, q2, R, S, max_seg, split_slots, I0, TB."""
    return (plan.k_steps, plan.dp_waves, plan.split_waves, plan.rest, plan.split, plan.max_seg,
            plan.split_slots, plan.sk_start, plan.sk_iters)


def reduce_partials(plan: Plan, part: torch.Tensor, out: torch.Tensor) -> None:
    """Sum the partial tiles in `part` [slots, BM, BN] fp32 into the left-over tiles of `out` [M, N]."""
    if plan.rest == 0 or (plan.split == 1 and plan.sk_iters == 0):
        return
    M, N = out.shape
    ks, q, q2, R, S, max_seg, split_slots, I0, TB = plan_args(plan)
    _reduce_kernel[(R * (BM // REDUCE_ROWS),)](
        part, out, M, N, triton.cdiv(N, BN), plan.programs, ks, q, q2, R, S, max_seg, split_slots, I0,
        max(TB, 1), BM=BM, BN=BN, ROWS=REDUCE_ROWS, num_warps=4,
    )


def preferred(g: torch.Tensor, x: torch.Tensor, g2: torch.Tensor | None = None) -> bool:
    """Whether to take this kernel over cuBLAS for g^T x: `supported`, over many tokens, in whole BM x BN
    tiles that make more than one wave on the SMs but not two. There cuBLAS runs a second, partly empty
    wave (on an H200 at 65,536 tokens: [5120, 1280], 200 tiles on 132 SMs, 1,223 us against 1,119 here),
    while with fewer tiles it splits K itself and with more it loses less to the last wave ([3072, 768]
    376 against 403 us, [6144, 1536] 1,451 against 1,630 us). Ragged tiles waste this kernel's work where
    cuBLAS picks another tile shape ([4608, 1152]: 883 against 985 us).
    With g2, for [g | g2]^T x, whatever the number of tiles: cuBLAS would take two products, or one after a
    copy that joins g and g2 (at [2304, 768], 54 tiles: 326-385 us without the copy's ~150, and 342-370
    here)."""
    M, N = g.shape[1] + (0 if g2 is None else g2.shape[1]), x.shape[1]
    if not supported(g, x, *(() if g2 is None else (g2,))) or g.shape[0] < MIN_TOKENS or M % BM or N % BN:
        return False
    if g2 is not None:
        return g.shape[1] % BM == 0 and g2.shape[0] == g.shape[0]
    sms = sm_count(g.device)
    return sms < (M // BM) * (N // BN) < 2 * sms


def supported(*tensors: torch.Tensor) -> bool:
    """Whether these (g, x, and g2 if any) suit the kernel: a Hopper GPU, the same 16-bit dtype, 2-D,
    row-major with 16-byte aligned rows and base (as gemm_hopper.py's products)."""
    return tensors[0].is_cuda and gemm_hopper.supported(*tensors)


def weight_grad(g: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype | None = None, *,
                g2: torch.Tensor | None = None, programs: int | None = None, split: int | None = None,
                stream_k_only: bool = False) -> torch.Tensor:
    """g^T x [M, N] for g [K, M] and x [K, N] (see `supported`), summed in fp32, in out_dtype (g's dtype by
    default; bfloat16, float16 or float32). With g2 [K, M2], [g | g2]^T x [M + M2, N], without joining g
    and g2 in memory (M a multiple of BM). `programs`, `split` and `stream_k_only`: see `make_plan`."""
    if g.dim() != 2 or x.dim() != 2 or g.shape[0] != x.shape[0]:
        raise ValueError(f"g {tuple(g.shape)} and x {tuple(x.shape)}: expected [K, M] and [K, N]")
    if g.dtype != x.dtype or g.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"g {g.dtype} and x {x.dtype}: expected the same 16-bit float dtype")
    if g2 is not None and (g2.dim() != 2 or g2.shape[0] != g.shape[0] or g2.dtype != g.dtype
                           or g.shape[1] % BM):
        raise ValueError(
            f"g {g.dtype} {tuple(g.shape)} and g2 {g2.dtype} {tuple(g2.shape)}: expected [K, M] and "
            f"[K, M2] of one dtype, M a multiple of {BM}"
        )
    out_dtype = out_dtype or g.dtype
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out_dtype {out_dtype}: expected bfloat16, float16 or float32")
    (K, M1), N = g.shape, x.shape[1]
    M = M1 + (0 if g2 is None else g2.shape[1])
    out = torch.empty(M, N, device=g.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    plan = make_plan(M, N, K, sm_count(g.device), programs, split, stream_k_only)
    part = torch.empty(max(plan.slots, 1), BM, BN, device=g.device, dtype=torch.float32)
    g_desc = descriptor(g, [BK, BM // 2])
    _wgrad_kernel[(plan.programs,)](
        g_desc, g_desc if g2 is None else descriptor(g2, [BK, BM // 2]), descriptor(x, [BK, BN]), out, part,
        M, M if g2 is None else M1, N, triton.cdiv(N, BN),
        *plan_args(plan), STAGES=STAGES, num_warps=WARPS, maxnreg=MAX_REGISTERS,
    )
    reduce_partials(plan, part, out)
    return out
