"""The backward on Hopper in Gluon (head dim 64 or 128, causal): one warp-specialised pass (see hopper.py for
the partitions) per key tile and kv head computes dK and dV and adds each query block's share of dQ into
float32 sums, which a small Triton pass scales into dQ. It takes causal windows as the forward does.

The query blocks hold 8,192 elements of Q: 64 rows at head dim 128, 128 at 64. The two warpgroups split a
block's dQ into two [64, 64] tiles, by columns at head dim 128 and by rows at 64, so that each product's
operands are whole 128-byte rows of their swizzled tiles.
"""

import torch
import triton
import triton.language as tl
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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels.attention.hopper import (
    LOG2E,
    WARPS,
    barrier,
    load_pair,
    load_parts,
    mma_layout,
    ragged_row,
    store_zeros,
    table_entry,
    tile_ring,
    tma_add,
    tma_descriptor,
    tma_store,
)
from kernels.attention.tiles import program_tile
from kernels.common import max_registers

# ----------------------------------------------------------------------------------------------------------
# dK, dV and dQ: one program per (128-key tile, kv head); each warpgroup owns 64 of its keys
# and accumulates their dK and dV over the query blocks that the load warp streams; a writer warp adds each
# query block's share of dQ = dS K into float32 sums, in a fixed order of key tiles (so deterministically)

