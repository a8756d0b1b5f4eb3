"""The deterministic backward of the varlen attention in Triton.

One pass per query tile and head computes dQ (and delta = rowsum(dO * O) first); one pass per key tile and
KV head computes dK and dV, looping over the query heads of its GQA group. Every gradient element is
written by exactly one program, without atomics, so the backward is deterministic. (In Triton,
deterministic ways to fold dQ into the dK/dV pass measured slower on an H200: adding dS K in a fixed order
by spinning on per-block counters took about twice the backward, and order-free fixed-point int64 sums were
1.46x slower on 16k-token documents.) Causal attention takes the short documents' dQ from the dS their
dK/dV pass stores, where the block config says so (see `backward`). On Hopper, the dK/dV classes whose
blocks say `gluon` (at head dims 64 and 128, every document) run hopper_backward's warp-specialised pass
instead, which also writes their documents' dQ: their dQ pass does not run.
"""

import torch  # noqa: I001 (kernels.common must come before triton)

from kernels.attention import hopper, hopper_backward
from kernels.attention import block_sizes
from kernels.attention.plan import ds_slot_count, fused_shortest, planned, window_bounds
from kernels.attention.tiles import (
    block_range, check_launch, load_pair, load_rows, padded_dim, program_tile, store_rows,
    tma_descriptors, visible,
)
from kernels.common import LOG2E, is_hopper

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _dq_blocks(
    dq, q, do, lse, delta, k_desc, v_desc, k_base, v_base, start, kv_head, stride_kt, stride_vt, rows, q_len,
    k_len, left, right, qk_scale, block_lo, block_hi, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
):
    """dQ += dS K over key blocks [block_lo, block_hi), with P = exp2(S - lse) and dS = P (dO V^T - delta)."""
    for block in range(block_lo, block_hi):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        k, v = load_pair(
            k_desc, v_desc, k_base, v_base, start, k_len, block, kv_head, stride_kt, stride_vt, HEAD_DIM,
            BLOCK_D, BLOCK_N, MASKED, TMA,
        )
        s = tl.dot(q, tl.trans(k))
        dp = tl.dot(do, tl.trans(v))  # before the exponentials: measured faster, though triton waits on it
        p = tl.exp2(s * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(visible(rows[:, None], cols[None, :], q_len, k_len, left, right), p, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, Out, dOut, Lse, dLse, Delta, dQ, k_desc, v_desc, tiles, n_tiles, cu_seqlens, n_docs, T,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_dot,
    stride_doh, stride_dqt, stride_dqh, group, left, right, qk_scale, sm_scale, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DLSE: tl.constexpr,
    TMA: tl.constexpr,
):
    segment, block, first, q_len, k_len = program_tile(tiles, n_tiles, cu_seqlens, n_docs, T)
    if segment < 0:
        return
    head = tl.program_id(1)
    kv_head = head // group
    start = first.to(tl.int64)
    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh

    r0 = block * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    q = load_rows(Q + start * stride_qt + head * stride_qh, rows, stride_qt, q_len, HEAD_DIM, BLOCK_D, True)
    do = load_rows(
        dOut + start * stride_dot + head * stride_doh, rows, stride_dot, q_len, HEAD_DIM, BLOCK_D, True
    )
    o = load_rows(
        Out + start * stride_ot + head * stride_oh, rows, stride_ot, q_len, HEAD_DIM, BLOCK_D, True
    )
    # delta_i = sum_j P_ij dP_ij = dO_i . O_i; a gradient on lse_i adds P_ij dlse_i to dS_ij, which is the
    # same as lowering delta_i by dlse_i. The dK/dV pass reads delta from here.
    row_ok = rows < q_len
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dLse + head * T + start + rows, mask=row_ok, other=0.0)
    tl.store(Delta + head * T + start + rows, delta, mask=row_ok)
    lse = tl.load(Lse + head * T + start + rows, mask=row_ok, other=0.0) * LOG2E

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, full_lo, full_hi, hi = block_range(r0, tl.minimum(r0 + BLOCK_M, q_len), k_len, left, right, BLOCK_N)
    dq = _dq_blocks(
        dq, q, do, lse, delta, k_desc, v_desc, k_base, v_base, first, kv_head, stride_kt, stride_vt, rows,
        q_len, k_len, left, right, qk_scale, lo, full_lo, HEAD_DIM, BLOCK_D, BLOCK_N, True, TMA,
    )
    dq = _dq_blocks(
        dq, q, do, lse, delta, k_desc, v_desc, k_base, v_base, first, kv_head, stride_kt, stride_vt, rows,
        q_len, k_len, left, right, qk_scale, full_lo, full_hi, HEAD_DIM, BLOCK_D, BLOCK_N, False, TMA,
    )
    dq = _dq_blocks(
        dq, q, do, lse, delta, k_desc, v_desc, k_base, v_base, first, kv_head, stride_kt, stride_vt, rows,
        q_len, k_len, left, right, qk_scale, full_hi, hi, HEAD_DIM, BLOCK_D, BLOCK_N, True, TMA,
    )
    store_rows(
        dQ + start * stride_dqt + head * stride_dqh, rows, stride_dqt, q_len,
        (dq * sm_scale).to(dQ.dtype.element_ty), HEAD_DIM, BLOCK_D,
    )


