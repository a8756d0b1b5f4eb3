"""Warp-specialised passes on Hopper, in Gluon (triton.experimental.gluon): the forward of every document, and
the dQ and dK/dV passes of long documents.

Three partitions per program:
- a load warp streams tiles by TMA into a ring of STAGES slots, each with its own mbarriers: K and V for
  the forward and dQ pass (query tiles of 128 rows, one head), Q and dO for the dK/dV pass (key tiles of
  128 rows, one kv head);
- two warpgroups own 64 of the tile's rows each. They wait only on their slot's mbarriers, never on a
  CTA-wide barrier (triton's own pipeliner puts one around every TMA issue). In the forward and dQ pass
  each issues the next key block's products before the current block's exponentials, so those run under
  a product (FlashAttention-3's overlap within a warpgroup).
The dQ and dK/dV passes run one program per entry of flash_attn's tile table and head. The forward is
persistent: one program per SM, whose load warp claims (query tile, head) items from a counter in table
order and hands each to the warpgroups through shared memory. The next item's Q and first K/V blocks then
load while the warpgroups finish the last one, no program pays a launch per tile or per unused entry, and
claiming items in turn balances the SMs as the hardware's own scheduling of one program per tile did.
Head dim 128, causal over the whole past only: the blocks up to the diagonal, the last ones masked.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.tools.ragged_tma import create_ragged_descriptor

# Triton 3.6 (the GPU machines) names the TMA load async_copy_global_to_shared; later releases async_load.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

HEAD_DIM = 128
LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
# Launch: the kernel's own warps are the first warpgroup; the partitions add a second warpgroup and the
# load warp (padded to a warpgroup). At 168 registers a thread, the 384 threads hold the whole register
# file, which the kernels' warp_specialize calls share out as 240 / 240 / 24 (setmaxnreg).
WARPS = 4
MAX_REGISTERS = 168


@gluon.constexpr_function
def _mma_layout(n):
    """Accumulator layout of one warpgroup's [64, n] products."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def _kt(smem, slot, BN: gl.constexpr, D: gl.constexpr):
    """K (or V) of a slot, transposed: the B operand of Q K^T."""
    return smem.index(slot).reshape([BN, D]).permute((1, 0))


@gluon.jit
def _ragged(start, length, row):
    """Coordinates of row `row` of the segment [start, start + length) in a ragged descriptor
    (triton.tools.ragged_tma): the hardware reads rows past the segment's end as zeros."""
    billion = 0x40000000
    return billion, start + length, billion - length + row


