"""Varlen FlashAttention in Triton: forward and deterministic backward over a packed [T, H, D] buffer.

The buffer holds the documents delimited by `cu_seqlens` (int32 [N + 1]) followed by a tail of tokens past
cu_seqlens[-1] that belong to no document. Each kernel runs on a grid (tiles, heads) where a tile is one
(segment, block) pair: a block of BLOCK rows of one document, or of the tail. `tile_table` lists them on
the device, so the grid size depends on T and N only (never on the boundaries, and nothing waits for the
host); the table has at most cdiv(T, BLOCK) + N real tiles, zero-length documents have none, and the
unused entries exit at once. `make_plan` builds the tables of every launch of a forward and backward in
one tensor, which all layers attending over the same documents can share. Documents may be split by
length into classes with their own block sizes (block_config), one launch each. On Hopper, a class may
stream its inner loop's tiles by TMA through ragged descriptors (triton.tools.ragged_tma): the hardware
bounds each load to the tile's document and fills the rest with zeros, so no thread computes addresses or
masks for those loads. On Hopper, a class whose blocks say `gluon` runs the warp-specialised kernels of
flash_attn_hopper (forward, dQ and dK/dV pass at head dim 128, causal over the whole past) on the same tile
table; its forward is persistent, one program per SM taking the table's tiles in turn.

Query i of a document sees key j of the same document when i - left <= j <= i + right (window_size as in
flash-attn; causal means right = 0; an unbounded side is passed as T). The kernels work in base 2:
scores are scaled by softmax_scale * log2(e) so that exp2 replaces exp; the LSE is stored in natural log.

Forward: one program per (query tile, head) streams the visible key blocks with an online softmax.
Backward: one pass per query tile and head computes dQ (and delta = rowsum(dO * O) first), one pass per
key tile and KV head computes dK and dV, looping over the query heads of its GQA group. Every gradient
element is written by exactly one program, without atomics, so the backward is deterministic.

Without CUDA, the kernels run in Triton's interpreter (slow; for tests on CPU). Triton decides at
decoration time, and decorates its own library functions (tl.sum, tl.max...) when it is first imported,
so TRITON_INTERPRET=1 must be set before anything imports triton (torch._dynamo does): this module sets
it when it comes first, and otherwise set it in the environment.
"""

import os
from typing import NamedTuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when @triton.jit decorates the functions below

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.tools.ragged_tma import create_ragged_descriptor, load_ragged  # noqa: E402

from kernels import flash_attn_hopper  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Whether triton.language was set up for the interpreter too (see the module docstring).
_LIBRARY_INTERPRETED = isinstance(tl.sum, InterpretedFunction)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


class Blocks(NamedTuple):
    m: int  # query rows per block
    n: int  # key rows per block
    warps: int
    stages: int
    # The inner loop's tiles come by TMA (Hopper's tensor memory accelerator, through a descriptor that
    # bounds each document in hardware) instead of per-thread loads, where that measured faster.
    tma: bool = False
    # Head dim 128: on Hopper, causal calls over the whole past run the warp-specialised Gluon kernels of
    # flash_attn_hopper instead (a load warp; two warpgroups of m / 2 query rows in the forward and dQ
    # pass, of n / 2 keys in the dK/dV pass, which has no Gluon version for the class that stores dS).
    gluon: bool = False


# Per kernel, (longest document, blocks) classes in increasing length; None is unbounded. Each class is
# one launch over the documents of its lengths: small blocks waste less on the masked diagonal of short
# documents, large ones reuse more of each load on long ones. "dq_stored" (optional) is the dQ pass that
# reads the dS stored by the first dK/dV class (see `backward`): its key blocks are that class's, and its
# query blocks a multiple of that class's, no larger than its key blocks.
Config = dict[str, list[tuple[int | None, Blocks]] | Blocks]
DELTA_ROWS = 64  # rows per program of the delta pass, which only streams O and dO


def block_config(head_dim: int) -> Config:
    """Block sizes of the kernels: the one place where they are chosen (measured on an H200)."""
    # Interpreter: small, unequal blocks, two classes, TMA in some and pointer loads in others, so that
    # small test buffers exercise every path.
    if INTERPRET:
        return {
            "fwd": [(40, Blocks(16, 16, 4, 1, True)), (None, Blocks(32, 16, 4, 1))],
            "dq": [(24, Blocks(16, 32, 4, 1)), (None, Blocks(32, 16, 4, 1, True))],
            "dkdv": [(56, Blocks(16, 32, 4, 1, True)), (None, Blocks(32, 16, 4, 1))],
            "dq_stored": Blocks(32, 32, 4, 1),
        }
    if head_dim <= 64:
        return {
            "fwd": [(2048, Blocks(64, 64, 4, 3, True)), (None, Blocks(128, 64, 4, 3, True))],
            "dq": [(None, Blocks(64, 64, 4, 3))],
            "dkdv": [(None, Blocks(32, 128, 4, 3))],
        }
    if head_dim <= 128:
        return {
            "fwd": [(None, Blocks(128, 128, 8, 3, True, True))],
            "dq": [(None, Blocks(128, 64, 8, 3, False, True))],
            "dkdv": [(2048, Blocks(32, 64, 4, 3, True)), (None, Blocks(64, 128, 8, 2, False, True))],
            "dq_stored": Blocks(64, 64, 4, 3),
        }
    return {
        "fwd": [(None, Blocks(64, 64, 4, 2))], "dq": [(None, Blocks(64, 32, 4, 2))],
        "dkdv": [(None, Blocks(32, 64, 4, 2))],
    }