@triton.jit
def _dkdv_blocks(
    dk, dv, k, v, q_desc, do_desc, q_base, do_base, start, head, lse_base, delta_base, stride_qt, stride_dot,
    cols, q_len, k_len, left, right, qk_scale, block_lo, block_hi, ds_base, first_block,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, TMA: tl.constexpr, STORE_DS: tl.constexpr,
):
    """dV += P^T dO and dK += dS^T Q over query blocks [block_lo, block_hi), computed transposed
    ([keys, queries]) so that the key rows of this program stay the row dimension. With STORE_DS, each
    block's dS is also written, query-major, to slot (block - first_block) from ds_base on."""
    for block in range(block_lo, block_hi):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        q, do = load_pair(
            q_desc, do_desc, q_base, do_base, start, q_len, block, head, stride_qt, stride_dot, HEAD_DIM,
            BLOCK_D, BLOCK_M, MASKED, TMA,
        )
        if MASKED:
            lse = tl.load(lse_base + rows, mask=rows < q_len, other=0.0) * LOG2E
            delta = tl.load(delta_base + rows, mask=rows < q_len, other=0.0)
        else:
            lse = tl.load(lse_base + rows) * LOG2E
            delta = tl.load(delta_base + rows)
        s_t = tl.dot(k, tl.trans(q))
        dp_t = tl.dot(v, tl.trans(do))  # before the exponentials: measured faster, though triton waits on it
        p_t = tl.exp2(s_t * qk_scale - lse[None, :])
        if MASKED:
            p_t = tl.where(visible(rows[None, :], cols[:, None], q_len, k_len, left, right), p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if STORE_DS:
            tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tl.store(ds_base + (block - first_block) * (BLOCK_M * BLOCK_N) + tile, tl.trans(ds_t))
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, dOut, Lse, Delta, dK, dV, DS, DocSlots, q_desc, do_desc, tiles, n_tiles, cu_seqlens, n_docs, T,
    n_slots, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, group, left, right, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TMA: tl.constexpr, STORE_DS: tl.constexpr,
):
    segment, block, first, k_len, q_len = program_tile(tiles, n_tiles, cu_seqlens, n_docs, T)
    if segment < 0:
        return
    kv_head = tl.program_id(1)
    start = first.to(tl.int64)
    c0 = block * BLOCK_N
    cols = c0 + tl.arange(0, BLOCK_N)
    k = load_rows(
        K + start * stride_kt + kv_head * stride_kh, cols, stride_kt, k_len, HEAD_DIM, BLOCK_D, True
    )
    v = load_rows(
        V + start * stride_vt + kv_head * stride_vh, cols, stride_vt, k_len, HEAD_DIM, BLOCK_D, True
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # Key j is seen by queries [j - right, j + left]: the forward's ranges with the window mirrored.
    lo, full_lo, full_hi, hi = block_range(c0, tl.minimum(c0 + BLOCK_N, k_len), q_len, right, left, BLOCK_M)
    slot0 = 0
    if STORE_DS:
        slot0 = _ds_slot(DocSlots, segment, block, q_len, BLOCK_M, BLOCK_N)
    for head in range(kv_head * group, (kv_head + 1) * group):
        q_base = Q + start * stride_qt + head * stride_qh
        do_base = dOut + start * stride_dot + head * stride_doh
        lse_base = Lse + head * T + start
        delta_base = Delta + head * T + start
        ds_base = DS + (head * n_slots + slot0).to(tl.int64) * (BLOCK_M * BLOCK_N)
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_desc, do_desc, q_base, do_base, first, head, lse_base, delta_base, stride_qt,
            stride_dot, cols, q_len, k_len, left, right, qk_scale, lo, full_lo, ds_base, lo, HEAD_DIM,
            BLOCK_D, BLOCK_M, BLOCK_N, True, TMA, STORE_DS,
        )
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_desc, do_desc, q_base, do_base, first, head, lse_base, delta_base, stride_qt,
            stride_dot, cols, q_len, k_len, left, right, qk_scale, full_lo, full_hi, ds_base, lo, HEAD_DIM,
            BLOCK_D, BLOCK_M, BLOCK_N, False, TMA, STORE_DS,
        )
        dk, dv = _dkdv_blocks(
            dk, dv, k, v, q_desc, do_desc, q_base, do_base, first, head, lse_base, delta_base, stride_qt,
            stride_dot, cols, q_len, k_len, left, right, qk_scale, full_hi, hi, ds_base, lo, HEAD_DIM,
            BLOCK_D, BLOCK_M, BLOCK_N, True, TMA, STORE_DS,
        )
    store_rows(
        dK + start * stride_dkt + kv_head * stride_dkh, cols, stride_dkt, k_len,
        (dk * sm_scale).to(dK.dtype.element_ty), HEAD_DIM, BLOCK_D,
    )
    store_rows(
        dV + start * stride_dvt + kv_head * stride_dvh, cols, stride_dvt, k_len, dv.to(dV.dtype.element_ty),
        HEAD_DIM, BLOCK_D,
    )


