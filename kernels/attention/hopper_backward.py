"""The dQ and dK/dV passes of long documents on Hopper in Gluon, warp-specialised (see hopper.py for the
partitions); one program per entry of the tile table and head (dQ) or kv head (dK/dV). Both take causal
windows as the forward does.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from kernels.attention.hopper import (
    LOG2E,
    MAX_REGISTERS,
    WARPS,
    first_block,
    load_halves,
    mma_layout,
    needs_mask,
    store_zeros,
    stream_pairs,
    table_entry,
    tile_ring,
    tma_descriptor,
    transposed_slot,
)

# ----------------------------------------------------------------------------------------------------------
# dQ of long documents: the same partitions, with Q and dO held and dQ += dS K accumulated over key blocks


@gluon.jit
def _dq_load_partition(args):
    """One warp: Q and dO once, then K and V of each key block the tile sees."""
    (q_desc, do_desc, k_desc, v_desc, qdo_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, Out, dOut,
     Lse, dLse, Delta, dQ, start, length, head, kv_head, r0, lo, n_blocks, left, T, stride_t, qk_scale,
     sm_scale) = args
    mbarrier.expect(q_bar, 4 * q_desc.block_type.nbytes)
    load_halves(q_desc, qdo_smem, q_bar, start, length, head, r0, 0)
    load_halves(do_desc, qdo_smem, q_bar, start, length, head, r0, 2)
    stream_pairs(
        k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, kv_free, start, length, kv_head, lo, n_blocks, 0
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
     Lse, dLse, Delta, dQ, start, length, head, kv_head, r0, lo, n_blocks, left, T, stride_t, qk_scale,
     sm_scale) = args
    HALF: gl.constexpr = q_desc.block_type.shape[2]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[4]
    NS: gl.constexpr = k_smem.type.shape[0]
    mma_s: gl.constexpr = mma_layout(BN)
    mma_d: gl.constexpr = mma_layout(D)
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_d, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_s)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_s)
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])

    first = r0 + HALF_INDEX * HALF
    last_row = first + HALF - 1
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

    # Ring entry i holds key block lo + i.
    mbarrier.wait(k_ready.index(0), 0)
    mbarrier.wait(v_ready.index(0), 0)
    s = warpgroup_mma(q, transposed_slot(k_smem, 0, BN, D), zeros, use_acc=False, is_async=True)
    dp = warpgroup_mma(do, transposed_slot(v_smem, 0, BN, D), zeros, use_acc=False, is_async=True)
    s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
    ds = _dq_scores(s, dp, lse, delta, rows, lo, r0, last_row, left, BN, qk_scale, col_layout, ds_layout,
                    k_smem.dtype)
    dq = warpgroup_mma_init(gl.zeros([HALF, D], gl.float32, mma_d))
    for i in range(1, n_blocks - lo):
        slot = i % NS
        prev = (i - 1) % NS
        phase = (i // NS) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        s = warpgroup_mma(q, transposed_slot(k_smem, slot, BN, D), zeros, use_acc=False,
                          is_async=True)
        mbarrier.wait(v_ready.index(slot), phase)
        dp = warpgroup_mma(do, transposed_slot(v_smem, slot, BN, D), zeros, use_acc=False,
                           is_async=True)
        dq = warpgroup_mma(ds, k_smem.index(prev).reshape([BN, D]), dq, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=1, deps=(s, dp))
        ds = _dq_scores(s, dp, lse, delta, rows, lo + i, r0, last_row, left, BN, qk_scale, col_layout,
                        ds_layout, k_smem.dtype)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        mbarrier.arrive(kv_free.index(prev), count=1)
        dq = warpgroup_mma_init(dq)
    last = (n_blocks - lo - 1) % NS
    dq = warpgroup_mma(ds, k_smem.index(last).reshape([BN, D]), dq, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
    mbarrier.arrive(kv_free.index(last), count=1)

    rows_d = first + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma_d))
    cols_d = gl.arange(0, D, layout=gl.SliceLayout(0, mma_d))
    offs = (start + rows_d).to(gl.int64)[:, None] * stride_t + head * D + cols_d[None, :]
    gl.store(dQ + offs, (dq * sm_scale).to(dQ.dtype.element_ty), mask=(rows_d < length)[:, None])


@gluon.jit
def _dq_scores(s, dp, lse, delta, rows, j, r0, last_row, left, BN: gl.constexpr, qk_scale,
               col_layout: gl.constexpr, ds_layout: gl.constexpr, dtype: gl.constexpr):
    """dS of key block j as the A operand of dS K; key blocks from the tile's first row r0 on need the
    causal mask, and those before a row's window the window's."""
    p = gl.exp2(s * qk_scale - lse[:, None])
    if needs_mask(j, r0 // BN, last_row, left, BN):
        cols = j * BN + gl.arange(0, BN, layout=col_layout)
        p = gl.where((cols[None, :] <= rows[:, None]) & (cols[None, :] >= rows[:, None] - left), p, 0.0)
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
    stride_t, group, qk_scale, sm_scale, left, HAS_DLSE: gl.constexpr, STAGES: gl.constexpr,
):
    HALF: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[4]
    segment, start, length, r0, n_blocks = table_entry(
        gl.program_id(0), tiles, n_tiles, cu_seqlens, n_docs, T, 2 * HALF, k_desc.block_type.shape[2]
    )
    if segment < 0:
        return
    head = gl.program_id(1)
    if n_blocks == 0:
        _dq_empty(Out, dOut, dLse, Delta, dQ, start, head, r0, length, T, stride_t, 2 * HALF, D, HAS_DLSE)
        return

    qdo_smem = gl.allocate_shared_memory(q_desc.dtype, [4] + q_desc.block_type.shape, q_desc.layout)
    k_smem, v_smem, q_bar, k_ready, v_ready, kv_free = tile_ring(k_desc, v_desc, STAGES)

    args = (q_desc, do_desc, k_desc, v_desc, qdo_smem, k_smem, v_smem, q_bar, k_ready, v_ready, kv_free, Out,
            dOut, Lse, dLse, Delta, dQ, start, length, head, head // group, r0,
            first_block(r0, left, k_desc.block_type.shape[2]), n_blocks, left, T, stride_t, qk_scale,
            sm_scale)
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
    store_zeros(dQ, start, r0, length, head, stride_t, BM, D, layout)


# ----------------------------------------------------------------------------------------------------------
# dK and dV of long documents: one program per (128-key tile, kv head); each warpgroup owns 64 of its keys
# and accumulates their dK and dV over the query blocks that the load warp streams


@gluon.jit
def _dkdv_load_partition(args):
    """One warp: K and V of the tile once, then Q and dO of each query block of each head of the group."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, kv_smem, kv_bar, q_ready, do_ready, qdo_free, Lse,
     Delta, dK, dV, start, length, kv_head, group, c0, q_lo, n_q, left, T, stride_kvt, qk_scale,
     sm_scale) = args
    mbarrier.expect(kv_bar, 4 * k_desc.block_type.nbytes)
    load_halves(k_desc, kv_smem, kv_bar, start, length, kv_head, c0, 0)
    load_halves(v_desc, kv_smem, kv_bar, start, length, kv_head, c0, 2)
    j = 0
    for h in range(group):
        j = stream_pairs(q_desc, do_desc, q_smem, do_smem, q_ready, do_ready, qdo_free, start, length,
                          kv_head * group + h, q_lo, n_q, j)


