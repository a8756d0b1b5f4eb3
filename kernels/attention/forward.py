"""The forward of the varlen attention in Triton: one program per (query tile, head) streams the key blocks
its rows see with an online softmax, and writes out [T, H, D] and the LSE [H, T] (natural log).

Query i of a document sees key j of the same document when i - left <= j <= i + right (window_size as in
flash-attn; causal means right = 0; an unbounded side is passed as T). Scores are scaled by
softmax_scale * log2(e) so that exp2 replaces exp. On Hopper, a class whose blocks say `gluon` runs
hopper_forward's persistent warp-specialised kernel on the same tile table instead: Triton 3.6 waits for
every tl.dot whose result the iteration uses (wgmma.wait_group 0), so the softmax never overlaps S = QK^T,
and its own warp specialisation (tl.range(warp_specialize=True)) does not compile these loops on Hopper.
"""

import torch  # noqa: I001 (kernels.common must come before triton)

from kernels.attention import hopper, hopper_forward
from kernels.attention.plan import planned, window_bounds
from kernels.attention.tiles import (
    block_range, check_launch, load_pair, load_rows, padded_dim, program_tile, store_rows,
    tma_descriptors, visible,
)
from kernels.common import LN2, LOG2E

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _fwd_blocks(
    acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, start, kv_head, stride_kt, stride_vt, rows, q_len,
    k_len, left, right, qk_scale, block_lo, block_hi, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
):
    """Online softmax over key blocks [block_lo, block_hi): m_i is the running max of the base-2 scores,
    l_i the running sum of exp2(score - m_i) in four shares a row (see _row_shares), acc the running sum of
    exp2(score - m_i) * v."""
    for block in range(block_lo, block_hi):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        k, v = load_pair(
            k_desc, v_desc, k_base, v_base, start, k_len, block, kv_head, stride_kt, stride_vt, HEAD_DIM,
            BLOCK_D, BLOCK_N, MASKED, TMA,
        )
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            s = tl.where(visible(rows[:, None], cols[None, :], q_len, k_len, left, right), s, float("-inf"))
        # Scaling after the max turns the scale and the shift into one multiply-add per score.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha[:, None] + _row_shares(p)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _row_shares(p):
    """[rows, 4]: p's row sums in four shares, each over two of every eight columns, which is what each thread
    of a row's quad holds in a Hopper product's accumulator: the shares add without crossing threads, and
    once after the last block. The Gluon forward sums in this order too, so the two agree bitwise."""
    BLOCK_M: tl.constexpr = p.shape[0]
    BLOCK_N: tl.constexpr = p.shape[1]
    return tl.sum(tl.sum(tl.reshape(p, [BLOCK_M, BLOCK_N // 8, 4, 2]), 3), 1)


@triton.jit
def _fwd_kernel(
    Q, K, V, Out, Lse, k_desc, v_desc, tiles, n_tiles, cu_seqlens, n_docs, T, stride_qt, stride_qh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, group, left, right, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_M: tl.constexpr, TMA: tl.constexpr,
):
    """Rows BLOCK_M p .. BLOCK_M (p + 1) - 1 of a table tile of TILE_M rows, p = program_id(2)."""
    segment, block, first, q_len, k_len = program_tile(tiles, n_tiles, cu_seqlens, n_docs, T)
    if segment < 0:
        return
    head = tl.program_id(1)
    kv_head = head // group
    start = first.to(tl.int64)
    q_base = Q + start * stride_qt + head * stride_qh
    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh

    r0 = block * TILE_M + tl.program_id(2) * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    q = load_rows(q_base, rows, stride_qt, q_len, HEAD_DIM, BLOCK_D, True)
    # A finite start for the running max keeps exp2(m_i - m_new) finite for rows that have seen only masks.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M, 4], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Masked blocks at the window's left edge, unmasked blocks, masked blocks on the diagonal/document end.
    lo, full_lo, full_hi, hi = block_range(r0, tl.minimum(r0 + BLOCK_M, q_len), k_len, left, right, BLOCK_N)
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, first, kv_head, stride_kt, stride_vt, rows, q_len,
        k_len, left, right, qk_scale, lo, full_lo, HEAD_DIM, BLOCK_D, BLOCK_N, True, TMA,
    )
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, first, kv_head, stride_kt, stride_vt, rows, q_len,
        k_len, left, right, qk_scale, full_lo, full_hi, HEAD_DIM, BLOCK_D, BLOCK_N, False, TMA,
    )
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, first, kv_head, stride_kt, stride_vt, rows, q_len,
        k_len, left, right, qk_scale, full_hi, hi, HEAD_DIM, BLOCK_D, BLOCK_N, True, TMA,
    )

    l_i = tl.sum(l_i, 1)
    # A row that saw no key (the tail) gets out = 0 and lse = -inf.
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    store_rows(
        Out + start * stride_ot + head * stride_oh, rows, stride_ot, q_len, out.to(Out.dtype.element_ty),
        HEAD_DIM, BLOCK_D,
    )
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    tl.store(Lse + head * T + start + rows, lse, mask=rows < q_len)


def forward(
    q, k, v, cu_seqlens, window_left: int, window_right: int, softmax_scale: float, plan=None,
    max_seqlen: int | None = None,
):
    """out [T, H, D] in q's dtype and lse [H, T] float32 (natural log). The last dims must be contiguous.
    plan: from make_plan for the same documents, head dim, window and max_seqlen (None: T, no bound), or
    None to make this pass's here."""
    T, H, D = q.shape
    check_launch(q, k, v)
    tables, _ = planned(plan, cu_seqlens, T, D, window_left, window_right, max_seqlen or T, "fwd")
    left, right = window_bounds(T, window_left, window_right)
    BLOCK_D = padded_dim(D)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    for launch, tiles in tables:
        blocks = launch.blocks
        if blocks.gluon and right == 0 and hopper.supported(q, k, v):
            longest = min(launch.longest, max_seqlen or T)
            hopper_forward.forward(q, k, v, out, lse, tiles, cu_seqlens, softmax_scale, blocks, left, longest)
            continue
        k_desc, v_desc = tma_descriptors(blocks, blocks.n, BLOCK_D, k, v)
        # A Gluon class's tile may hold three warpgroups' rows (192): Triton's blocks are powers of two, so
        # such a tile runs as programs of its largest power-of-two divisor.
        block_m = blocks.m & -blocks.m
        _fwd_kernel[(tiles.shape[1], H, blocks.m // block_m)](
            q, k, v, out, lse, k_desc, v_desc, tiles, tiles.shape[1], cu_seqlens, cu_seqlens.numel() - 1, T,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
            out.stride(1), H // k.shape[1], left, right, softmax_scale * LOG2E.value, HEAD_DIM=D,
            BLOCK_D=BLOCK_D, BLOCK_M=block_m, BLOCK_N=blocks.n, TILE_M=blocks.m, TMA=k_desc is not None,
            num_warps=min(blocks.warps, 8), num_stages=blocks.stages,
        )
    return out, lse