@triton.jit
def _ds_slot(DocSlots, segment, block, q_len, BM_KV: tl.constexpr, BLOCK_N: tl.constexpr):
    """First dS slot of key block `block` of a document. Under a causal mask with the whole past visible,
    key block b is seen by query blocks b R .. n_q - 1 (R = BLOCK_N / BM_KV), so it takes n_q - b R slots,
    and the document's key blocks before it took b n_q - R b (b - 1) / 2. A window leaves the last of a key
    block's slots unwritten: the layout is the same."""
    n_q = tl.cdiv(q_len, BM_KV)
    r = BLOCK_N // BM_KV
    return tl.load(DocSlots + segment) + block * n_q - r * block * (block - 1) // 2


@triton.jit
def _bwd_delta_kernel(
    Out, dOut, dLse, Delta, tiles, n_tiles, cu_seqlens, n_docs, T, stride_ot, stride_oh, stride_dot,
    stride_doh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """delta = rowsum(dO * O) - dlse, for the documents whose dQ pass runs after the dK/dV pass."""
    segment, block, first, length, _ = program_tile(tiles, n_tiles, cu_seqlens, n_docs, T)
    if segment < 0:
        return
    head = tl.program_id(1)
    start = first.to(tl.int64)
    rows = block * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < length
    do = load_rows(
        dOut + start * stride_dot + head * stride_doh, rows, stride_dot, length, HEAD_DIM, BLOCK_D, True
    )
    o = load_rows(
        Out + start * stride_ot + head * stride_oh, rows, stride_ot, length, HEAD_DIM, BLOCK_D, True
    )
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dLse + head * T + start + rows, mask=row_ok, other=0.0)
    tl.store(Delta + head * T + start + rows, delta, mask=row_ok)