def _classes(entries: list[tuple[int | None, Blocks]], num_tokens: int, max_seqlen: int):
    """(shortest excluded, longest included, blocks) of each length class that can hold a document of at
    most max_seqlen tokens. The first class always runs: it also takes the tail (see `tile_table`)."""
    shortest = 0
    for longest, blocks in entries:
        if shortest and shortest >= max_seqlen:
            return
        longest = num_tokens if longest is None else longest
        yield shortest, longest, blocks
        shortest = longest


def _n_tiles(num_tokens: int, n_docs: int, block: int, shortest: int) -> int:
    return triton.cdiv(num_tokens, block) + min(n_docs, num_tokens // (shortest + 1))


def tile_table(
    cu_seqlens: torch.Tensor, num_tokens: int, block: int, last_block_first: bool, shortest: int = 0,
    longest: int | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """int32 [2, n]: (segment, block index) of each tile of the segments of length in (shortest, longest],
    then (-1, *) padding. Written into `out` when given.

    Segment s < N is document s; segment N is the tail [cu_seqlens[N], num_tokens), which attends to
    nothing: it belongs to the table with shortest = 0 whatever its length, so that a plan bounded by
    max_seqlen, which launches no class above it, still writes the tail's rows. A segment of length L
    has cdiv(L, block) tiles, so the real tiles number at most n = cdiv(T, block) + N, where N may be
    lowered to T // (shortest + 1), the most segments longer than `shortest`. Within a segment the blocks
    run from the last to the first when last_block_first: under a causal mask the last query block does
    the most work, and starting the largest tiles first evens out the end of the launch.
    One small launch: a dozen torch ops would cost more than the table is worth on short batches.
    """
    n_docs = cu_seqlens.numel() - 1
    n_tiles = _n_tiles(num_tokens, n_docs, block, shortest)
    tiles = torch.empty((2, n_tiles), dtype=torch.int32, device=cu_seqlens.device) if out is None else out
    _tile_table_kernel[(triton.cdiv(n_tiles, 64),)](
        cu_seqlens, tiles, n_tiles, n_docs, num_tokens, shortest, num_tokens if longest is None else longest,
        BLOCK=block, LAST_BLOCK_FIRST=last_block_first, TILES=64, SEGMENTS=256,
    )
    return tiles


@triton.jit
def _tile_table_kernel(
    cu_seqlens, tiles, n_tiles, n_docs, T, shortest, longest, BLOCK: tl.constexpr,
    LAST_BLOCK_FIRST: tl.constexpr, TILES: tl.constexpr, SEGMENTS: tl.constexpr,
):
    """Each program fills TILES entries, scanning the segments SEGMENTS at a time: a tile's segment is the
    number of segments whose tiles all come before it."""
    tile = tl.program_id(0) * TILES + tl.arange(0, TILES)
    segment = tl.zeros([TILES], tl.int32)
    first = tl.zeros([TILES], tl.int32)  # first tile of the tile's segment
    end = tl.full([TILES], 2**30, tl.int32)  # one past its last tile
    done = n_docs * 0  # tiles of the segments scanned so far
    for s0 in range(0, n_docs + 1, SEGMENTS):
        s = s0 + tl.arange(0, SEGMENTS)
        start = tl.load(cu_seqlens + s, mask=s <= n_docs, other=T)
        stop = tl.load(cu_seqlens + s + 1, mask=s < n_docs, other=T)
        size = stop - start
        in_class = (size > shortest) & (size <= longest)
        blocks = tl.where(in_class | ((s == n_docs) & (shortest == 0)), tl.cdiv(size, BLOCK), 0)
        last = done + tl.cumsum(blocks, 0)  # one past each segment's last tile
        before = last[None, :] <= tile[:, None]
        segment += tl.sum(before.to(tl.int32), 1)
        first = tl.maximum(first, tl.max(tl.where(before, last[None, :], 0), 1))
        end = tl.minimum(end, tl.min(tl.where(before, 2**30, last[None, :]), 1))
        done = tl.max(last, 0)
    if LAST_BLOCK_FIRST:
        index = end - 1 - tile
    else:
        index = tile - first
    inside = tile < n_tiles
    tl.store(tiles + tile, tl.where(segment <= n_docs, segment, -1), mask=inside)
    tl.store(tiles + n_tiles + tile, index, mask=inside)


# ----------------------------------------------------------------------------------------------------------
# Helpers


@triton.jit
def _segment(tiles, n_tiles, cu_seqlens, n_docs, T):
    """Tile of this program: (segment, block, first token, own length, length of the other side).

    For a document both lengths are L. The tail has its own rows but nothing to attend to or from."""
    tile = tl.program_id(0)
    segment = tl.load(tiles + tile)
    block = tl.load(tiles + n_tiles + tile)
    start = tl.load(cu_seqlens + segment, mask=segment >= 0, other=0)
    end = tl.load(cu_seqlens + segment + 1, mask=(segment >= 0) & (segment < n_docs), other=T)
    length = end - start
    other = tl.where(segment < n_docs, length, 0)
    return segment, block, start, length, other


@triton.jit
def _block_range(r0, r1, n_other, before, after, BLOCK: tl.constexpr):
    """Blocks of the other side that rows [r0, r1) see, when row r sees [r - before, r + after].

    Returns (lo, full_lo, full_hi, hi): blocks [lo, hi) hold visible entries, and blocks
    [full_lo, full_hi) are visible to every row and inside the segment, so they need no mask."""
    lo = tl.maximum(r0 - before, 0) // BLOCK
    hi = tl.cdiv(tl.minimum(r1 + after, n_other), BLOCK)
    full_lo = tl.maximum(tl.cdiv(tl.maximum(r1 - 1 - before, 0), BLOCK), lo)
    full_hi = tl.minimum(tl.minimum(r0 + after + 1, n_other) // BLOCK, hi)
    none_full = full_hi <= full_lo
    full_lo = tl.where(none_full, hi, full_lo)
    full_hi = tl.where(none_full, hi, full_hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _visible(q_pos, k_pos, q_len, k_len, left, right):
    """Mask of query/key pairs of one segment that attend (broadcast q_pos against k_pos)."""
    return (q_pos < q_len) & (k_pos < k_len) & (k_pos >= q_pos - left) & (k_pos <= q_pos + right)


@triton.jit
def _load_rows(
    base, rows, stride, n_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr
):
    """[len(rows), BLOCK_D] tile of a row-major [*, HEAD_DIM] view; rows past n_rows and padded columns
    read as 0. Unchecked rows take no mask at all, so the loads stay full width."""
    cols = tl.arange(0, BLOCK_D)
    ptrs = base + rows[:, None] * stride + cols[None, :]
    if HEAD_DIM == BLOCK_D:
        if CHECK_ROWS:
            return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        return tl.load(ptrs)
    if CHECK_ROWS:
        return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM), other=0.0)
    return tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _store_rows(base, rows, stride, n_rows, x, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    ptrs = base + rows[:, None] * stride + cols[None, :]
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM))


@triton.jit
def _load_block(
    desc, base, start, n_rows, row0, head, stride, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr, CHECK_ROWS: tl.constexpr, TMA: tl.constexpr,
):
    """[BLOCK, BLOCK_D] tile of rows row0.. of a segment of n_rows rows starting at token `start`, one
    head; rows past n_rows read as 0. By TMA from the [T, H, D] descriptor, or from `base` (the segment's
    first row of this head) by pointers."""
    if TMA:
        return tl.reshape(load_ragged(desc, start, n_rows, [row0, head, 0]), [BLOCK, BLOCK_D])
    return _load_rows(base, row0 + tl.arange(0, BLOCK), stride, n_rows, HEAD_DIM, BLOCK_D, CHECK_ROWS)


@triton.jit
def _load_pair(
    a_desc, b_desc, a_base, b_base, start, n_rows, block, head, stride_a, stride_b, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, CHECK_ROWS: tl.constexpr, TMA: tl.constexpr,
):
    """Block `block` of two tensors the inner loops stream together: K and V, or Q and dO."""
    row0 = block * BLOCK
    a = _load_block(
        a_desc, a_base, start, n_rows, row0, head, stride_a, HEAD_DIM, BLOCK_D, BLOCK, CHECK_ROWS, TMA
    )
    b = _load_block(
        b_desc, b_base, start, n_rows, row0, head, stride_b, HEAD_DIM, BLOCK_D, BLOCK, CHECK_ROWS, TMA
    )
    return a, b


# ----------------------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _fwd_blocks(
    acc, l_i, m_i, q, k_desc, v_desc, k_base, v_base, start, kv_head, stride_kt, stride_vt, rows, q_len,
    k_len, left, right, qk_scale, block_lo, block_hi, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
):
    """Online softmax over key blocks [block_lo, block_hi): m_i is the running max of the base-2 scores,
    l_i the running sum of exp2(score - m_i), acc the running sum of exp2(score - m_i) * v."""
    for block in range(block_lo, block_hi):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        k, v = _load_pair(
            k_desc, v_desc, k_base, v_base, start, k_len, block, kv_head, stride_kt, stride_vt, HEAD_DIM,
            BLOCK_D, BLOCK_N, MASKED, TMA,
        )
        s = tl.dot(q, tl.trans(k))
        if MASKED:
            s = tl.where(_visible(rows[:, None], cols[None, :], q_len, k_len, left, right), s, float("-inf"))
        # Scaling after the max turns the scale and the shift into one multiply-add per score.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, Out, Lse, k_desc, v_desc, tiles, n_tiles, cu_seqlens, n_docs, T, stride_qt, stride_qh,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, group, left, right, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
):
    segment, block, first, q_len, k_len = _segment(tiles, n_tiles, cu_seqlens, n_docs, T)
    if segment < 0:
        return
    head = tl.program_id(1)
    kv_head = head // group
    start = first.to(tl.int64)
    q_base = Q + start * stride_qt + head * stride_qh
    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh

    r0 = block * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    q = _load_rows(q_base, rows, stride_qt, q_len, HEAD_DIM, BLOCK_D, True)
    # A finite start for the running max keeps exp2(m_i - m_new) finite for rows that have seen only masks.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Masked blocks at the window's left edge, unmasked blocks, masked blocks on the diagonal/document end.
    lo, full_lo, full_hi, hi = _block_range(r0, tl.minimum(r0 + BLOCK_M, q_len), k_len, left, right, BLOCK_N)
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

    # A row that saw no key (the tail) gets out = 0 and lse = -inf.
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    _store_rows(
        Out + start * stride_ot + head * stride_oh, rows, stride_ot, q_len, out.to(Out.dtype.element_ty),
        HEAD_DIM, BLOCK_D,
    )
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    tl.store(Lse + head * T + start + rows, lse, mask=rows < q_len)