@gluon.jit
def _stream_pairs(a_desc, b_desc, a_smem, b_smem, a_ready, b_ready, free, start, length, head, lo, hi, j0):
    """Blocks lo .. hi - 1 of two tensors of a segment (K and V, or Q and dO), each pair into the next
    ring slot once it is free. j0 pairs went through the ring before; returns the count after these."""
    BLOCK: gl.constexpr = a_desc.block_type.shape[2]
    NS: gl.constexpr = a_smem.type.shape[0]
    for i in range(lo, hi):
        j = j0 + i - lo
        slot = j % NS
        # A slot's first use waits on phase 1, which a fresh mbarrier counts as complete.
        mbarrier.wait(free.index(slot), ((j // NS) & 1) ^ 1)
        a, b, c = _ragged(start, length, i * BLOCK)
        mbarrier.expect(a_ready.index(slot), a_desc.block_type.nbytes)
        _tma_load(a_desc, [a, b, c, head, 0], a_ready.index(slot), a_smem.index(slot))
        mbarrier.expect(b_ready.index(slot), b_desc.block_type.nbytes)
        _tma_load(b_desc, [a, b, c, head, 0], b_ready.index(slot), b_smem.index(slot))
    return j0 + hi - lo


@gluon.jit
def _load_halves(desc, smem, bar, start, length, head, r0, FIRST: gl.constexpr):
    """The two halves (the descriptor's rows each) of a tile from row r0 on into smem slots FIRST and
    FIRST + 1, completing on bar."""
    HALF: gl.constexpr = desc.block_type.shape[2]
    for h in gl.static_range(2):
        a, b, c = _ragged(start, length, r0 + h * HALF)
        _tma_load(desc, [a, b, c, head, 0], bar, smem.index(FIRST + h))


@gluon.jit
def _claim(Counter, tiles, n_tiles, H):
    """The next work item (query tile i of the table, head h as i H + h) from the launch's counter, or -1
    once none is left: the table's unused entries come after its tiles."""
    w = gl.atomic_add(Counter, 1)
    tile = gl.minimum(w // H, n_tiles - 1)
    live = (w < n_tiles * H) & (gl.load(tiles + tile) >= 0)
    return gl.where(live, w, -1)


@gluon.jit
def _hand_over(items, item_ready, item_free, i, w):
    """Load warp: item w into slot i % 2 of the two-slot item ring that the warpgroups read."""
    slot = i % 2
    mbarrier.wait(item_free.index(slot), ((i // 2) & 1) ^ 1)
    items.index(slot).store(gl.full([1], w, gl.int32, gl.BlockedLayout([1], [32], [1], [0])))
    mbarrier.arrive(item_ready.index(slot), count=1)


@gluon.jit
def _take_over(items, item_ready, item_free, i):
    """Warpgroup: the i-th item the load warp handed over."""
    slot = i % 2
    mbarrier.wait(item_ready.index(slot), (i // 2) & 1)
    w = gl.max(items.index(slot).load(gl.BlockedLayout([1], [32], [4], [0])), 0)
    mbarrier.arrive(item_free.index(slot), count=1)
    return w


@gluon.jit
def _load_partition(args):
    """One warp: claims the items; for each, hands it to the warpgroups, loads its Q once the warpgroups
    are done with the last one, then K and V of each key block."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, items,
     item_ready, item_free, Counter, Out, Lse, tiles, n_tiles, cu_seqlens, n_docs, T, stride_ot, H, group,
     qk_scale) = args
    HALF: gl.constexpr = q_desc.block_type.shape[2]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    j = 0  # K/V pairs through the ring
    n_q = 0  # Q tiles loaded
    i = 0  # items handed over
    w = _claim(Counter, tiles, n_tiles, H)
    while w >= 0:
        _hand_over(items, item_ready, item_free, i, w)
        segment, start, length, r0, n_blocks = _tile(
            w // H, tiles, n_tiles, cu_seqlens, n_docs, T, 2 * HALF, BN
        )
        head = w % H
        if n_blocks > 0:
            mbarrier.wait(q_free, (n_q & 1) ^ 1)
            mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
            _load_halves(q_desc, q_smem, q_bar, start, length, head, r0, 0)
            j = _stream_pairs(
                k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_free, start, length, head // group, 0,
                n_blocks, j,
            )
            n_q += 1
        i += 1
        w = _claim(Counter, tiles, n_tiles, H)
    _hand_over(items, item_ready, item_free, i, -1)


@gluon.jit
def _softmax_partition(args, HALF_INDEX: gl.constexpr):
    """One warpgroup: 64 query rows of each item the load warp hands over."""
    (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, items,
     item_ready, item_free, Counter, Out, Lse, tiles, n_tiles, cu_seqlens, n_docs, T, stride_ot, H, group,
     qk_scale) = args
    HALF: gl.constexpr = q_desc.block_type.shape[2]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[4]
    j = 0
    n_q = 0
    i = 0
    w = _take_over(items, item_ready, item_free, i)
    while w >= 0:
        segment, start, length, r0, n_blocks = _tile(
            w // H, tiles, n_tiles, cu_seqlens, n_docs, T, 2 * HALF, BN
        )
        head = w % H
        if n_blocks == 0:
            _store_empty(Out, Lse, start, head, stride_ot, T, r0 + HALF_INDEX * HALF, length, HALF, D)
        else:
            _attend(q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, Out, Lse, start, length,
                    head, r0, n_blocks, T, stride_ot, qk_scale, j, n_q, HALF_INDEX)
            j += n_blocks
            n_q += 1
        i += 1
        w = _take_over(items, item_ready, item_free, i)


@gluon.jit
def _attend(q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, Out, Lse, start, length, head,
            r0, n_blocks, T, stride_ot, qk_scale, j0, n_q, HALF_INDEX: gl.constexpr):
    """Online softmax of the warpgroup's 64 rows of the query tile from row r0 over its n_blocks key blocks,
    which are ring entries j0.., then out and lse."""
    HALF: gl.constexpr = q_smem.type.shape[3]  # Q and the ring hold [1, 1, rows, 1, D] TMA blocks
    BN: gl.constexpr = k_smem.type.shape[3]
    D: gl.constexpr = k_smem.type.shape[5]
    NS: gl.constexpr = k_smem.type.shape[0]
    mma: gl.constexpr = _mma_layout(BN)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma)

    rows = r0 + HALF_INDEX * HALF + gl.arange(0, HALF, layout=row_layout)
    q = q_smem.index(HALF_INDEX).reshape([HALF, D])
    zeros = gl.zeros([HALF, BN], gl.float32, mma)
    mbarrier.wait(q_bar, n_q & 1)

    # Block 0 alone; then each step issues S = Q K^T of block j and P V of block j - 1 together, and
    # computes block j's softmax while P V runs (FlashAttention-3's overlap within a warpgroup).
    mbarrier.wait(k_ready.index(j0 % NS), (j0 // NS) & 1)
    s = warpgroup_mma(q, _kt(k_smem, j0 % NS, BN, D), zeros, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    s = _mask_diagonal(s, rows, 0, n_blocks, BN, col_layout)
    m_i = gl.max(s, 1) * qk_scale
    p = gl.exp2(s * qk_scale - m_i[:, None])
    l_i = gl.sum(p, 1)
    p = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    # The loop carries acc as an accumulator that a product may still be writing.
    acc = warpgroup_mma_init(gl.zeros([HALF, D], gl.float32, mma))
    for j in range(1, n_blocks):
        slot = (j0 + j) % NS
        prev = (j0 + j - 1) % NS
        mbarrier.wait(k_ready.index(slot), ((j0 + j) // NS) & 1)
        s = warpgroup_mma(q, _kt(k_smem, slot, BN, D), zeros, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((j0 + j - 1) // NS) & 1)
        acc = warpgroup_mma(p, v_smem.index(prev).reshape([BN, D]), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        s = _mask_diagonal(s, rows, j, n_blocks, BN, col_layout)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        p = gl.convert_layout(p.to(v_smem.dtype), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(kv_free.index(prev), count=1)
        acc = warpgroup_mma_init(acc * alpha[:, None])
    # Every product that reads Q is done: the load warp may bring the next item's.
    mbarrier.arrive(q_free, count=1)
    last = (j0 + n_blocks - 1) % NS
    mbarrier.wait(v_ready.index(last), ((j0 + n_blocks - 1) // NS) & 1)
    acc = warpgroup_mma(p, v_smem.index(last).reshape([BN, D]), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(kv_free.index(last), count=1)

    out = acc / l_i[:, None]
    cols_d = gl.arange(0, D, layout=col_layout)
    offs = (start + rows).to(gl.int64)[:, None] * stride_ot + head * D + cols_d[None, :]
    gl.store(Out + offs, out.to(Out.dtype.element_ty), mask=(rows < length)[:, None])
    lse = (m_i + gl.log2(l_i)) * LN2
    gl.store(Lse + head * T + start + rows, lse, mask=rows < length)


@gluon.jit
def _mask_diagonal(s, rows, j, n_blocks, BN: gl.constexpr, col_layout: gl.constexpr):
    """Causal mask on the last key block, the only one that holds keys after some query of the tile."""
    if j == n_blocks - 1:
        cols = j * BN + gl.arange(0, BN, layout=col_layout)
        s = gl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    return s


@gluon.jit
def _second_softmax_partition(args):
    _softmax_partition(args, 1)


@gluon.jit
def _tile(tile, tiles, n_tiles, cu_seqlens, n_docs, T, BM: gl.constexpr, BN: gl.constexpr):
    """(segment, first token, length, first row, blocks of BN rows up to the tile's last row) of entry `tile`
    of a table of BM-row tiles: for a query tile, the key blocks it visits. The segment is -1 for the
    table's unused entries, and the tail past the last document visits no blocks."""
    segment = gl.load(tiles + tile)
    block = gl.load(tiles + n_tiles + tile)
    start = gl.load(cu_seqlens + gl.maximum(segment, 0))
    end = gl.load(cu_seqlens + gl.minimum(segment + 1, n_docs), mask=segment < n_docs, other=T)
    length = end - start
    r0 = block * BM
    return segment, start, length, r0, gl.cdiv(gl.minimum(r0 + BM, gl.where(segment < n_docs, length, 0)), BN)


@gluon.jit
def _ring(a_desc, b_desc, STAGES: gl.constexpr):
    """A ring of STAGES slots for pairs of tiles (K and V, or Q and dO) and their mbarriers (ready: the
    load landed; free: both warpgroups are done with the slot), and one more mbarrier for the tiles
    that are loaded once."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    once = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(once, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)
    return a_smem, b_smem, once, a_ready, b_ready, free


@gluon.jit
def _fwd_persistent_kernel(
    q_desc, k_desc, v_desc, Out, Lse, tiles, n_tiles, cu_seqlens, n_docs, T, stride_ot, H, group, qk_scale,
    Counter, STAGES: gl.constexpr,
):
    """Persistent: each program runs items (query tile, head) claimed from Counter until none is left."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem, v_smem, q_bar, k_ready, v_ready, kv_free = _ring(k_desc, v_desc, STAGES)
    q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_free, count=2)
    items = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(item_ready.index(i), count=1)
        mbarrier.init(item_free.index(i), count=2)

    args = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, items,
            item_ready, item_free, Counter, Out, Lse, tiles, n_tiles, cu_seqlens, n_docs, T, stride_ot, H,
            group, qk_scale)
    gl.warp_specialize([
        (_softmax_partition, (args, 0)),
        (_second_softmax_partition, (args, )),
        (_load_partition, (args, )),
    ], [4, 1], [240, 24])


@gluon.jit
def _store_empty(Out, Lse, start, head, stride_ot, T, r0, q_len, BM: gl.constexpr, D: gl.constexpr):
    """Rows with nothing to attend to (the tail past the last document): out = 0, lse = -inf."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    _store_zeros(Out, start, r0, q_len, head, stride_ot, BM, D, layout)
    rows = r0 + gl.arange(0, BM, layout=gl.SliceLayout(0, layout))
    minus_inf = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(0, layout))
    gl.store(Lse + head * T + start + rows, minus_inf, mask=rows < q_len)


@gluon.jit
def _store_zeros(X, start, r0, length, head, stride_t, BM: gl.constexpr, D: gl.constexpr,
                 layout: gl.constexpr):
    """Zeros into rows r0 .. r0 + BM - 1 (those before `length`) of the segment from token `start` of
    one head of a [T, H, D] tensor."""
    rows = r0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    offs = (start + rows).to(gl.int64)[:, None] * stride_t + head * D + cols[None, :]
    gl.store(X + offs, gl.zeros([BM, D], X.dtype.element_ty, layout), mask=(rows < length)[:, None])


# ----------------------------------------------------------------------------------------------------------
# dQ of long documents: the same partitions, with Q and dO held and dQ += dS K accumulated over key blocks


@gluon.jit
def _dq_load_partition(args):
    """One warp: Q and dO once, then K and V of each key block."""
    (q_desc, do_desc, k_desc, v_desc, qdo_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, Out, dOut,
     Lse, dLse, Delta, dQ, start, length, head, kv_head, r0, n_blocks, T, stride_t, qk_scale, sm_scale) = args
    mbarrier.expect(q_bar, 4 * q_desc.block_type.nbytes)
    _load_halves(q_desc, qdo_smem, q_bar, start, length, head, r0, 0)
    _load_halves(do_desc, qdo_smem, q_bar, start, length, head, r0, 2)
    _stream_pairs(
        k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_free, start, length, kv_head, 0, n_blocks, 0
    )


@gluon.jit
def _row_delta(Out, dOut, dLse, Delta, rows, row0, head, length, T, stride_t, D: gl.constexpr,
               HAS_DLSE: gl.constexpr, layout: gl.constexpr):
    """delta = rowsum(dO * O) - dlse of the given rows, stored for the dK/dV pass and returned (fp32)."""
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    ok = rows < length
    offs = (row0 + rows).to(gl.int64)[:, None] * stride_t + head * D + cols[None, :]
    do = gl.load(dOut + offs, mask=ok[:, None], other=0.0).to(gl.float32)
    o = gl.load(Out + offs, mask=ok[:, None], other=0.0).to(gl.float32)
    delta = gl.sum(do * o, 1)
    if HAS_DLSE:
        delta -= gl.load(dLse + head * T + row0 + rows, mask=ok, other=0.0)
    gl.store(Delta + head * T + row0 + rows, delta, mask=ok)
    return delta


@gluon.jit
def _dq_partition(args, HALF_INDEX: gl.constexpr, HAS_DLSE: gl.constexpr):
    """One warpgroup: dQ of its 64 query rows, dQ = sum over key blocks of dS K with P = exp2(S - lse) and
    dS = P (dO V^T - delta). While dS K of a block runs, the next block's S and dP are computed."""
    (q_desc, do_desc, k_desc, v_desc, qdo_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, Out, dOut,
     Lse, dLse, Delta, dQ, start, length, head, kv_head, r0, n_blocks, T, stride_t, qk_scale, sm_scale) = args
    HALF: gl.constexpr = q_desc.block_type.shape[2]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[4]
    NS: gl.constexpr = k_smem.type.shape[0]
    mma_s: gl.constexpr = _mma_layout(BN)
    mma_d: gl.constexpr = _mma_layout(D)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_d, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_s)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_s)
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    first = r0 + HALF_INDEX * HALF
    delta = _row_delta(Out, dOut, dLse, Delta, first + gl.arange(0, HALF, layout=gl.SliceLayout(1, blocked)),
                       start, head, length, T, stride_t, D, HAS_DLSE, blocked)
    delta = gl.convert_layout(delta, row_layout)
    rows = first + gl.arange(0, HALF, layout=row_layout)
    # Rows past the document's end get lse = +inf, so P = 0 there (their Q and dO tiles read as zeros).
    lse = gl.load(Lse + head * T + start + rows, mask=rows < length, other=float("inf")) * LOG2E
    q = qdo_smem.index(HALF_INDEX).reshape([HALF, D])
    do = qdo_smem.index(2 + HALF_INDEX).reshape([HALF, D])
    zeros = gl.zeros([HALF, BN], gl.float32, mma_s)
    mbarrier.wait(q_bar, 0)

    mbarrier.wait(k_ready.index(0), 0)
    mbarrier.wait(v_ready.index(0), 0)
    s = warpgroup_mma(q, _kt(k_smem, 0, BN, D), zeros, use_acc=False, is_async=True)
    dp = warpgroup_mma(do, _kt(v_smem, 0, BN, D), zeros, use_acc=False, is_async=True)
    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
    ds = _dq_scores(s, dp, lse, delta, rows, 0, r0, BN, qk_scale, col_layout, ds_layout, k_smem.dtype)
    dq = warpgroup_mma_init(gl.zeros([HALF, D], gl.float32, mma_d))
    for j in range(1, n_blocks):
        slot = j % NS
        prev = (j - 1) % NS
        phase = (j // NS) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        s = warpgroup_mma(q, _kt(k_smem, slot, BN, D), zeros, use_acc=False,
                          is_async=True)
        mbarrier.wait(v_ready.index(slot), phase)
        dp = warpgroup_mma(do, _kt(v_smem, slot, BN, D), zeros, use_acc=False,
                           is_async=True)
        dq = warpgroup_mma(ds, k_smem.index(prev).reshape([BN, D]), dq, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=1, deps=(s, dp))
        ds = _dq_scores(s, dp, lse, delta, rows, j, r0, BN, qk_scale, col_layout, ds_layout, k_smem.dtype)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        mbarrier.arrive(kv_free.index(prev), count=1)
        dq = warpgroup_mma_init(dq)
    last = (n_blocks - 1) % NS
    dq = warpgroup_mma(ds, k_smem.index(last).reshape([BN, D]), dq, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
    mbarrier.arrive(kv_free.index(last), count=1)

    rows_d = first + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma_d))
    cols_d = gl.arange(0, D, layout=gl.SliceLayout(0, mma_d))
    offs = (start + rows_d).to(gl.int64)[:, None] * stride_t + head * D + cols_d[None, :]
    gl.store(dQ + offs, (dq * sm_scale).to(dQ.dtype.element_ty), mask=(rows_d < length)[:, None])


@gluon.jit
def _dq_scores(s, dp, lse, delta, rows, j, r0, BN: gl.constexpr, qk_scale, col_layout: gl.constexpr,
               ds_layout: gl.constexpr, dtype: gl.constexpr):
    """dS of key block j as the A operand of dS K; key blocks from the tile's first row on need the
    causal mask."""
    p = gl.exp2(s * qk_scale - lse[:, None])
    if (j + 1) * BN > r0:
        cols = j * BN + gl.arange(0, BN, layout=col_layout)
        p = gl.where(cols[None, :] <= rows[:, None], p, 0.0)
    ds = p * (dp - delta[:, None])
    return gl.convert_layout(ds.to(dtype), ds_layout)


@gluon.jit
def _dq_second_partition(args):
    _dq_partition(args, 1, False)


@gluon.jit
def _dq_second_partition_dlse(args):
    _dq_partition(args, 1, True)


@gluon.jit
def _dq_long_kernel(
    q_desc, do_desc, k_desc, v_desc, Out, dOut, Lse, dLse, Delta, dQ, tiles, n_tiles, cu_seqlens, n_docs, T,
    stride_t, group, qk_scale, sm_scale, HAS_DLSE: gl.constexpr, STAGES: gl.constexpr,
):
    HALF: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[4]
    segment, start, length, r0, n_blocks = _tile(
        gl.program_id(0), tiles, n_tiles, cu_seqlens, n_docs, T, 2 * HALF, k_desc.block_type.shape[2]
    )
    if segment < 0:
        return
    head = gl.program_id(1)
    if n_blocks == 0:
        _dq_empty(Out, dOut, dLse, Delta, dQ, start, head, r0, length, T, stride_t, 2 * HALF, D, HAS_DLSE)
        return

    qdo_smem = gl.allocate_shared_memory(q_desc.dtype, [4] + q_desc.block_type.shape, q_desc.layout)
    k_smem, v_smem, q_bar, k_ready, v_ready, kv_free = _ring(k_desc, v_desc, STAGES)

    args = (q_desc, do_desc, k_desc, v_desc, qdo_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, Out,
            dOut, Lse, dLse, Delta, dQ, start, length, head, head // group, r0, n_blocks, T, stride_t,
            qk_scale, sm_scale)
    if HAS_DLSE:
        gl.warp_specialize([
            (_dq_partition, (args, 0, True)),
            (_dq_second_partition_dlse, (args, )),
            (_dq_load_partition, (args, )),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_dq_partition, (args, 0, False)),
            (_dq_second_partition, (args, )),
            (_dq_load_partition, (args, )),
        ], [4, 1], [240, 24])


@gluon.jit
def _dq_empty(Out, dOut, dLse, Delta, dQ, start, head, r0, length, T, stride_t, BM: gl.constexpr,
              D: gl.constexpr, HAS_DLSE: gl.constexpr):
    """Rows with nothing to attend to (the tail past the last document): dQ = 0, and their delta."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = r0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    _row_delta(Out, dOut, dLse, Delta, rows, start, head, length, T, stride_t, D, HAS_DLSE, layout)
    _store_zeros(dQ, start, r0, length, head, stride_t, BM, D, layout)


# ----------------------------------------------------------------------------------------------------------
# dK and dV of long documents: one program per (128-key tile, kv head); each warpgroup owns 64 of its keys
# and accumulates their dK and dV over the query blocks that the load warp streams


@gluon.jit
def _dkdv_load_partition(args):
    """One warp: K and V of the tile once, then Q and dO of each query block of each head of the group."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, kv_smem, kv_bar, q_ready, do_ready, qdo_free, Lse,
     Delta, dK, dV, start, length, kv_head, group, c0, q_lo, n_q, T, stride_kvt, qk_scale, sm_scale) = args
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    _load_halves(k_desc, kv_smem, kv_bar, start, length, kv_head, c0, 0)
    _load_halves(v_desc, kv_smem, kv_bar, start, length, kv_head, c0, 2)
    j = 0
    for h in range(group):
        j = _stream_pairs(q_desc, do_desc, q_smem, do_smem, q_ready, do_ready, qdo_free, start, length,
                          kv_head * group + h, q_lo, n_q, j)


@gluon.jit
def _dkdv_partition(args, WG: gl.constexpr):
    """Warpgroup WG: dV = sum over query blocks of P^T dO and dK = sum of dS^T Q for keys
    c0 + 64 WG .. c0 + 64 WG + 63, computed transposed ([keys, queries]) so that the keys stay rows."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, kv_smem, kv_bar, q_ready, do_ready, qdo_free, Lse,
     Delta, dK, dV, start, length, kv_head, group, c0, q_lo, n_q, T, stride_kvt, qk_scale, sm_scale) = args
    BM: gl.constexpr = q_desc.block_type.shape[2]
    HALF: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[4]
    NS: gl.constexpr = q_smem.type.shape[0]
    mma_s: gl.constexpr = _mma_layout(BM)
    mma_d: gl.constexpr = _mma_layout(D)
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_d, k_width=2)
    query_layout: gl.constexpr = gl.SliceLayout(0, mma_s)
    vector: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])

    first_key = c0 + WG * HALF
    keys = first_key + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma_s))
    k = kv_smem.index(WG).reshape([HALF, D])
    v = kv_smem.index(2 + WG).reshape([HALF, D])
    zeros = gl.zeros([HALF, BM], gl.float32, mma_s)
    dk = warpgroup_mma_init(gl.zeros([HALF, D], gl.float32, mma_d))
    dv = warpgroup_mma_init(gl.zeros([HALF, D], gl.float32, mma_d))
    mbarrier.wait(kv_bar, 0)
    j = 0
    for h in range(group):
        head = kv_head * group + h
        if WG == 1:
            # These keys come after every query of the first query block. The wait keeps this warpgroup
            # from freeing a slot twice before the other has used it once.
            mbarrier.wait(q_ready.index(j % NS), (j // NS) & 1)
            mbarrier.arrive(qdo_free.index(j % NS), count=1)
            j += 1
        for qb in range(q_lo + WG, n_q):
            slot = j % NS
            phase = (j // NS) & 1
            q = q_smem.index(slot).reshape([BM, D])
            do = do_smem.index(slot).reshape([BM, D])
            mbarrier.wait(q_ready.index(slot), phase)
            s = warpgroup_mma(k, q.permute((1, 0)), zeros, use_acc=False, is_async=True)
            mbarrier.wait(do_ready.index(slot), phase)
            dp = warpgroup_mma(v, do.permute((1, 0)), zeros, use_acc=False, is_async=True)
            # Queries past the document's end get lse = +inf, so P = 0 there (their tiles read as zeros).
            # Loaded one per thread and spread to the product's columns only once they are needed: in
            # that layout each thread holds 16 of them, registers the accumulators need.
            queries = qb * BM + gl.arange(0, BM, layout=vector)
            ok = queries < length
            lse = gl.load(Lse + head * T + start + queries, mask=ok, other=float("inf")) * LOG2E
            delta = gl.load(Delta + head * T + start + queries, mask=ok, other=0.0)
            s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
            p = gl.exp2(s * qk_scale - gl.convert_layout(lse, query_layout)[None, :])
            if qb * BM < first_key + HALF:  # the diagonal block: keys after a query are masked
                cols = qb * BM + gl.arange(0, BM, layout=query_layout)
                p = gl.where(cols[None, :] >= keys[:, None], p, 0.0)
            ds = p * (dp - gl.convert_layout(delta, query_layout)[None, :])
            dv = warpgroup_mma(gl.convert_layout(p.to(q_desc.dtype), operand), do, dv, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(ds.to(q_desc.dtype), operand), q, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            mbarrier.arrive(qdo_free.index(slot), count=1)
            dv = warpgroup_mma_init(dv)
            dk = warpgroup_mma_init(dk)
            j += 1
    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))

    rows = first_key + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma_d))
    cols_d = gl.arange(0, D, layout=gl.SliceLayout(0, mma_d))
    offs = (start + rows).to(gl.int64)[:, None] * stride_kvt + kv_head * D + cols_d[None, :]
    inside = (rows < length)[:, None]
    gl.store(dK + offs, (dk * sm_scale).to(dK.dtype.element_ty), mask=inside)
    gl.store(dV + offs, dv.to(dV.dtype.element_ty), mask=inside)


@gluon.jit
def _dkdv_second_partition(args):
    _dkdv_partition(args, 1)


@gluon.jit
def _dkdv_kernel(
    q_desc, do_desc, k_desc, v_desc, Lse, Delta, dK, dV, tiles, n_tiles, cu_seqlens, n_docs, T, stride_kvt,
    group, qk_scale, sm_scale, STAGES: gl.constexpr,
):
    BM: gl.constexpr = q_desc.block_type.shape[2]
    HALF: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[4]
    segment, start, length, c0, n_blocks = _tile(
        gl.program_id(0), tiles, n_tiles, cu_seqlens, n_docs, T, 2 * HALF, BM
    )
    if segment < 0:
        return
    kv_head = gl.program_id(1)
    if n_blocks == 0:  # the tail past the last document: no query sees its keys
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        _store_zeros(dK, start, c0, length, kv_head, stride_kvt, 2 * HALF, D, layout)
        _store_zeros(dV, start, c0, length, kv_head, stride_kvt, 2 * HALF, D, layout)
        return

    q_smem, do_smem, kv_bar, q_ready, do_ready, qdo_free = _ring(q_desc, do_desc, STAGES)
    kv_smem = gl.allocate_shared_memory(k_desc.dtype, [4] + k_desc.block_type.shape, k_desc.layout)
    # Under the causal mask the tile's keys are seen by query blocks c0 / BM .. n_q - 1.
    args = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, kv_smem, kv_bar, q_ready, do_ready, qdo_free,
            Lse, Delta, dK, dV, start, length, kv_head, group, c0, c0 // BM, gl.cdiv(length, BM), T,
            stride_kvt, qk_scale, sm_scale)
    gl.warp_specialize([
        (_dkdv_partition, (args, 0)),
        (_dkdv_second_partition, (args, )),
        (_dkdv_load_partition, (args, )),
    ], [4, 1], [240, 24])


def supported(*tensors: torch.Tensor) -> bool:
    """Whether these kernels can read these [T, H, D] tensors by TMA: a Hopper GPU, 16-bit, head dim 128,
    16-byte aligned bases and token/head strides."""
    q = tensors[0]
    if not q.is_cuda or torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[2] != HEAD_DIM:
        return False
    return all(
        x.data_ptr() % 16 == 0 and x.stride(2) == 1 and all(stride * 2 % 16 == 0 for stride in x.stride()[:2])
        for x in tensors
    )


def _descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """Ragged TMA descriptor of a [T, H, D] tensor for [rows, D] tiles of one head and one segment."""
    ragged = create_ragged_descriptor(x, [rows, 1, x.shape[2]])
    dtype = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for(ragged.block_shape, dtype)
    return TensorDescriptor(x, ragged.shape, ragged.strides, ragged.block_shape, layout)


def forward(q, k, v, out, lse, tiles, cu_seqlens, softmax_scale: float, blocks) -> None:
    """Writes out [T, H, D] and lse [H, T] (as flash_attn.forward) for the query tiles of `tiles`, whose
    blocks are blocks.m rows."""
    T, H, D = q.shape
    if (blocks.m, blocks.n, blocks.warps) != (128, HEAD_DIM, 8):
        raise ValueError(f"the Gluon forward runs 128-key blocks and two 64-row warpgroups, not {blocks}")
    n_tiles = tiles.shape[1]
    # One program per SM (224 KB of shared memory each), and a fresh counter of claimed items per launch.
    programs = min(n_tiles * H, torch.cuda.get_device_properties(q.device).multi_processor_count)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    _fwd_persistent_kernel[(programs,)](
        _descriptor(q, blocks.m // 2), _descriptor(k, blocks.n), _descriptor(v, blocks.n), out, lse, tiles,
        n_tiles, cu_seqlens, cu_seqlens.numel() - 1, T, out.stride(0), H, H // k.shape[1],
        softmax_scale * LOG2E.value, counter, STAGES=blocks.stages, num_warps=WARPS, maxnreg=MAX_REGISTERS,
    )


def backward_dq(dout, q, k, v, out, lse, dlse, delta, dq, tiles, cu_seqlens, softmax_scale: float, blocks):
    """Writes dq [T, H, D] and delta [H, T] (as flash_attn's dQ pass) for the query tiles of `tiles`."""
    T, H, D = q.shape
    if (blocks.m, blocks.n, blocks.warps) != (128, 64, 8):
        raise ValueError(f"the Gluon dQ pass runs 64-key blocks and two 64-row warpgroups, not {blocks}")
    if not (out.is_contiguous() and dout.is_contiguous() and dq.is_contiguous()):
        raise ValueError("the Gluon dQ pass takes contiguous out, dout and dq")
    n_tiles = tiles.shape[1]
    _dq_long_kernel[(n_tiles, H)](
        _descriptor(q, blocks.m // 2), _descriptor(dout, blocks.m // 2), _descriptor(k, blocks.n),
        _descriptor(v, blocks.n), out, dout, lse, lse if dlse is None else dlse, delta, dq, tiles, n_tiles,
        cu_seqlens, cu_seqlens.numel() - 1, T, dq.stride(0), H // k.shape[1], softmax_scale * LOG2E.value,
        softmax_scale, HAS_DLSE=dlse is not None, STAGES=blocks.stages, num_warps=WARPS,
        maxnreg=MAX_REGISTERS,
    )


def backward_dkdv(dout, q, k, v, lse, delta, dk, dv, tiles, cu_seqlens, softmax_scale: float, blocks) -> None:
    """Writes dk and dv [T, H_kv, D] (as flash_attn's dK/dV pass) for the key tiles of `tiles`."""
    T, H, D = q.shape
    if (blocks.m, blocks.n, blocks.warps) != (64, 128, 8):
        raise ValueError(f"the Gluon dK/dV pass runs 64-query blocks and two 64-key warpgroups, not {blocks}")
    n_tiles = tiles.shape[1]
    _dkdv_kernel[(n_tiles, k.shape[1])](
        _descriptor(q, blocks.m), _descriptor(dout, blocks.m), _descriptor(k, blocks.n // 2),
        _descriptor(v, blocks.n // 2), lse, delta, dk, dv, tiles, n_tiles, cu_seqlens, cu_seqlens.numel() - 1,
        T, dk.stride(0), H // k.shape[1], softmax_scale * LOG2E.value, softmax_scale, STAGES=blocks.stages,
        num_warps=WARPS, maxnreg=MAX_REGISTERS,
    )