DQ_TILE = gl.constexpr(64)  # rows and columns of each warpgroup's share of a query block's dQ
# A dQ tile as the writer warp moves it: [32, 128] float32, in the order of the product's registers (see
# _thread_rows), unswizzled.
FLAT = (32, 128)
FLAT_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@gluon.jit
def _dkdv_load_partition(args):
    """One warp: K and V of the tile once, then Q and dO of each query block of each head of the group, and
    the block's lse (times log2 e) and delta beside them."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, kv_smem, ds_smem, kv_bar, q_ready, do_ready, qdo_free,
     dq_desc, stage, dq_full, dq_empty, stats, stats_ready, Lse, Delta, dk_desc, dv_desc, Counts, n_counted,
     segment, start, length, kv_head, group, c0, q_lo, n_q, left, T, qk_scale, sm_scale) = args
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    load_parts(k_desc, kv_smem, kv_bar, start, length, kv_head, c0, 0, 2)
    load_parts(v_desc, kv_smem, kv_bar, start, length, kv_head, c0, 2, 2)
    BM: gl.constexpr = q_desc.block_type.shape[2]
    HALF: gl.constexpr = k_desc.block_type.shape[2]
    lanes: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])
    j = 0
    for h in range(group):
        head = kv_head * group + h
        for qb in range(q_lo, n_q):
            slot = load_pair(
                q_desc, do_desc, q_smem, do_smem, q_ready, do_ready, qdo_free, start, length, head, qb, j
            )
            # The warpgroups read these in the layout of their products: loaded there themselves, they
            # would convert them through shared memory, with three barriers a step more (measured 0-3%
            # slower at head dim 128 on an H200, 7-9% at 64).
            queries = qb * BM + gl.arange(0, BM, layout=lanes)
            ok = queries < length
            lse = gl.load(Lse + head * T + start + queries, mask=ok, other=float("inf"))
            stats.index(2 * slot).store(lse * LOG2E)
            stats.index(2 * slot + 1).store(gl.load(Delta + head * T + start + queries, mask=ok, other=0.0))
            barrier()
            mbarrier.arrive(stats_ready.index(slot), count=1)
            j += 1
    _named_barrier(KV_OUT, 288)
    for part in gl.static_range(2):
        a, b, c = ragged_row(start, length, c0 + part * HALF)
        tma_store(dk_desc, [a, b, c, kv_head, 0], kv_smem.index(part))
        tma_store(dv_desc, [a, b, c, kv_head, 0], kv_smem.index(2 + part))
    tma.store_wait(0)


@gluon.jit
def _wait_count(counter, target):
    """Spins until the int32 at each address reaches target; the proxy fence orders the TMA writes that
    follow after what the count covers."""
    return gl.inline_asm_elementwise(
        """{
        .reg .pred done;
        spin_${:uid}:
        ld.relaxed.gpu.global.b32 $0, [$1];
        setp.ge.s32 done, $0, $2;
        @!done bra spin_${:uid};
        fence.proxy.async.global;
        }""",
        "=r,l,r", [counter, target], dtype=gl.int32, is_pure=False, pack=1,
    )


@gluon.jit
def _bulk_wait(x):
    """Waits until this thread's TMA writes are done (written, not only read from shared memory); returns
    x, to order what depends on them."""
    return gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1
    )


# Named hardware barriers (Triton's own partitions use ids 0-2) for the warpgroups' exchange of dS. Where
# each step's dQ is issued in that step, one barrier of both, where each warpgroup's own barrier, an
# mbarrier arrival and a wait on it had been (1% at head dim 64 on an H200, level at 128).
DS_EXCHANGE = gl.constexpr(8)
# Where it is issued in the next step (see _dq_late), DS_READY + 2 wg + buffer: warpgroup wg's half of dS in
# that buffer (its 128 threads arrive, the other's wait); DS_FREE + 2 wg + buffer: the other warpgroup has
# read it (the other's threads arrive, wg's wait before they store the next).
DS_READY = gl.constexpr(4)
DS_FREE = gl.constexpr(11)
# Both warpgroups past their last products, before K's and V's slots take dK and dV.
KV_DONE = gl.constexpr(9)
# dK and dV of both warpgroups in K's and V's slots (256 threads arrive) for the load warp's TMA stores.
KV_OUT = gl.constexpr(10)


@gluon.jit
def _on_barrier(op: gl.constexpr, index, threads: gl.constexpr):
    """`op` (bar.sync or bar.arrive) on named barrier `index` by every thread of the partition."""
    NW: gl.constexpr = gl.num_warps()
    each_thread: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    ids = gl.full([32 * NW], index, gl.int32, each_thread)
    counts = gl.full([32 * NW], threads, gl.int32, each_thread)
    gl.inline_asm_elementwise(
        op + " $1, $2; mov.b32 $0, $1;", "=r,r,r", [ids, counts], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _named_barrier(index, threads: gl.constexpr):
    """Every thread of the partition waits at named barrier `index` until `threads` threads in all have."""
    _on_barrier("bar.sync", index, threads)


@gluon.jit
def _named_arrive(index, threads: gl.constexpr):
    """Every thread of the partition counts towards named barrier `index` and goes on without waiting."""
    _on_barrier("bar.arrive", index, threads)


@gluon.jit
def _dq_writer_partition(args):
    """One warp: each step's dQ tiles of both warpgroups into the float32 sums, by TMA. The contributions to a
    query block come from the last key tile that it sees down to the first: the order in which the key
    tiles reach it, since tile c visits query blocks from its diagonal on and tile c + 1's diagonal is
    later. A tile's tiles are stored when it is the first, else added once the block's count says
    that the `rank` tiles before it are done; the count is raised once the writes have landed. The tile
    table runs a document's last key tile first, so the tile a program waits for has already started.
    Where each step's dQ is issued in that step, the writer also frees the step's Q/dO slot."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, kv_smem, ds_smem, kv_bar, q_ready, do_ready, qdo_free,
     dq_desc, stage, dq_full, dq_empty, stats, stats_ready, Lse, Delta, dk_desc, dv_desc, Counts, n_counted,
     segment, start, length, kv_head, group, c0, q_lo, n_q, left, T, qk_scale, sm_scale) = args
    BM: gl.constexpr = q_desc.block_type.shape[2]
    NS: gl.constexpr = q_smem.type.shape[0]
    ROWS: gl.constexpr = dq_desc.block_type.shape[0]
    TILE: gl.constexpr = 2 * k_desc.block_type.shape[2]
    lanes: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    zero_each = gl.zeros([32], gl.int32, lanes)
    one_each = gl.full([32], 1, gl.int32, lanes)
    tile = c0 // TILE
    last_tile = (length - 1) // TILE
    j = 0
    for h in range(group):
        head = kv_head * group + h
        for qb in range(q_lo, n_q):
            buf = j % 2
            # Key tiles after this one up to the last that this block's rows see have written to it before.
            rank = gl.minimum((gl.minimum(qb * BM + BM, length) - 1) // TILE, last_tile) - tile
            at = head * n_counted + start // BM + segment + qb
            mbarrier.wait(dq_full.index(buf), (j // 2) & 1)
            if not _dq_late(BM):
                # Both warpgroups, which hand a step's tiles over in the next step, are past every product
                # of step j: its Q/dO slot goes back to the load warp. One arrival a step, where each
                # warpgroup arrived behind a barrier of its threads: measured level on an H200, with one
                # barrier fewer in each warpgroup's step.
                mbarrier.arrive(qdo_free.index(j % NS), count=1)
            if rank > 0:
                _wait_count(Counts + at + zero_each, 32 * rank)
            for wg in gl.static_range(2):
                src = stage.index(2 * buf + wg)
                if rank == 0:
                    tma_store(dq_desc, [(2 * at + wg) * ROWS, 0], src)
                else:
                    tma_add(dq_desc, [(2 * at + wg) * ROWS, 0], src)
            # Each lane raises the count once its own writes (the TMA's, from one of them) have landed.
            gl.atomic_add(Counts + at + _bulk_wait(zero_each), one_each, sem="release", scope="gpu")
            mbarrier.arrive(dq_empty.index(buf), count=1)
            j += 1


@gluon.jit
def _thread_rows(dq):
    """A [64, 64] product's accumulator as [32, 128], so that each thread's four consecutive registers
    are four adjacent elements and a warp's lanes cover a 512-byte row: its store to shared memory is a
    few conflict-free 16-byte stores, where the tile itself takes twice as many 8-byte ones. Row r = 16 w +
    8 h + i and column c = 8 g + 2 l + p of the tile (warp w, lane 4 i + l, register 4 g + 2 h + p) go to
    row 4 g + w and column 16 i + 4 l + 2 h + p; _dq_from_sums reads them back from there."""
    x = gl.reshape(dq, [4, 2, 8, 8, 4, 2])  # (w, h, i, g, l, p)
    x = gl.permute(x, (3, 0, 2, 4, 1, 5))  # (g, w, i, l, h, p)
    return gl.reshape(x, [32, 128])


@gluon.jit
def _dq_columns(k, WG: gl.constexpr):
    """Of K [keys, D], the columns of warpgroup WG's dQ tile: its half at head dim 128, all at 64."""
    D: gl.constexpr = k.type.shape[1]
    if D > DQ_TILE:
        k = k.slice(WG * DQ_TILE, DQ_TILE, dim=1)
    return k


@gluon.jit
def _dq_rows(ds, WG: gl.constexpr):
    """Of dS^T [keys, queries], the queries of warpgroup WG's dQ tile: all in 64-query blocks, its half in
    128-query blocks."""
    BM: gl.constexpr = ds.type.shape[1]
    if BM > DQ_TILE:
        ds = ds.slice(WG * DQ_TILE, DQ_TILE, dim=1)
    return ds


@gluon.jit
def _seen(keys, qb, left, BM: gl.constexpr, query_layout: gl.constexpr):
    """[keys, queries] of query block qb: whether the query sees the key (at most `left` keys back)."""
    queries = qb * BM + gl.arange(0, BM, layout=query_layout)
    return (queries[None, :] >= keys[:, None]) & (queries[None, :] <= keys[:, None] + left)


@gluon.jit
def _dkdv_step(args, dv, dk, j, qb, steps, keys, first_key, last_key, zeros, zeros_q, WG: gl.constexpr,
               FIRST: gl.constexpr):
    """Step j of warpgroup WG (query block qb): its dV and dK products, and its dQ tile of the step (of step
    j - 1 where dQ is late, see _dq_late; FIRST: step 0, which then has none)."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, kv_smem, ds_smem, kv_bar, q_ready, do_ready, qdo_free,
     dq_desc, stage, dq_full, dq_empty, stats, stats_ready, Lse, Delta, dk_desc, dv_desc, Counts, n_counted,
     segment, start, length, kv_head, group, c0, q_lo, n_q, left, T, qk_scale, sm_scale) = args
    BM: gl.constexpr = q_desc.block_type.shape[2]
    HALF: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[4]
    NS: gl.constexpr = q_smem.type.shape[0]
    mma_s: gl.constexpr = mma_layout(BM)
    mma_d: gl.constexpr = mma_layout(D)
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_d, k_width=2)
    query_layout: gl.constexpr = gl.SliceLayout(0, mma_s)
    # With 128-query blocks a thread's share of a query vector is as large as its share of dK. There S
    # starts from -inf where a query does not see a key and dP from -delta, so that the mask and dP - delta
    # come out of the products and no such vector is held beside their accumulators: without, the loop
    # spilled (under triton 3.6, 4 values a step with lse and delta staged, 79 with them loaded here), and
    # folding the mask too measured 3% faster on an H200. With 64-query blocks folding measured 1-3% slower.
    FOLD: gl.constexpr = BM > DQ_TILE
    LATE: gl.constexpr = _dq_late(BM)
    slot = j % NS
    phase = (j // NS) & 1
    q = q_smem.index(slot).reshape([BM, D])
    do = do_smem.index(slot).reshape([BM, D])
    # K and V by an index the compiler cannot prove constant (qb >> 30 is 0 for every real block):
    # hoisted out of the loop, their products' shared-memory descriptors made ptxas spill (17-25
    # local loads and stores a step, 3% of the backward on an H200); rebuilt each step, none.
    kv = qb >> 30
    k = kv_smem.index(WG + kv).reshape([HALF, D])
    v = kv_smem.index(2 + WG + kv).reshape([HALF, D])
    # The B operands of this warpgroup's dQ tile, for each half of the keys.
    k_first = _dq_columns(kv_smem.index(kv).reshape([HALF, D]), WG)
    k_second = _dq_columns(kv_smem.index(1 + kv).reshape([HALF, D]), WG)
    masked = (qb * BM < last_key) | (qb * BM + BM - 1 > first_key + left)
    mbarrier.wait(q_ready.index(slot), phase)
    if FOLD:
        s = zeros
        if masked:
            s = gl.where(_seen(keys, qb, left, BM, query_layout), zeros, float("-inf"))
        s = warpgroup_mma(k, q.permute((1, 0)), s, use_acc=masked, is_async=True)
    else:
        s = warpgroup_mma(k, q.permute((1, 0)), zeros, use_acc=False, is_async=True)
    if not LATE:
        # Step j - 1's dQ tile goes to the writer (which then frees its Q/dO slot) once this step's S is
        # issued: at the end of step j - 1 the fence after the tile's stores holds the warpgroup longer
        # than its last product takes (9% of its stall samples on mix (c) of scripts/bench_attention.py,
        # Nsight Compute), and S would wait behind it. On an H200, 0.5-1.5% faster on mixes (a) and (c).
        # (j + 1) % 2 is step j - 1's buffer; step 0 has none to hand over.
        _hand_over_dq(dq_full, (j + 1) % 2, j > 0)
    mbarrier.wait(do_ready.index(slot), phase)
    mbarrier.wait(stats_ready.index(slot), phase)
    if FOLD:
        # -delta in every row, as a value of its own per (key, query): one value in two
        # accumulator registers is copied after the product's fence, and ptxas then made dP's
        # product wait for S's (warning C7517). Each row adds its own zero (key times 0.0).
        row_zeros = keys.to(gl.float32) * 0.0
        dp = row_zeros[:, None] - stats.index(2 * slot + 1).load(query_layout)[None, :]
        dp = warpgroup_mma(v, do.permute((1, 0)), dp, is_async=True)
    else:
        dp = warpgroup_mma(v, do.permute((1, 0)), zeros, use_acc=False, is_async=True)
    if FOLD:
        # With 128-query blocks the exponentials are placed under dP's product: 0.5-1% faster on an
        # H200 (neither triton build spills). dV's product is issued before dP's wait, which ptxas then
        # cannot move above them (it ran about 50 of the 64 after that wait otherwise): with dQ late,
        # 0.5-5% faster on an H200 (measured 1-1.5% slower with each step's dQ issued in that step).
        # With 64-query blocks (head dim 128) both orders measured slower: the exponentials under dP's
        # product 1% (triton 3.6's build then spills the shared-memory base in one warpgroup's loop and
        # reloads it from local memory 4 times a step; 1.3-3% with all of them held above dP's wait by a
        # barrier of the warpgroup), and dV's product before dP's wait too 1-2.5% (0.5-3% with dQ late, level
        # on (c)).
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        p = gl.exp2(s * qk_scale - stats.index(2 * slot).load(query_layout)[None, :])
        dv = warpgroup_mma(gl.convert_layout(p.to(q_desc.dtype), operand), do, dv, is_async=True)
        dp = warpgroup_mma_wait(num_outstanding=1, deps=(dp, ))
        ds = (p * dp).to(q_desc.dtype)
    else:
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
        p = gl.exp2(s * qk_scale - stats.index(2 * slot).load(query_layout)[None, :])
        if masked:
            p = gl.where(_seen(keys, qb, left, BM, query_layout), p, 0.0)
        ds = (p * (dp - stats.index(2 * slot + 1).load(query_layout)[None, :])).to(q_desc.dtype)
    # dS^T of both warpgroups in shared memory, two buffers deep: a warpgroup overwrites its half of a
    # buffer only once the other's dQ products have read it (where dQ is issued in the step itself, the
    # other has by the time both meet at the next step's barrier). With 64-query blocks dS is stored
    # before dV's product is issued, so that the fence that follows does not wait for stores queued
    # behind the product's issue (2% faster at head dim 128 on an H200).
    buf = j % 2
    if LATE and j >= 2:
        # The other warpgroup's dQ products of step j - 2 have read this warpgroup's half of buf.
        _named_barrier(DS_FREE + 2 * WG + buf, 256)
    ds_smem.index(2 * buf + WG).store(ds)
    if not FOLD:
        dv = warpgroup_mma(gl.convert_layout(p.to(q_desc.dtype), operand), do, dv, is_async=True)
    fence_async_shared()
    if LATE:
        _named_arrive(DS_READY + 2 * WG + buf, 256)
        if not FIRST:
            # The other warpgroup's half of dS(j - 1); the wait also holds this warpgroup's threads until
            # all have passed their own stores of it.
            _named_barrier(DS_READY + 2 * (1 - WG) + 1 - buf, 256)
            dq = _dq_products(ds_smem, k_first, k_second, zeros_q, 1 - buf, WG)
    else:
        _named_barrier(DS_EXCHANGE, 256)
        dq = _dq_products(ds_smem, k_first, k_second, zeros_q, buf, WG)
    # dK last, so that dQ is staged for the writer while it runs (1% faster at head dim 64 than
    # issuing dK before the exchange of dS, on an H100 and an H200).
    dk = warpgroup_mma(gl.convert_layout(ds, operand), q, dk, is_async=True)
    if LATE and FIRST:
        dv = warpgroup_mma_wait(num_outstanding=1, deps=(dv, ))
    elif LATE:
        dv, dq = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq))
        _stage_dq(dq, stage, dq_empty, j - 1, WG)
        _hand_over_dq(dq_full, (j - 1) % 2)
        if j < steps - 1:
            # This warpgroup's products have read the other's half of dS(j - 1).
            _named_arrive(DS_FREE + 2 * (1 - WG) + 1 - buf, 256)
    else:
        dv, dq = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq))
        _stage_dq(dq, stage, dq_empty, j, WG)
    dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ))
    if LATE:
        mbarrier.arrive(qdo_free.index(slot), count=1)
    dv = warpgroup_mma_init(dv)
    dk = warpgroup_mma_init(dk)
    return dv, dk


@gluon.jit
def _dkdv_partition(args, WG: gl.constexpr):
    """Warpgroup WG: dV = sum over query blocks of P^T dO and dK = sum of dS^T Q for keys
    c0 + 64 WG .. c0 + 64 WG + 63, computed transposed ([keys, queries]) so that the keys stay rows, and
    tile WG of each query block's dQ = dS K over the tile's 128 keys (columns 64 WG .. 64 WG + 63 at head
    dim 128, rows at 64), with the other warpgroup's half of dS from shared memory, handed to the writer
    warp through a staging buffer."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, kv_smem, ds_smem, kv_bar, q_ready, do_ready, qdo_free,
     dq_desc, stage, dq_full, dq_empty, stats, stats_ready, Lse, Delta, dk_desc, dv_desc, Counts, n_counted,
     segment, start, length, kv_head, group, c0, q_lo, n_q, left, T, qk_scale, sm_scale) = args
    BM: gl.constexpr = q_desc.block_type.shape[2]
    HALF: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[4]
    mma_s: gl.constexpr = mma_layout(BM)
    mma_d: gl.constexpr = mma_layout(D)
    mma_q: gl.constexpr = mma_layout(DQ_TILE)

    first_key = c0 + WG * HALF
    last_key = first_key + HALF - 1
    keys = first_key + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma_s))
    zeros = gl.zeros([HALF, BM], gl.float32, mma_s)
    zeros_q = gl.zeros([DQ_TILE, DQ_TILE], gl.float32, mma_q)
    dk = warpgroup_mma_init(gl.zeros([HALF, D], gl.float32, mma_d))
    dv = warpgroup_mma_init(gl.zeros([HALF, D], gl.float32, mma_d))
    mbarrier.wait(kv_bar, 0)
    steps = group * (n_q - q_lo)
    LATE: gl.constexpr = _dq_late(BM)
    if LATE:
        # The first step apart, which issues no dQ products, so that no product's accumulator is defined
        # on one path of a branch (ptxas then serialises the products, its warning C7515).
        dv, dk = _dkdv_step(args, dv, dk, 0, q_lo, steps, keys, first_key, last_key, zeros, zeros_q, WG, True)
        for j in range(1, steps):
            qb = q_lo + j % (n_q - q_lo)
            dv, dk = _dkdv_step(args, dv, dk, j, qb, steps, keys, first_key, last_key, zeros, zeros_q, WG,
                                False)
    else:
        j = 0
        for _ in range(group):
            for qb in range(q_lo, n_q):
                dv, dk = _dkdv_step(args, dv, dk, j, qb, steps, keys, first_key, last_key, zeros, zeros_q, WG,
                                    False)
                j += 1
    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
    if LATE:
        _named_barrier(DS_READY + 2 * (1 - WG) + (steps - 1) % 2, 256)
        k_first = _dq_columns(kv_smem.index(0).reshape([HALF, D]), WG)
        k_second = _dq_columns(kv_smem.index(1).reshape([HALF, D]), WG)
        dq = _dq_products(ds_smem, k_first, k_second, zeros_q, (steps - 1) % 2, WG)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        _stage_dq(dq, stage, dq_empty, steps - 1, WG)
    # The last step's tile.
    _hand_over_dq(dq_full, (steps - 1) % 2)

    # dK and dV leave through the slots of K and V by TMA, once neither warpgroup's products read those:
    # whole rows, where stores from the products' registers write 16 bytes of a row at a time. On an H200
    # the backward measured 4-8% faster on mixes (a) and (b) of scripts/bench_attention.py. The load warp
    # issues the stores and waits for them, so that the warpgroups hold no descriptors or row arithmetic
    # for it: 1-2% faster at head dim 64 than the warpgroups storing their own halves, level at 128.
    _named_barrier(KV_DONE, 256)
    kv_smem.index(WG).reshape([HALF, D]).store((dk * sm_scale).to(k_desc.dtype))
    kv_smem.index(2 + WG).reshape([HALF, D]).store(dv.to(v_desc.dtype))
    fence_async_shared()
    _named_arrive(KV_OUT, 288)


