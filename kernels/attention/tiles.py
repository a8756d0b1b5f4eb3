"""What the Triton passes share: which tile a program owns, which key blocks its rows see, and the loads
and stores of a tile's rows, by pointer or by TMA.

On Hopper, a length class may stream its inner loop's tiles by TMA through ragged descriptors
(triton.tools.ragged_tma): the hardware bounds each load to the tile's document and fills the rest with
zeros, so no thread computes addresses or masks for those loads.
"""

import torch  # noqa: I001 (kernels.common must come before triton)

from kernels.attention.block_sizes import Blocks
from kernels.common import INTERPRET, capability, check_interpreter

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.ragged_tma import create_ragged_descriptor, load_ragged  # noqa: E402


@triton.jit
def program_tile(tiles, n_tiles, cu_seqlens, n_docs, T):
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
def block_range(r0, r1, n_other, before, after, BLOCK: tl.constexpr):
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
def visible(q_pos, k_pos, q_len, k_len, left, right):
    """Mask of query/key pairs of one segment that attend (broadcast q_pos against k_pos)."""
    return (q_pos < q_len) & (k_pos < k_len) & (k_pos >= q_pos - left) & (k_pos <= q_pos + right)


@triton.jit
def load_rows(
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
def store_rows(base, rows, stride, n_rows, x, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    ptrs = base + rows[:, None] * stride + cols[None, :]
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM))


@triton.jit
def load_block(
    desc, base, start, n_rows, row0, head, stride, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr, CHECK_ROWS: tl.constexpr, TMA: tl.constexpr,
):
    """[BLOCK, BLOCK_D] tile of rows row0.. of a segment of n_rows rows starting at token `start`, one
    head; rows past n_rows read as 0. By TMA from the [T, H, D] descriptor, or from `base` (the segment's
    first row of this head) by pointers."""
    if TMA:
        return tl.reshape(load_ragged(desc, start, n_rows, [row0, head, 0]), [BLOCK, BLOCK_D])
    return load_rows(base, row0 + tl.arange(0, BLOCK), stride, n_rows, HEAD_DIM, BLOCK_D, CHECK_ROWS)


@triton.jit
def load_pair(
    a_desc, b_desc, a_base, b_base, start, n_rows, block, head, stride_a, stride_b, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, CHECK_ROWS: tl.constexpr, TMA: tl.constexpr,
):
    """Block `block` of two tensors the inner loops stream together: K and V, or Q and dO."""
    row0 = block * BLOCK
    a = load_block(
        a_desc, a_base, start, n_rows, row0, head, stride_a, HEAD_DIM, BLOCK_D, BLOCK, CHECK_ROWS, TMA
    )
    b = load_block(
        b_desc, b_base, start, n_rows, row0, head, stride_b, HEAD_DIM, BLOCK_D, BLOCK, CHECK_ROWS, TMA
    )
    return a, b


def padded_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def check_launch(*tensors: torch.Tensor) -> None:
    check_interpreter()
    # Offsets within a document are int32 (cheaper address arithmetic); the document start is int64.
    if any(x.shape[0] * x.stride(0) >= 2**31 for x in tensors):
        raise ValueError("a token offset times the token stride must stay below 2**31")


def tma_descriptors(blocks: Blocks, rows: int, block_d: int, *tensors: torch.Tensor) -> tuple:
    """Ragged TMA descriptors of [T, H, D] tensors for [rows, block_d] tiles of one head, or Nones where the
    config does not ask for TMA or TMA cannot serve them all: before Hopper, or unaligned base or strides."""
    if not blocks.tma or (not INTERPRET and capability(tensors[0].device)[0] < 9):
        return (None,) * len(tensors)
    for x in tensors:
        if x.data_ptr() % 16 or any(stride * x.element_size() % 16 for stride in x.stride()[:-1]):
            return (None,) * len(tensors)
    return tuple(create_ragged_descriptor(x, [rows, 1, block_d]) for x in tensors)
