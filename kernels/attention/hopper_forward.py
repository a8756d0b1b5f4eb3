"""The forward on Hopper in Gluon: persistent and warp-specialised (see hopper.py for the partitions).

One program per SM, whose load warp claims (query tile, head) items from a counter in table order, reads the
tile's entry of the table and hands the item over to the warpgroups through shared memory: its head, first
token, length, first row and key blocks, so that the warpgroups start on it without a load from global
memory of their own (3-7% faster than handing over the item's number where items are short, on the mixes of
scripts/bench_attention.py on an H200). The next item's Q and first K/V blocks then load while the
warpgroups finish the last one, no program pays a launch per tile or per unused entry, and claiming items in
turn balances the SMs as the hardware's own scheduling of one program per tile does. Table order also keeps
one document's K/V in L2 for its neighbouring tiles: a static round-robin split balanced 6-19% worse, and a
global longest-first order loses that reuse. Where the K and V of every head of the longest documents exceed
L2, items run in sections of heads (see _item): 4% faster on mix (c) at head dim 128, 2% at 64.

A query tile holds 128 rows (two warpgroups) or 192 (three, which share each key block among more rows).
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from kernels.attention.hopper import (
    LN2,
    LOG2E,
    WARPS,
    barrier,
    first_block,
    load_parts,
    mma_layout,
    needs_mask,
    ragged_row,
    store_zeros,
    stream_pairs,
    table_entry,
    tile_ring,
    tma_descriptor,
    tma_store,
    transposed_slot,
)
from kernels.common import l2_bytes, max_registers, sm_count


@gluon.jit
def _item(w, n_tiles, per):
    """(table entry, head) of item w. Items run in sections of `per` adjacent heads (whole kv groups): a
    section's query tiles in table order, each with the section's heads side by side, then the next
    section's. The programs at work at one time then read the K and V of a section's heads only, which
    forward() sizes to stay in L2."""
    within = w % (n_tiles * per)
    return within // per, w // (n_tiles * per) * per + within % per


@gluon.jit
def _claim(Counter, tiles, n_tiles, H, per):
    """The next work item from the launch's counter, or -1 once none is left. A section's run of items ends
    with the table's unused entries: the first of them met moves the counter on to the next section."""
    w = gl.atomic_add(Counter, 1)
    if per < H:
        while (w < n_tiles * H) & (gl.load(tiles + _item(w, n_tiles, per)[0]) < 0):
            gl.atomic_max(Counter, (w // (n_tiles * per) + 1) * (n_tiles * per))
            w = gl.atomic_add(Counter, 1)
    live = (w < n_tiles * H) & (gl.load(tiles + _item(w, n_tiles, per)[0]) >= 0)
    return gl.where(live, w, -1)


# How out leaves the warpgroups: stored from the products' registers, or by TMA through the warpgroup's slot
# of Q (once its products no longer read it; the next item's Q then loads after the store has read the slot)
# or through a slot of its own (the next Q loads under the last P V, as with registers, and earlier still once
# S takes Q from registers: see _attend). The TMA store writes whole rows, cut at the document's end by the
# descriptor. On an H200, against registers: at head dim 128 Q's slot measured 3% faster on mixes (a) and (b)
# of scripts/bench_attention.py and level on (c); at 64, whose 128-row tiles leave the shared memory room for
# slots of out's own, Q's slot measured 1-1.5% slower on (a) and (b) and out's own slots 3% faster on (a),
# 1.5% on (b), level on (c).
OUT_REGISTERS = gl.constexpr(0)
OUT_Q_SLOT = gl.constexpr(1)
OUT_OWN_SLOT = gl.constexpr(2)


@gluon.constexpr_function
def _slots_per_part(out):
    """Slots of the Q buffer per warpgroup: Q's, and out's where it has its own."""
    return 2 if out == OUT_OWN_SLOT.value else 1


@gluon.constexpr_function
def _out_slot(wg, slots, out):
    """The slot of the Q buffer through which warpgroup wg's out leaves: its own after Q's, else Q's."""
    return wg + slots // 2 if out == OUT_OWN_SLOT.value else wg


# An item as the load warp hands it over: its head (-1: none left) and its table entry.
FIELDS = gl.constexpr(8)


@gluon.jit
def _hand_over(items, item_ready, item_free, i, head, start, length, r0, n_blocks):
    """Load warp: the i-th item into slot i % 2 of the two-slot item ring that the warpgroups read."""
    slot = i % 2
    layout: gl.constexpr = gl.BlockedLayout([FIELDS], [32], [1], [0])
    k = gl.arange(0, FIELDS, layout=layout)
    fields = gl.where(
        k == 0, head, gl.where(k == 1, start, gl.where(k == 2, length, gl.where(k == 3, r0, n_blocks))))
    mbarrier.wait(item_free.index(slot), ((i // 2) & 1) ^ 1)
    items.index(slot).store(fields)
    mbarrier.arrive(item_ready.index(slot), count=1)


@gluon.jit
def _field(fields, k, n: gl.constexpr):
    """Field n of an item, which every thread holds whole: a selection among its own registers."""
    return gl.sum(gl.where(k == n, fields, 0), 0)


@gluon.jit
def _take_over(items, item_ready, item_free, i):
    """Warpgroup: (head, first token, length, first row, key blocks) of the i-th item the load warp handed
    over."""
    slot = i % 2
    layout: gl.constexpr = gl.BlockedLayout([FIELDS], [32], [4], [0])
    mbarrier.wait(item_ready.index(slot), (i // 2) & 1)
    fields = items.index(slot).load(layout)
    mbarrier.arrive(item_free.index(slot), count=1)
    k = gl.arange(0, FIELDS, layout=layout)
    return _field(fields, k, 0), _field(fields, k, 1), _field(fields, k, 2), _field(fields, k, 3), _field(
        fields, k, 4)


@gluon.jit
def _load_partition(args, OUT: gl.constexpr):
    """One warp: claims the items; for each, hands it to the warpgroups, loads its Q once the warpgroups
    are done with the last one, then K and V of each key block."""
    (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free,
     items, item_ready, item_free, Counter, Out, Lse, tiles, n_tiles, cu_seqlens, n_docs, T, stride_ot, H,
     group, per, qk_scale, left) = args
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    PARTS: gl.constexpr = q_smem.type.shape[0] // _slots_per_part(OUT)
    BN: gl.constexpr = k_desc.block_type.shape[2]
    j = 0  # K/V pairs through the ring
    n_q = 0  # Q tiles loaded
    i = 0  # items handed over
    w = _claim(Counter, tiles, n_tiles, H, per)
    while w >= 0:
        tile, head = _item(w, n_tiles, per)
        _, start, length, r0, n_blocks = table_entry(
            tile, tiles, n_tiles, cu_seqlens, n_docs, T, PARTS * ROWS, BN
        )
        _hand_over(items, item_ready, item_free, i, head, start, length, r0, n_blocks)
        if n_blocks > 0:
            mbarrier.wait(q_free, (n_q & 1) ^ 1)
            mbarrier.expect(q_bar, PARTS * q_desc.block_type.nbytes)
            load_parts(q_desc, q_smem, q_bar, start, length, head, r0, 0, PARTS)
            j = stream_pairs(
                k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_free, start, length, head // group,
                first_block(r0, left, BN), n_blocks, j,
            )
            n_q += 1
        i += 1
        w = _claim(Counter, tiles, n_tiles, H, per)
    _hand_over(items, item_ready, item_free, i, -1, 0, 0, 0, 0)


@gluon.jit
def _softmax_partition(args, WG: gl.constexpr, OUT: gl.constexpr, WINDOW: gl.constexpr):
    """One warpgroup: rows 64 WG .. 64 WG + 63 of each item the load warp hands over."""
    (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free,
     items, item_ready, item_free, Counter, Out, Lse, tiles, n_tiles, cu_seqlens, n_docs, T, stride_ot, H,
     group, per, qk_scale, left) = args
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[4]
    j = 0
    n_q = 0
    i = 0
    head, start, length, r0, n_blocks = _take_over(items, item_ready, item_free, i)
    while head >= 0:
        if n_blocks == 0:
            _store_empty(Out, Lse, start, head, stride_ot, T, r0 + WG * ROWS, length, ROWS, D)
        else:
            lo = first_block(r0, left, BN)
            _attend(o_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, Out,
                    Lse, start, length, head, r0, lo, n_blocks, left, T, stride_ot, qk_scale, j, n_q, WG, OUT,
                    WINDOW)
            j += n_blocks - lo
            n_q += 1
        i += 1
        head, start, length, r0, n_blocks = _take_over(items, item_ready, item_free, i)
    if OUT == OUT_OWN_SLOT:
        tma.store_wait(0)  # the last out read from its slot before the program's shared memory goes


@gluon.jit
def _attend(o_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready, kv_free, Out, Lse, start,
            length, head, r0, lo, n_blocks, left, T, stride_ot, qk_scale, j0, n_q, WG: gl.constexpr,
            OUT: gl.constexpr, WINDOW: gl.constexpr):
    """Online softmax of the warpgroup's 64 rows of the query tile from row r0 over the key blocks they see,
    then out and lse. The tile's blocks lo .. n_blocks - 1 are ring entries j0..; the warpgroup releases
    those its rows do not see (before their window, or after their diagonal in a tile of three warpgroups)
    without reading them."""
    ROWS: gl.constexpr = q_smem.type.shape[3]  # Q and the ring hold [1, 1, rows, 1, D] TMA blocks
    BN: gl.constexpr = k_smem.type.shape[3]
    D: gl.constexpr = k_smem.type.shape[5]
    NS: gl.constexpr = k_smem.type.shape[0]
    mma: gl.constexpr = mma_layout(BN)
    mma_o: gl.constexpr = mma_layout(D)  # of P V, which is mma's at head dim 128
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma)
    o_rows: gl.constexpr = gl.SliceLayout(1, mma_o)

    first = r0 + WG * ROWS
    rows = first + gl.arange(0, ROWS, layout=row_layout)
    last_row = first + ROWS - 1
    q = q_smem.index(WG).reshape([ROWS, D])
    zeros = gl.zeros([ROWS, BN], gl.float32, mma)
    own_lo = first_block(first, left, BN)
    own_hi = gl.cdiv(gl.minimum(first + ROWS, length), BN)
    _release(k_ready, v_ready, kv_free, j0, own_lo - lo)
    j0 += own_lo - lo
    count = own_hi - own_lo
    mbarrier.wait(q_bar, n_q & 1)
    if OUT == OUT_OWN_SLOT:
        # At head dim 64 in 128-row tiles S takes Q from registers (16 a thread): the products read only K
        # and V from shared memory, and Q's slot goes back to the load warp at once, so that the next item's Q
        # loads under this one's key loop. On an H200 the forward measured 3-5% faster on mixes (a) and (b) of
        # scripts/bench_attention.py and 3-7% under a 512-token window (out bitwise equal). At head dim 128,
        # where out leaves through Q's slot, it measured level (2-4% slower on (a) and (b) with out stored
        # from registers so that the slot goes back at once); in 192-row tiles ptxas spills.
        q = q.load(gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2))
        mbarrier.arrive(q_free, count=1)

    # Block own_lo alone; then each step issues S = Q K^T of block j and P V of block j - 1 together, and
    # computes block j's softmax before waiting for P V (FlashAttention-3's overlap within a warpgroup).
    # ptxas (triton 3.6) moves that wait up to just after the mask, so the row maxima and exponentials run
    # once P V is done, beside the other warpgroup's products rather than this one's (with the wait held
    # below them by a barrier of the warpgroup, the forward measured level at head dim 128 and up to 4.6%
    # slower at 64 on an H200). Issuing the next block's S after the exponentials, which would hold that wait
    # below them, makes ptxas serialise the products (its warning C7514), with S then in flight across the
    # loop's back edge.
    # Computing a share of the exponentials by a cubic in float32 instead of on the MUFU pipe measured 2-31%
    # slower on an H200 (one in eight to one in two): the softmax is bound by instruction issue, not by MUFU.
    mbarrier.wait(k_ready.index(j0 % NS), (j0 // NS) & 1)
    s = warpgroup_mma(q, transposed_slot(k_smem, j0 % NS, BN, D), zeros, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    s = _mask(s, rows, own_lo, own_hi, last_row, left, BN, col_layout, WINDOW)
    # A finite floor for rows that see none of the window's first block keeps exp2(m_i - m_new) finite.
    m_i = gl.maximum(gl.max(s, 1) * qk_scale, -1.0e30)
    p = gl.exp2(s * qk_scale - m_i[:, None])
    l_i = _row_shares(p)
    p = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    # The loop carries acc as an accumulator that a product may still be writing.
    acc = warpgroup_mma_init(gl.zeros([ROWS, D], gl.float32, mma_o))
    for i in range(1, count):
        slot = (j0 + i) % NS
        prev = (j0 + i - 1) % NS
        mbarrier.wait(k_ready.index(slot), ((j0 + i) // NS) & 1)
        s = warpgroup_mma(q, transposed_slot(k_smem, slot, BN, D), zeros, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((j0 + i - 1) // NS) & 1)
        acc = warpgroup_mma(p, v_smem.index(prev).reshape([BN, D]), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        s = _mask(s, rows, own_lo + i, own_hi, last_row, left, BN, col_layout, WINDOW)
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * _by_row(alpha, l_i) + _row_shares(p)
        m_i = m_new
        p = gl.convert_layout(p.to(v_smem.dtype), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(kv_free.index(prev), count=1)
        acc = warpgroup_mma_init(acc * gl.convert_layout(alpha, o_rows)[:, None])
    if OUT == OUT_REGISTERS:
        # Every product that reads Q is done: the load warp may bring the next item's.
        mbarrier.arrive(q_free, count=1)
    last = (j0 + count - 1) % NS
    mbarrier.wait(v_ready.index(last), ((j0 + count - 1) // NS) & 1)
    acc = warpgroup_mma(p, v_smem.index(last).reshape([BN, D]), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(kv_free.index(last), count=1)
    _release(k_ready, v_ready, kv_free, j0 + count, n_blocks - own_hi)

    l_i = gl.convert_layout(gl.sum(l_i, 1), row_layout)
    out = acc / gl.convert_layout(l_i, o_rows)[:, None]
    if OUT != OUT_REGISTERS:
        if OUT == OUT_OWN_SLOT:
            # The last item's out has left the slot (the thread that issued its store waits, then all).
            tma.store_wait(0)
            barrier()
        slot: gl.constexpr = _out_slot(WG, q_smem.type.shape[0], OUT)
        q_smem.index(slot).reshape([ROWS, D]).store(out.to(q_smem.dtype))
        fence_async_shared()
        barrier()
        a, b, c = ragged_row(start, length, first)
        tma_store(o_desc, [a, b, c, head, 0], q_smem.index(slot))
    else:
        out_rows = gl.convert_layout(rows, o_rows)
        cols_d = gl.arange(0, D, layout=gl.SliceLayout(0, mma_o))
        offs = (start + out_rows).to(gl.int64)[:, None] * stride_ot + head * D + cols_d[None, :]
        gl.store(Out + offs, out.to(Out.dtype.element_ty), mask=(out_rows < length)[:, None])
    lse = (m_i + gl.log2(l_i)) * LN2
    gl.store(Lse + head * T + start + rows, lse, mask=rows < length)
    if OUT == OUT_Q_SLOT:
        # Out has left Q's slot: the load warp may bring the next item's Q.
        tma.store_wait(0)
        mbarrier.arrive(q_free, count=1)


@gluon.jit
def _row_shares(p):
    """[rows, 4]: p's row sums in four shares, one for each thread of the quad that holds a row of a product's
    accumulator (each thread two of every eight columns), so that no value crosses threads. Adding the shares
    once after the loop, where each block's row sums had been gathered across the quad, drops four shuffles
    and four adds a block from each thread (of some 460 in an unmasked step): on an H200, 1-2% faster at
    head dim 64 on the short mixes, 0.6-1.4% under a 512-token window, level to 0.7% elsewhere."""
    ROWS: gl.constexpr = p.shape[0]
    BN: gl.constexpr = p.shape[1]
    return gl.sum(gl.sum(gl.reshape(p, [ROWS, BN // 8, 4, 2]), 3), 1)


@gluon.jit
def _by_row(x, shares):
    """Per-row x in the layout of the row shares (the same registers: no data moves)."""
    return gl.convert_layout(x, gl.SliceLayout(1, shares.type.layout), assert_trivial=True)[:, None]


@gluon.jit
def _release(k_ready, v_ready, kv_free, j0, n):
    """Frees ring entries j0 .. j0 + n - 1, which the warpgroup does not read, each once it has landed: so
    that the arrival counts toward that entry's use of its slot, never an earlier one's."""
    NS: gl.constexpr = k_ready.type.shape[0]
    for j in range(j0, j0 + n):
        mbarrier.wait(k_ready.index(j % NS), (j // NS) & 1)
        mbarrier.wait(v_ready.index(j % NS), (j // NS) & 1)
        mbarrier.arrive(kv_free.index(j % NS), count=1)


@gluon.jit
def _mask(s, rows, j, n_blocks, last_row, left, BN: gl.constexpr, col_layout: gl.constexpr,
          WINDOW: gl.constexpr):
    """Scores of key block j with the keys a row does not see at -inf: after it (the last block holds the
    diagonal), or before its window."""
    if needs_mask(j, n_blocks - 1, last_row, left, BN, WINDOW):
        cols = j * BN + gl.arange(0, BN, layout=col_layout)
        # Without a window (one longer than every document), one compare an element instead of two.
        seen = cols[None, :] <= rows[:, None]
        if WINDOW:
            seen = seen & (cols[None, :] >= rows[:, None] - left)
        s = gl.where(seen, s, float("-inf"))
    return s


@gluon.jit
def _second_softmax_partition(args, OUT: gl.constexpr, WINDOW: gl.constexpr):
    _softmax_partition(args, 1, OUT, WINDOW)


@gluon.jit
def _third_softmax_partition(args, OUT: gl.constexpr, WINDOW: gl.constexpr):
    _softmax_partition(args, 2, OUT, WINDOW)


@gluon.jit
def _fwd_persistent_kernel(
    q_desc, k_desc, v_desc, o_desc, Out, Lse, tiles, n_tiles, cu_seqlens, n_docs, T, stride_ot, H, group, per,
    qk_scale, left, Counter, STAGES: gl.constexpr, PARTS: gl.constexpr, OUT: gl.constexpr,
    WINDOW: gl.constexpr,
):
    """Persistent: each program runs items (query tile, head) claimed from Counter until none is left."""
    # Q's slots, one per warpgroup, then out's where it has slots of its own.
    q_smem = gl.allocate_shared_memory(
        q_desc.dtype, [PARTS * _slots_per_part(OUT)] + q_desc.block_type.shape, q_desc.layout)
    k_smem, v_smem, q_bar, k_ready, v_ready, kv_free = tile_ring(k_desc, v_desc, STAGES, PARTS)
    q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_free, count=PARTS)
    items = gl.allocate_shared_memory(gl.int32, [2, FIELDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(item_ready.index(i), count=1)
        mbarrier.init(item_free.index(i), count=PARTS)

    args = (q_desc, k_desc, v_desc, o_desc, q_smem, k_smem, v_smem, q_bar, q_free, k_ready, v_ready,
            kv_free, items, item_ready, item_free, Counter, Out, Lse, tiles, n_tiles, cu_seqlens, n_docs, T,
            stride_ot, H, group, per, qk_scale, left)
    if PARTS == 2:
        gl.warp_specialize([
            (_softmax_partition, (args, 0, OUT, WINDOW)),
            (_second_softmax_partition, (args, OUT, WINDOW)),
            (_load_partition, (args, OUT)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_softmax_partition, (args, 0, OUT, WINDOW)),
            (_second_softmax_partition, (args, OUT, WINDOW)),
            (_third_softmax_partition, (args, OUT, WINDOW)),
            (_load_partition, (args, OUT)),
        ], [4, 4, 1], [160, 160, 24])


@gluon.jit
def _store_empty(Out, Lse, start, head, stride_ot, T, r0, q_len, BM: gl.constexpr, D: gl.constexpr):
    """Rows with nothing to attend to (the tail past the last document): out = 0, lse = -inf."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    store_zeros(Out, start, r0, q_len, head, stride_ot, BM, D, layout)
    rows = r0 + gl.arange(0, BM, layout=gl.SliceLayout(0, layout))
    minus_inf = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(0, layout))
    gl.store(Lse + head * T + start + rows, minus_inf, mask=rows < q_len)


def out_path(D: int, parts: int) -> int:
    """How out leaves the warpgroups (see OUT_REGISTERS): through Q's slot at head dim 128, where the
    shared memory is full; through slots of its own at 64 in 128-row tiles; else from registers."""
    if D == 128:
        return OUT_Q_SLOT.value
    return OUT_OWN_SLOT.value if parts == 2 else OUT_REGISTERS.value


@functools.cache
def section_heads(H_kv: int, group: int, keys: int, D: int, itemsize: int, cache_bytes: int) -> int:
    """Heads per section of the item order (see _item): whole kv groups, as many as divide the kv heads and
    whose K and V of `keys` keys fill at most half of L2, so that the section's K and V stay there beside
    the streams of Q and out."""
    per_kv_head = 2 * keys * D * itemsize
    fits = max(1, cache_bytes // 2 // per_kv_head)
    return group * max(c for c in range(1, H_kv + 1) if H_kv % c == 0 and c <= fits)


def forward(
    q, k, v, out, lse, tiles, cu_seqlens, softmax_scale: float, blocks, left: int, max_seqlen: int
) -> None:
    """Writes out [T, H, D] and lse [H, T] (as forward.py's kernel) for the query tiles of `tiles`, whose
    blocks are blocks.m rows, causal with query i seeing keys i - left .. i (left >= T: the whole past), in
    documents of at most max_seqlen tokens."""
    T, H, D = q.shape
    if blocks.n != 128 or blocks.m not in (128, 192) or blocks.warps != blocks.m // 16:
        raise ValueError(
            f"the Gluon forward runs 128-key blocks and a warpgroup (4 warps) per 64 query rows, not {blocks}"
        )
    parts = blocks.m // 64
    n_tiles = tiles.shape[1]
    H_kv = k.shape[1]
    # The keys a query tile reads: its document's up to it, or its window's.
    keys = min(max_seqlen, left + blocks.m)
    per = section_heads(H_kv, H // H_kv, keys, D, k.element_size(), l2_bytes(q.device))
    # One program per SM (up to 224 KB of shared memory each), and a fresh counter of claimed items.
    programs = min(n_tiles * H, sm_count(q.device))
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    _fwd_persistent_kernel[(programs,)](
        tma_descriptor(q, 64), tma_descriptor(k, blocks.n), tma_descriptor(v, blocks.n),
        tma_descriptor(out, 64), out, lse, tiles, n_tiles, cu_seqlens, cu_seqlens.numel() - 1, T,
        out.stride(0), H, H // H_kv, per,
        softmax_scale * LOG2E.value, left, counter, STAGES=blocks.stages, PARTS=parts, OUT=out_path(D, parts),
        WINDOW=left < T,
        num_warps=WARPS,
        maxnreg=max_registers(parts + 1),
    )