@gluon.constexpr_function
def _dq_late(bm):
    """1 where each step's dQ products are issued in the next step, after that step's dV, so that neither
    warpgroup waits for the other's dS of the step it is in and each may run up to a step ahead: with
    128-query blocks (head dim 64), where on an H200 the backward measured 3-4.5% faster on mixes (a) and (b)
    of scripts/bench_attention.py and 2.5% on (c) (gradients bitwise equal). With 64-query blocks (head dim
    128) it measured 0.5-2% slower: there each step's dQ is issued once both warpgroups' dS is stored."""
    return 1 if bm > DQ_TILE.value else 0


@gluon.jit
def _dq_products(ds_smem, k_first, k_second, zeros_q, buf, WG: gl.constexpr):
    """Issues warpgroup WG's dQ tile from both halves of dS^T in buffer buf."""
    dq = warpgroup_mma(_dq_rows(ds_smem.index(2 * buf), WG).permute((1, 0)), k_first, zeros_q,
                       use_acc=False, is_async=True)
    return warpgroup_mma(_dq_rows(ds_smem.index(2 * buf + 1), WG).permute((1, 0)), k_second, dq,
                         is_async=True)


@gluon.jit
def _stage_dq(dq, stage, dq_empty, i, WG: gl.constexpr):
    """Stores warpgroup WG's dQ tile of step i into its staging buffer for the writer warp (see
    _hand_over_dq)."""
    buf = i % 2
    # A staging buffer's first use waits on phase 1, which a fresh mbarrier counts as complete.
    mbarrier.wait(dq_empty.index(buf), ((i // 2) & 1) ^ 1)
    stage.index(2 * buf + WG).store(_thread_rows(dq))


@gluon.jit
def _hand_over_dq(dq_full, buf, pred=True):
    """Tells the writer warp that this warpgroup's dQ tile is in staging buffer buf (where pred holds)."""
    fence_async_shared()
    barrier()
    mbarrier.arrive(dq_full.index(buf), count=1, pred=pred)


@gluon.jit
def _dkdv_second_partition(args):
    _dkdv_partition(args, 1)


@gluon.jit
def _dkdv_kernel(
    q_desc, do_desc, k_desc, v_desc, dq_desc, Lse, Delta, dk_desc, dv_desc, dK, dV, Counts, n_counted, tiles,
    n_tiles, cu_seqlens, n_docs, T, stride_kvt, group, qk_scale, sm_scale, left, STAGES: gl.constexpr,
):
    BM: gl.constexpr = q_desc.block_type.shape[2]
    HALF: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[4]
    segment, start, length, c0, n_blocks = table_entry(
        gl.program_id(0), tiles, n_tiles, cu_seqlens, n_docs, T, 2 * HALF, BM
    )
    if segment < 0:
        return
    kv_head = gl.program_id(1)
    if n_blocks == 0:  # the tail past the last document: no query sees its keys
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        store_zeros(dK, start, c0, length, kv_head, stride_kvt, 2 * HALF, D, layout)
        store_zeros(dV, start, c0, length, kv_head, stride_kvt, 2 * HALF, D, layout)
        return

    # A Q/dO slot is freed by both warpgroups where dQ is late, else by the writer warp.
    q_smem, do_smem, kv_bar, q_ready, do_ready, qdo_free = tile_ring(
        q_desc, do_desc, STAGES, 2 if _dq_late(BM) else 1)
    kv_smem = gl.allocate_shared_memory(k_desc.dtype, [4] + k_desc.block_type.shape, k_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ds_smem = gl.allocate_shared_memory(k_desc.dtype, [4, HALF, BM], ds_layout)
    # Each warpgroup's dQ tile of a step, two steps deep, for the writer warp.
    stage = gl.allocate_shared_memory(gl.float32, [4] + dq_desc.block_type.shape, dq_desc.layout)
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # lse and delta of the query blocks in the ring, [2 * slot] and [2 * slot + 1].
    stats = gl.allocate_shared_memory(gl.float32, [2 * STAGES, BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    stats_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(stats_ready.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(dq_full.index(i), count=2)
        mbarrier.init(dq_empty.index(i), count=1)
    # The tile's keys are seen by query blocks c0 / BM .. n_q - 1: up to the one that holds its last key
    # plus the window.
    n_q = gl.cdiv(gl.minimum(c0 + 2 * HALF + left, length), BM)
    args = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, kv_smem, ds_smem, kv_bar, q_ready, do_ready,
            qdo_free, dq_desc, stage, dq_full, dq_empty, stats, stats_ready, Lse, Delta, dk_desc, dv_desc,
            Counts, n_counted, segment, start, length, kv_head, group, c0, c0 // BM, n_q, left, T, qk_scale,
            sm_scale)
    gl.warp_specialize([
        (_dkdv_partition, (args, 0)),
        (_dkdv_second_partition, (args, )),
        (_dkdv_load_partition, (args, )),
        (_dq_writer_partition, (args, )),
    ], [4, 1, 1], [240, 24, 24])


@triton.jit
def _dq_from_sums(
    Sums, dQ, tiles, n_tiles, cu_seqlens, n_docs, T, n_counted, stride_t, sm_scale, BM: tl.constexpr,
    D: tl.constexpr, BLOCK: tl.constexpr,
):
    """dQ of the rows of a tile of the dQ table of the pass's documents: the float32 sums that the dK/dV pass
    left, two [64, 64] tiles per query block of BM rows (its column halves at head dim 128, its row halves
    at 64), scaled and cast. The tail past the last document (segment n_docs), which no key tile writes,
    gets zeros."""
    segment, block, first, length, _ = program_tile(tiles, n_tiles, cu_seqlens, n_docs, T)
    if segment < 0:
        return
    head = tl.program_id(1)
    rows = block * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    qb = rows // BM
    # One of the two terms is 0: the tile is the column half at head dim 128, the row half at 64.
    part = (rows % BM // DQ_TILE)[:, None] + cols[None, :] // DQ_TILE
    at = 2 * (head * n_counted + first // BM + segment + qb)[:, None] + part
    # Where _thread_rows put (r, c) of the tile.
    r = (rows % DQ_TILE)[:, None]
    c = (cols % DQ_TILE)[None, :]
    flat = (c // 8 * 4 + r // 16) * 128 + r % 8 * 16 + c % 8 // 2 * 4 + r % 16 // 8 * 2 + c % 2
    offs = at.to(tl.int64) * (DQ_TILE * DQ_TILE) + flat
    acc = tl.load(Sums + offs, mask=(rows < length)[:, None] & (segment < n_docs), other=0.0)
    offs = (first + rows).to(tl.int64)[:, None] * stride_t + head * D + cols[None, :]
    tl.store(dQ + offs, (acc * sm_scale).to(dQ.dtype.element_ty), mask=(rows < length)[:, None])


def backward_dkdv(
    dout, q, k, v, lse, delta, dq, dk, dv, tiles, dq_tiles, cu_seqlens, softmax_scale: float, blocks,
    dq_block: int, left: int,
) -> None:
    """Writes dk and dv [T, H_kv, D] for the key tiles of `tiles`, and dq [T, H, D] for the query tiles of
    `dq_tiles` (dq_block rows each, over the same documents), causal with query i seeing keys
    i - left .. i (left >= T: the whole past), from delta as the delta pass writes it. `tiles` must list
    each document's key tiles from the last to the first."""
    T, H, D = q.shape
    if (blocks.m * D, blocks.n, blocks.warps) != (8192, 128, 8):
        raise ValueError(
            f"the Gluon dK/dV pass runs query blocks of 8,192 elements and two 64-key warpgroups, not "
            f"{blocks} at head dim {D}"
        )
    n_tiles, n_docs = tiles.shape[1], cu_seqlens.numel() - 1
    # A count per (head, query block); block b of a document from token s is s // m + its segment + b,
    # which no block of another document shares. Its float32 dQ sums: two [64, 64] tiles, each in the order
    # of _thread_rows.
    n_counted = T // blocks.m + n_docs + 1
    counts = torch.zeros(H * n_counted, dtype=torch.int32, device=q.device)
    sums = torch.empty(2 * counts.numel() * FLAT[0], FLAT[1], dtype=torch.float32, device=q.device)
    sums_desc = TensorDescriptor(sums, list(sums.shape), list(sums.stride()), list(FLAT), FLAT_LAYOUT)
    # The grid runs a kv head's tiles, then the next head's: with the heads of a tile adjacent instead, the
    # backward measured 2x slower on mix (c) of scripts/bench_attention.py (an H100).
    _dkdv_kernel[(n_tiles, k.shape[1])](
        tma_descriptor(q, blocks.m), tma_descriptor(dout, blocks.m), tma_descriptor(k, blocks.n // 2),
        tma_descriptor(v, blocks.n // 2), sums_desc, lse, delta, tma_descriptor(dk, blocks.n // 2),
        tma_descriptor(dv, blocks.n // 2), dk, dv, counts, n_counted, tiles, n_tiles,
        cu_seqlens, n_docs, T, dk.stride(0), H // k.shape[1], softmax_scale * LOG2E.value, softmax_scale,
        left, STAGES=blocks.stages, num_warps=WARPS, maxnreg=max_registers(3),
    )
    _dq_from_sums[(dq_tiles.shape[1], H)](
        sums, dq, dq_tiles, dq_tiles.shape[1], cu_seqlens, n_docs, T, n_counted, dq.stride(0), softmax_scale,
        BM=blocks.m, D=D, BLOCK=dq_block,
    )