@triton.jit
def _bwd_dq_stored_kernel(
    K, DS, DocSlots, dQ, tiles, n_tiles, cu_seqlens, n_docs, T, n_slots, stride_kt, stride_kh, stride_dqt,
    stride_dqh, group, left, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BM_KV: tl.constexpr,
):
    """dQ = sum over key blocks of dS K, with dS as the dK/dV pass stored it: one matrix product per block
    pair instead of three. This query block's rows are BLOCK_M / BM_KV consecutive slots of each key block,
    from the first key block that its rows' windows reach (query i sees keys i - left .. i)."""
    segment, block, first, q_len, k_len = program_tile(tiles, n_tiles, cu_seqlens, n_docs, T)
    if segment < 0:
        return
    head = tl.program_id(1)
    kv_head = head // group
    start = first.to(tl.int64)
    k_base = K + start * stride_kt + kv_head * stride_kh
    r0 = block * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for kb in range(tl.maximum(r0 - left, 0) // BLOCK_N, tl.cdiv(tl.minimum(r0 + BLOCK_M, k_len), BLOCK_N)):
        cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        k = load_rows(k_base, cols, stride_kt, k_len, HEAD_DIM, BLOCK_D, True)
        slot = _ds_slot(DocSlots, segment, kb, q_len, BM_KV, BLOCK_N) + r0 // BM_KV - kb * (BLOCK_N // BM_KV)
        # The dK/dV pass wrote the slots of the query blocks that see the key block: up to the one that holds
        # its last key plus the window. The others, and rows past the document's end, would read slots that
        # may hold anything: their dS is zero.
        seen = tl.cdiv(tl.minimum(tl.minimum(kb * BLOCK_N + BLOCK_N, k_len) + left, q_len), BM_KV) * BM_KV
        ds_ptrs = DS + (head * n_slots + slot).to(tl.int64) * (BM_KV * BLOCK_N) + tile
        ds = tl.load(ds_ptrs, mask=rows[:, None] < tl.minimum(seen, q_len), other=0.0)
        dq = tl.dot(ds, k, dq)
    store_rows(
        dQ + start * stride_dqt + head * stride_dqh, rows, stride_dqt, q_len,
        (dq * sm_scale).to(dQ.dtype.element_ty), HEAD_DIM, BLOCK_D,
    )


def backward(
    dout, q, k, v, out, lse, dlse, cu_seqlens, window_left: int, window_right: int, softmax_scale: float,
    plan=None, max_seqlen: int | None = None,
):
    """(dq, dk, dv) shaped like (q, k, v). dlse, the gradient on lse, may be None; plan and max_seqlen as
    in `forward`.

    Where the block config has a dq_stored pass (head dim 128, off Hopper), causal attention (over the
    whole past or a window) takes the short documents' dQ from the dS that their dK/dV pass stores (bf16,
    about longest * T * H / 2 values for documents of up to `longest` tokens, the first dK/dV length
    class), instead of recomputing S and dP in a pass of its own. Two-sided windows, and longer documents,
    take the recomputing dQ pass, except those of the Gluon dK/dV pass on Hopper."""
    T, H, D = q.shape
    H_kv = k.shape[1]
    check_launch(dout, q, k, v, out)
    tables, doc_slots = planned(plan, cu_seqlens, T, D, window_left, window_right, max_seqlen or T, "bwd")
    config = block_sizes.block_config(D, is_hopper(cu_seqlens.device))
    store_longest, store_blocks = config["dkdv"][0]
    left, right = window_bounds(T, window_left, window_right)
    BLOCK_D = padded_dim(D)
    n_docs = cu_seqlens.numel() - 1
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    delta = torch.empty_like(lse)
    ds, slots, n_slots = dq, cu_seqlens, 0  # placeholders, unread without STORE_DS
    if doc_slots is not None:
        slots = doc_slots
        n_slots = ds_slot_count(T, n_docs, store_longest, store_blocks.m, store_blocks.n)
        # The last query block of a document reads dq_stored's m / m slots from its first one on.
        ds = torch.empty(
            (H * n_slots + config["dq_stored"].m // store_blocks.m, store_blocks.m, store_blocks.n),
            dtype=q.dtype, device=q.device,
        )

    gluon = right == 0 and hopper.supported(q, k, v, dout) and out.is_contiguous() and dout.is_contiguous()
    fused = fused_shortest(config, right)
    fused_dq = None  # (tiles, rows per tile) of the dQ table of the documents whose dK/dV pass writes dQ
    for launch, tiles in tables:
        blocks, grid = launch.blocks, (tiles.shape[1], H)
        store_ds = doc_slots is not None and launch.shortest == 0  # the dK/dV class whose dS dq_stored reads
        if launch.kernel == "delta":
            _bwd_delta_kernel[grid](
                out, dout, dlse, delta, tiles, tiles.shape[1], cu_seqlens, n_docs, T, out.stride(0),
                out.stride(1), dout.stride(0), dout.stride(1), HEAD_DIM=D, BLOCK_D=BLOCK_D,
                BLOCK=launch.block, HAS_DLSE=dlse is not None,
            )
        elif launch.kernel == "dq" and gluon and fused is not None and launch.shortest >= fused:
            fused_dq = (tiles, launch.block)  # the Gluon dK/dV pass writes these documents' dQ
        elif launch.kernel == "dq":
            k_desc, v_desc = tma_descriptors(blocks, blocks.n, BLOCK_D, k, v)
            _bwd_dq_kernel[grid](
                q, k, v, out, dout, lse, dlse, delta, dq, k_desc, v_desc, tiles, tiles.shape[1], cu_seqlens,
                n_docs, T, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
                H // H_kv, left, right, softmax_scale * LOG2E.value, softmax_scale, HEAD_DIM=D,
                BLOCK_D=BLOCK_D, BLOCK_M=blocks.m, BLOCK_N=blocks.n, HAS_DLSE=dlse is not None,
                TMA=k_desc is not None, num_warps=blocks.warps, num_stages=blocks.stages,
            )
        elif launch.kernel == "dkdv" and blocks.gluon and gluon and not store_ds:
            hopper_backward.backward_dkdv(
                dout, q, k, v, lse, delta, dq, dk, dv, tiles, fused_dq[0], cu_seqlens, softmax_scale, blocks,
                fused_dq[1], left,
            )
        elif launch.kernel == "dkdv":
            q_desc, do_desc = tma_descriptors(blocks, blocks.m, BLOCK_D, q, dout)
            _bwd_dkdv_kernel[(tiles.shape[1], H_kv)](
                q, k, v, dout, lse, delta, dk, dv, ds, slots, q_desc, do_desc, tiles, tiles.shape[1],
                cu_seqlens, n_docs, T, n_slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1),
                dv.stride(0), dv.stride(1), H // H_kv, left, right, softmax_scale * LOG2E.value,
                softmax_scale, HEAD_DIM=D, BLOCK_D=BLOCK_D, BLOCK_M=blocks.m, BLOCK_N=blocks.n,
                TMA=q_desc is not None, STORE_DS=store_ds,
                num_warps=blocks.warps, num_stages=blocks.stages,
            )
        elif launch.kernel == "dq_stored":
            _bwd_dq_stored_kernel[grid](
                k, ds, slots, dq, tiles, tiles.shape[1], cu_seqlens, n_docs, T, n_slots, k.stride(0),
                k.stride(1), dq.stride(0), dq.stride(1), H // H_kv, left, softmax_scale, HEAD_DIM=D,
                BLOCK_D=BLOCK_D, BLOCK_M=blocks.m, BLOCK_N=store_blocks.n, BM_KV=store_blocks.m,
                num_warps=blocks.warps, num_stages=blocks.stages,
            )
    return dq, dk, dv