# ----------------------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _dq_blocks(
    dq, q, do, lse, delta, k_desc, v_desc, k_base, v_base, start, kv_head, stride_kt, stride_vt, rows, q_len,
    k_len, left, right, qk_scale, block_lo, block_hi, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
):
    """dQ += dS K over key blocks [block_lo, block_hi), with P = exp2(S - lse) and dS = P (dO V^T - delta)."""
    for block in range(block_lo, block_hi):
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        k, v = _load_pair(
            k_desc, v_desc, k_base, v_base, start, k_len, block, kv_head, stride_kt, stride_vt, HEAD_DIM,
            BLOCK_D, BLOCK_N, MASKED, TMA,
        )
        s = tl.dot(q, tl.trans(k))
        dp = tl.dot(do, tl.trans(v))  # before the exponentials: measured faster, though triton waits on it
        p = tl.exp2(s * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(_visible(rows[:, None], cols[None, :], q_len, k_len, left, right), p, 0.0)
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
    segment, block, first, q_len, k_len = _segment(tiles, n_tiles, cu_seqlens, n_docs, T)
    if segment < 0:
        return
    head = tl.program_id(1)
    kv_head = head // group
    start = first.to(tl.int64)
    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh

    r0 = block * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    q = _load_rows(Q + start * stride_qt + head * stride_qh, rows, stride_qt, q_len, HEAD_DIM, BLOCK_D, True)
    do = _load_rows(
        dOut + start * stride_dot + head * stride_doh, rows, stride_dot, q_len, HEAD_DIM, BLOCK_D, True
    )
    o = _load_rows(
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
    lo, full_lo, full_hi, hi = _block_range(r0, tl.minimum(r0 + BLOCK_M, q_len), k_len, left, right, BLOCK_N)
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
    _store_rows(
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
        q, do = _load_pair(
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
            p_t = tl.where(_visible(rows[None, :], cols[:, None], q_len, k_len, left, right), p_t, 0.0)
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
    segment, block, first, k_len, q_len = _segment(tiles, n_tiles, cu_seqlens, n_docs, T)
    if segment < 0:
        return
    kv_head = tl.program_id(1)
    start = first.to(tl.int64)
    c0 = block * BLOCK_N
    cols = c0 + tl.arange(0, BLOCK_N)
    k = _load_rows(
        K + start * stride_kt + kv_head * stride_kh, cols, stride_kt, k_len, HEAD_DIM, BLOCK_D, True
    )
    v = _load_rows(
        V + start * stride_vt + kv_head * stride_vh, cols, stride_vt, k_len, HEAD_DIM, BLOCK_D, True
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # Key j is seen by queries [j - right, j + left]: the forward's ranges with the window mirrored.
    lo, full_lo, full_hi, hi = _block_range(c0, tl.minimum(c0 + BLOCK_N, k_len), q_len, right, left, BLOCK_M)
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
    _store_rows(
        dK + start * stride_dkt + kv_head * stride_dkh, cols, stride_dkt, k_len,
        (dk * sm_scale).to(dK.dtype.element_ty), HEAD_DIM, BLOCK_D,
    )
    _store_rows(
        dV + start * stride_dvt + kv_head * stride_dvh, cols, stride_dvt, k_len, dv.to(dV.dtype.element_ty),
        HEAD_DIM, BLOCK_D,
    )


@triton.jit
def _ds_slot(DocSlots, segment, block, q_len, BM_KV: tl.constexpr, BLOCK_N: tl.constexpr):
    """First dS slot of key block `block` of a document. Under a causal mask with the whole past visible,
    key block b is seen by query blocks b R .. n_q - 1 (R = BLOCK_N / BM_KV), so it writes n_q - b R slots,
    and the document's key blocks before it wrote b n_q - R b (b - 1) / 2."""
    n_q = tl.cdiv(q_len, BM_KV)
    r = BLOCK_N // BM_KV
    return tl.load(DocSlots + segment) + block * n_q - r * block * (block - 1) // 2


@triton.jit
def _bwd_delta_kernel(
    Out, dOut, dLse, Delta, tiles, n_tiles, cu_seqlens, n_docs, T, stride_ot, stride_oh, stride_dot,
    stride_doh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """delta = rowsum(dO * O) - dlse, for the documents whose dQ pass runs after the dK/dV pass."""
    segment, block, first, length, _ = _segment(tiles, n_tiles, cu_seqlens, n_docs, T)
    if segment < 0:
        return
    head = tl.program_id(1)
    start = first.to(tl.int64)
    rows = block * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < length
    do = _load_rows(
        dOut + start * stride_dot + head * stride_doh, rows, stride_dot, length, HEAD_DIM, BLOCK_D, True
    )
    o = _load_rows(
        Out + start * stride_ot + head * stride_oh, rows, stride_ot, length, HEAD_DIM, BLOCK_D, True
    )
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dLse + head * T + start + rows, mask=row_ok, other=0.0)
    tl.store(Delta + head * T + start + rows, delta, mask=row_ok)


@triton.jit
def _bwd_dq_stored_kernel(
    K, DS, DocSlots, dQ, tiles, n_tiles, cu_seqlens, n_docs, T, n_slots, stride_kt, stride_kh, stride_dqt,
    stride_dqh, group, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BM_KV: tl.constexpr,
):
    """dQ = sum over key blocks of dS K, with dS as the dK/dV pass stored it: one matrix product per block
    pair instead of three. This query block's rows are BLOCK_M / BM_KV consecutive slots of each key block."""
    segment, block, first, q_len, k_len = _segment(tiles, n_tiles, cu_seqlens, n_docs, T)
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
    for kb in range(0, tl.cdiv(tl.minimum(r0 + BLOCK_M, k_len), BLOCK_N)):
        cols = kb * BLOCK_N + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, cols, stride_kt, k_len, HEAD_DIM, BLOCK_D, True)
        slot = _ds_slot(DocSlots, segment, kb, q_len, BM_KV, BLOCK_N) + r0 // BM_KV - kb * (BLOCK_N // BM_KV)
        # Rows past the document's end would read the next slots, which may hold anything: skip them.
        ds_ptrs = DS + (head * n_slots + slot).to(tl.int64) * (BM_KV * BLOCK_N) + tile
        ds = tl.load(ds_ptrs, mask=rows[:, None] < q_len, other=0.0)
        dq = tl.dot(ds, k, dq)
    _store_rows(
        dQ + start * stride_dqt + head * stride_dqh, rows, stride_dqt, q_len,
        (dq * sm_scale).to(dQ.dtype.element_ty), HEAD_DIM, BLOCK_D,
    )


# ----------------------------------------------------------------------------------------------------------
# Host helpers


def _window(T: int, left: int, right: int) -> tuple[int, int]:
    """-1 (unbounded) becomes T, which no distance inside the buffer reaches."""
    return (T if left < 0 else left), (T if right < 0 else right)


def _padded_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def check_interpreter() -> None:
    """Refuse to launch in the interpreter when triton's library was set up without it."""
    if INTERPRET and not _LIBRARY_INTERPRETED:
        raise RuntimeError(
            "triton was imported before the kernels module without TRITON_INTERPRET=1, so its "
            "library cannot run in the interpreter: set TRITON_INTERPRET=1 in the environment"
        )


def _check_launch(*tensors: torch.Tensor) -> None:
    check_interpreter()
    # Offsets within a document are int32 (cheaper address arithmetic); the document start is int64.
    if any(x.shape[0] * x.stride(0) >= 2**31 for x in tensors):
        raise ValueError("a token offset times the token stride must stay below 2**31")


def _descriptors(blocks: Blocks, rows: int, block_d: int, *tensors: torch.Tensor) -> tuple:
    """Ragged TMA descriptors of [T, H, D] tensors for [rows, block_d] tiles of one head, or Nones where the
    config does not ask for TMA or TMA cannot serve them all: before Hopper, or unaligned base or strides."""
    if not blocks.tma or (not INTERPRET and torch.cuda.get_device_capability(tensors[0].device)[0] < 9):
        return (None,) * len(tensors)
    for x in tensors:
        if x.data_ptr() % 16 or any(stride * x.element_size() % 16 for stride in x.stride()[:-1]):
            return (None,) * len(tensors)
    return tuple(create_ragged_descriptor(x, [rows, 1, block_d]) for x in tensors)


# ----------------------------------------------------------------------------------------------------------
# The plan: every tile table of a forward and backward call, in one int32 tensor


class _Launch(NamedTuple):
    kernel: str  # "fwd", "delta", "dq", "dkdv" or "dq_stored"
    blocks: Blocks | None  # None for the delta pass, which has no inner loop
    block: int  # rows per tile of its table
    last_block_first: bool
    shortest: int
    longest: int


def _stored_longest(config: Config, left: int, right: int) -> int:
    """Longest document whose dQ comes from the dS stored by its dK/dV pass (see `backward`); 0 for none."""
    longest = config["dkdv"][0][0]
    if "dq_stored" in config and longest is not None and right == 0 and left >= longest:
        return longest
    return 0


def _launches(config: Config, T: int, max_seqlen: int, left: int, right: int) -> list[_Launch]:
    """The launches of a forward and a backward call over documents of at most max_seqlen tokens, in order."""
    stored = _stored_longest(config, left, right)
    launches = [_Launch("fwd", b, b.m, True, lo, hi) for lo, hi, b in _classes(config["fwd"], T, max_seqlen)]
    if stored:
        launches.append(_Launch("delta", None, DELTA_ROWS, False, 0, stored))
    for lo, hi, b in _classes(config["dq"], T, max_seqlen):
        if max(lo, stored) < min(hi, max_seqlen):
            launches.append(_Launch("dq", b, b.m, True, max(lo, stored), hi))
    # Under a causal mask the first key blocks are seen by the most queries: run them first.
    launches += [
        _Launch("dkdv", b, b.n, False, lo, hi) for lo, hi, b in _classes(config["dkdv"], T, max_seqlen)
    ]
    if stored:
        b, store = config["dq_stored"], config["dkdv"][0][1]
        if b.n != store.n or b.m % store.m or b.m > store.n:
            raise ValueError(f"dq_stored {b} does not fit the dS tiles of {store}")
        launches.append(_Launch("dq_stored", b, b.m, True, 0, stored))
    return launches


# The kernels of each pass; a plan made for one pass holds only its tables.
_PASSES = {"fwd": ("fwd",), "bwd": ("delta", "dq", "dkdv", "dq_stored")}


def _plan_layout(
    T: int, n_docs: int, head_dim: int, window_left: int, window_right: int, max_seqlen: int, part: str | None
):
    """([(launch, offset, tiles)], offset of the dS slots or None, size) of a plan for pass `part` ("fwd",
    "bwd", or None for both): shapes only."""
    config = block_config(head_dim)
    left, right = _window(T, window_left, window_right)
    kernels = _PASSES[part] if part else _PASSES["fwd"] + _PASSES["bwd"]
    layout, size = [], 0
    for launch in _launches(config, T, max_seqlen, left, right):
        if launch.kernel in kernels:
            n = _n_tiles(T, n_docs, launch.block, launch.shortest)
            layout.append((launch, size, n))
            size += 2 * n
    slots_at = size if _stored_longest(config, left, right) and part != "fwd" else None
    return layout, slots_at, size + (0 if slots_at is None else n_docs + 1)


def plan_size(
    T: int, n_docs: int, head_dim: int, window_left: int, window_right: int, max_seqlen: int
) -> int:
    return _plan_layout(T, n_docs, head_dim, window_left, window_right, max_seqlen, None)[2]


def make_plan(
    cu_seqlens: torch.Tensor, T: int, head_dim: int, window_left: int, window_right: int, max_seqlen: int,
    part: str | None = None,
) -> torch.Tensor:
    """int32 [plan_size]: the tile table of every launch of a call over T tokens split by cu_seqlens,
    then, where short documents' dS is stored, the first dS slot of each document. It depends only on
    the documents, the head dim, the window and the bound max_seqlen on the documents' length (T or more
    for none), so every layer's forward and backward over the same documents can share one. `part` limits
    it to one pass ("fwd" or "bwd"), for a call of its own."""
    check_interpreter()
    layout = _plan_layout(T, cu_seqlens.numel() - 1, head_dim, window_left, window_right, max_seqlen, part)
    return _fill_plan(cu_seqlens, T, head_dim, max_seqlen, *layout)


def _fill_plan(
    cu_seqlens: torch.Tensor, T: int, head_dim: int, max_seqlen: int, layout, slots_at: int | None, size: int
):
    if max_seqlen < T and cu_seqlens.numel() > 1:
        # The classes above max_seqlen are not launched: a longer document would get no output. Checked on
        # the device, so that nothing waits for it; on CUDA a failure is a device-side assert.
        longest = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
        torch._assert_async(longest <= max_seqlen, f"a document is longer than max_seqlen={max_seqlen}")
    plan = torch.empty(size, dtype=torch.int32, device=cu_seqlens.device)
    for launch, at, n in layout:
        tile_table(
            cu_seqlens, T, launch.block, launch.last_block_first, launch.shortest, launch.longest,
            out=plan[at : at + 2 * n].view(2, n),
        )
    if slots_at is not None:
        store = block_config(head_dim)["dkdv"][0]
        _ds_slots(cu_seqlens, store[0], store[1].m, store[1].n, plan[slots_at:])
    return plan


def _ds_slots(cu_seqlens: torch.Tensor, longest: int, bm: int, bn: int, out: torch.Tensor) -> None:
    """Writes the first dS slot of each document of at most `longest` tokens (int32 [N + 1]) into out.
    A document of L tokens takes sum over its key blocks b of cdiv(L - b bn, bm) slots (see `_ds_slot`)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n_q, n_k = (lengths + bm - 1) // bm, (lengths + bn - 1) // bn
    slots = torch.where(lengths <= longest, n_k * n_q - (bn // bm) * n_k * (n_k - 1) // 2, 0)
    out.copy_(torch.cumsum(torch.cat([slots.new_zeros(1), slots]), 0))


def _ds_slot_count(T: int, n_docs: int, longest: int, bm: int, bn: int) -> int:
    """A number of dS slots that no set of documents of at most `longest` tokens in T tokens exceeds.

    A document of L tokens takes sum over its key blocks b of cdiv(L - b bn, bm) <= (L - b bn) / bm + 1
    slots, which is at most L / bn + 1 + (L^2 / (2 bn) + L) / bm; summed over documents with sum L <= T and
    L <= longest, that is below longest T / (2 bm bn) + T / bn + T / bm + N."""
    return longest * T // (2 * bm * bn) + T // bn + T // bm + n_docs + 1


def _planned(
    plan, cu_seqlens, T: int, head_dim: int, window_left: int, window_right: int, max_seqlen: int, part: str
):
    """([(launch, tile table)], dS slots or None) of pass `part` from a plan of both passes, or from one
    made here for this pass alone when plan is None."""
    n_docs = cu_seqlens.numel() - 1
    layout, slots_at, size = _plan_layout(
        T, n_docs, head_dim, window_left, window_right, max_seqlen, part if plan is None else None
    )
    if plan is None:
        plan = _fill_plan(cu_seqlens, T, head_dim, max_seqlen, layout, slots_at, size)
    elif plan.shape != (size,) or plan.dtype != torch.int32:
        raise ValueError(
            f"plan {plan.dtype} {tuple(plan.shape)} was not made for this call: {T} tokens, {n_docs} "
            f"documents, head dim {head_dim}, window ({window_left}, {window_right}) and max_seqlen "
            f"{max_seqlen} take int32 ({size},)"
        )
    views = [(launch, plan[at : at + 2 * n].view(2, n)) for launch, at, n in layout]
    tables = [(launch, tiles) for launch, tiles in views if launch.kernel in _PASSES[part]]
    return tables, None if slots_at is None else plan[slots_at:]


# ----------------------------------------------------------------------------------------------------------
# Launchers


def forward(
    q, k, v, cu_seqlens, window_left: int, window_right: int, softmax_scale: float, plan=None,
    max_seqlen: int | None = None,
):
    """out [T, H, D] in q's dtype and lse [H, T] float32 (natural log). The last dims must be contiguous.
    plan: from make_plan for the same documents, head dim, window and max_seqlen (None: T, no bound), or
    None to make this pass's here."""
    T, H, D = q.shape
    _check_launch(q, k, v)
    tables, _ = _planned(plan, cu_seqlens, T, D, window_left, window_right, max_seqlen or T, "fwd")
    left, right = _window(T, window_left, window_right)
    BLOCK_D = _padded_dim(D)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    for launch, tiles in tables:
        blocks = launch.blocks
        if blocks.gluon and right == 0 and left >= T and flash_attn_hopper.supported(q, k, v):
            flash_attn_hopper.forward(q, k, v, out, lse, tiles, cu_seqlens, softmax_scale, blocks)
            continue
        k_desc, v_desc = _descriptors(blocks, blocks.n, BLOCK_D, k, v)
        _fwd_kernel[(tiles.shape[1], H)](
            q, k, v, out, lse, k_desc, v_desc, tiles, tiles.shape[1], cu_seqlens, cu_seqlens.numel() - 1, T,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
            out.stride(1), H // k.shape[1], left, right, softmax_scale * LOG2E.value, HEAD_DIM=D,
            BLOCK_D=BLOCK_D, BLOCK_M=blocks.m, BLOCK_N=blocks.n, TMA=k_desc is not None,
            num_warps=blocks.warps, num_stages=blocks.stages,
        )
    return out, lse


def backward(
    dout, q, k, v, out, lse, dlse, cu_seqlens, window_left: int, window_right: int, softmax_scale: float,
    plan=None, max_seqlen: int | None = None,
):
    """(dq, dk, dv) shaped like (q, k, v). dlse, the gradient on lse, may be None; plan and max_seqlen as
    in `forward`.

    Causal attention over the whole past (flash-attn's default) takes the short documents' dQ from the dS
    that their dK/dV pass stores (bf16, about longest * T * H / 2 values for documents of up to `longest`
    tokens, the first dK/dV length class), instead of recomputing S and dP in a pass of its own. Other
    windows, and longer documents, take the recomputing dQ pass."""
    T, H, D = q.shape
    H_kv = k.shape[1]
    _check_launch(dout, q, k, v, out)
    tables, doc_slots = _planned(plan, cu_seqlens, T, D, window_left, window_right, max_seqlen or T, "bwd")
    store_longest, store_blocks = block_config(D)["dkdv"][0]
    left, right = _window(T, window_left, window_right)
    BLOCK_D = _padded_dim(D)
    n_docs = cu_seqlens.numel() - 1
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    delta = torch.empty_like(lse)
    ds, slots, n_slots = dq, cu_seqlens, 0  # placeholders, unread without STORE_DS
    if doc_slots is not None:
        slots = doc_slots
        n_slots = _ds_slot_count(T, n_docs, store_longest, store_blocks.m, store_blocks.n)
        # The last query block of a document reads dq_stored's m / m slots from its first one on.
        ds = torch.empty(
            (H * n_slots + block_config(D)["dq_stored"].m // store_blocks.m, store_blocks.m, store_blocks.n),
            dtype=q.dtype, device=q.device,
        )

    gluon = (
        right == 0 and left >= T and flash_attn_hopper.supported(q, k, v, dout)
        and out.is_contiguous() and dout.is_contiguous()
    )
    for launch, tiles in tables:
        blocks, grid = launch.blocks, (tiles.shape[1], H)
        store_ds = doc_slots is not None and launch.shortest == 0  # the dK/dV class whose dS dq_stored reads
        if launch.kernel == "delta":
            _bwd_delta_kernel[grid](
                out, dout, dlse, delta, tiles, tiles.shape[1], cu_seqlens, n_docs, T, out.stride(0),
                out.stride(1), dout.stride(0), dout.stride(1), HEAD_DIM=D, BLOCK_D=BLOCK_D,
                BLOCK=launch.block, HAS_DLSE=dlse is not None,
            )
        elif launch.kernel == "dq" and blocks.gluon and gluon:
            flash_attn_hopper.backward_dq(
                dout, q, k, v, out, lse, dlse, delta, dq, tiles, cu_seqlens, softmax_scale, blocks
            )
        elif launch.kernel == "dq":
            k_desc, v_desc = _descriptors(blocks, blocks.n, BLOCK_D, k, v)
            _bwd_dq_kernel[grid](
                q, k, v, out, dout, lse, dlse, delta, dq, k_desc, v_desc, tiles, tiles.shape[1], cu_seqlens,
                n_docs, T, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
                H // H_kv, left, right, softmax_scale * LOG2E.value, softmax_scale, HEAD_DIM=D,
                BLOCK_D=BLOCK_D, BLOCK_M=blocks.m, BLOCK_N=blocks.n, HAS_DLSE=dlse is not None,
                TMA=k_desc is not None, num_warps=blocks.warps, num_stages=blocks.stages,
            )
        elif launch.kernel == "dkdv" and blocks.gluon and gluon and not store_ds:
            flash_attn_hopper.backward_dkdv(
                dout, q, k, v, lse, delta, dk, dv, tiles, cu_seqlens, softmax_scale, blocks
            )
        elif launch.kernel == "dkdv":
            q_desc, do_desc = _descriptors(blocks, blocks.m, BLOCK_D, q, dout)
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
                k.stride(1), dq.stride(0), dq.stride(1), H // H_kv, softmax_scale, HEAD_DIM=D,
                BLOCK_D=BLOCK_D, BLOCK_M=blocks.m, BLOCK_N=store_blocks.n, BM_KV=store_blocks.m,
                num_warps=blocks.warps, num_stages=blocks.stages,
            )
    return dq, dk, dv