@gluon.jit
def _dkdv_partition(args, WG: gl.constexpr):
    """Warpgroup WG: dV = sum over query blocks of P^T dO and dK = sum of dS^T Q for keys
    c0 + 64 WG .. c0 + 64 WG + 63, computed transposed ([keys, queries]) so that the keys stay rows. Of the
    query blocks q_lo .. n_q - 1 that the load warp streams, a warpgroup skips those that see none of its
    keys: the first for WG 1 (its keys come after every query there), the last under a window for WG 0
    (their queries' windows end before its keys)."""
    (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, kv_smem, kv_bar, q_ready, do_ready, qdo_free, Lse,
     Delta, dK, dV, start, length, kv_head, group, c0, q_lo, n_q, left, T, stride_kvt, qk_scale,
     sm_scale) = args
    BM: gl.constexpr = q_desc.block_type.shape[2]
    HALF: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[4]
    NS: gl.constexpr = q_smem.type.shape[0]
    mma_s: gl.constexpr = mma_layout(BM)
    mma_d: gl.constexpr = mma_layout(D)
    operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_d, k_width=2)
    query_layout: gl.constexpr = gl.SliceLayout(0, mma_s)
    vector: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])

    first_key = c0 + WG * HALF
    last_key = first_key + HALF - 1
    # The query blocks whose rows see some of these keys end with the one that holds last_key + left.
    q_hi = gl.minimum(gl.cdiv(last_key + 1 + left, BM), n_q)
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
        for qb in range(q_lo + WG, q_hi):
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
            # Masked: the diagonal blocks (queries before some key) and those at the window's end (queries
            # whose window begins after some key).
            if (qb * BM < last_key) | (qb * BM + BM - 1 > first_key + left):
                cols = qb * BM + gl.arange(0, BM, layout=query_layout)
                seen = (cols[None, :] >= keys[:, None]) & (cols[None, :] <= keys[:, None] + left)
                p = gl.where(seen, p, 0.0)
            ds = p * (dp - gl.convert_layout(delta, query_layout)[None, :])
            dv = warpgroup_mma(gl.convert_layout(p.to(q_desc.dtype), operand), do, dv, is_async=True)
            dk = warpgroup_mma(gl.convert_layout(ds.to(q_desc.dtype), operand), q, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            mbarrier.arrive(qdo_free.index(slot), count=1)
            dv = warpgroup_mma_init(dv)
            dk = warpgroup_mma_init(dk)
            j += 1
        for _ in range(q_hi, n_q):
            mbarrier.wait(q_ready.index(j % NS), (j // NS) & 1)
            mbarrier.arrive(qdo_free.index(j % NS), count=1)
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
    group, qk_scale, sm_scale, left, STAGES: gl.constexpr,
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

    q_smem, do_smem, kv_bar, q_ready, do_ready, qdo_free = tile_ring(q_desc, do_desc, STAGES)
    kv_smem = gl.allocate_shared_memory(k_desc.dtype, [4] + k_desc.block_type.shape, k_desc.layout)
    # The tile's keys are seen by query blocks c0 / BM .. n_q - 1: up to the one that holds its last key
    # plus the window.
    n_q = gl.cdiv(gl.minimum(c0 + 2 * HALF + left, length), BM)
    args = (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, kv_smem, kv_bar, q_ready, do_ready, qdo_free,
            Lse, Delta, dK, dV, start, length, kv_head, group, c0, c0 // BM, n_q, left, T, stride_kvt,
            qk_scale, sm_scale)
    gl.warp_specialize([
        (_dkdv_partition, (args, 0)),
        (_dkdv_second_partition, (args, )),
        (_dkdv_load_partition, (args, )),
    ], [4, 1], [240, 24])


def backward_dq(
    dout, q, k, v, out, lse, dlse, delta, dq, tiles, cu_seqlens, softmax_scale: float, blocks, left: int
):
    """Writes dq [T, H, D] and delta [H, T] (as backward.py's dQ pass) for the query tiles of `tiles`,
    causal with query i seeing keys i - left .. i (left >= T: the whole past)."""
    T, H, D = q.shape
    if (blocks.m, blocks.n, blocks.warps) != (128, 64, 8):
        raise ValueError(f"the Gluon dQ pass runs 64-key blocks and two 64-row warpgroups, not {blocks}")
    if not (out.is_contiguous() and dout.is_contiguous() and dq.is_contiguous()):
        raise ValueError("the Gluon dQ pass takes contiguous out, dout and dq")
    n_tiles = tiles.shape[1]
    _dq_long_kernel[(n_tiles, H)](
        tma_descriptor(q, blocks.m // 2), tma_descriptor(dout, blocks.m // 2), tma_descriptor(k, blocks.n),
        tma_descriptor(v, blocks.n), out, dout, lse, lse if dlse is None else dlse, delta, dq, tiles, n_tiles,
        cu_seqlens, cu_seqlens.numel() - 1, T, dq.stride(0), H // k.shape[1], softmax_scale * LOG2E.value,
        softmax_scale, left, HAS_DLSE=dlse is not None, STAGES=blocks.stages, num_warps=WARPS,
        maxnreg=MAX_REGISTERS,
    )


def backward_dkdv(
    dout, q, k, v, lse, delta, dk, dv, tiles, cu_seqlens, softmax_scale: float, blocks, left: int
) -> None:
    """Writes dk and dv [T, H_kv, D] (as backward.py's dK/dV pass) for the key tiles of `tiles`, causal with
    query i seeing keys i - left .. i (left >= T: the whole past)."""
    T, H, D = q.shape
    if (blocks.m, blocks.n, blocks.warps) != (64, 128, 8):
        raise ValueError(f"the Gluon dK/dV pass runs 64-query blocks and two 64-key warpgroups, not {blocks}")
    n_tiles = tiles.shape[1]
    _dkdv_kernel[(n_tiles, k.shape[1])](
        tma_descriptor(q, blocks.m), tma_descriptor(dout, blocks.m), tma_descriptor(k, blocks.n // 2),
        tma_descriptor(v, blocks.n // 2), lse, delta, dk, dv, tiles, n_tiles, cu_seqlens,
        cu_seqlens.numel() - 1, T, dk.stride(0), H // k.shape[1], softmax_scale * LOG2E.value, softmax_scale,
        left, STAGES=blocks.stages, num_warps=WARPS, maxnreg=MAX_REGISTERS,
    )
