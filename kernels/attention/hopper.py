"""What the warp-specialised Gluon passes on Hopper share (triton.experimental.gluon): the launch shape,
the ring of TMA slots, the loads by ragged descriptor, and which tensors they take.

The partitions of a program:
- a load warp streams tiles by TMA into a ring of STAGES slots, each with its own mbarriers: K and V for
  the forward (query tiles of 128 or 192 rows, one head), Q and dO for the dK/dV pass (key tiles of 128
  rows, one kv head), with the query block's lse and delta beside them;
- warpgroups own 64 of the tile's rows each: two, or three in a forward of 192-row query tiles. They wait
  only on their slot's mbarriers, never on a CTA-wide barrier (triton's own pipeliner puts one around
  every TMA issue). In the forward each issues the next key block's products before the current block's
  softmax (FlashAttention-3's overlap within a warpgroup; see hopper_forward._attend for what ptxas makes
  of it);
- in the dK/dV pass, a writer warp that adds each query block's share of dQ into float32 sums by TMA.
Head dim 64 or 128, causal, over the whole past or a window of the last `left` keys: a query tile visits the
key blocks from its window's first one (`first_block`) to the diagonal, a key tile the query blocks from the
diagonal to its window's end; the blocks on the diagonal and at the window's edge are masked. The passes
run on the tile tables of plan.py (hopper_forward.py, hopper_backward.py).
"""

import functools

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.tools.ragged_tma import create_ragged_descriptor

from kernels.common import is_hopper, nvmma_layout

# Triton 3.6 names the TMA load async_copy_global_to_shared; later releases async_load.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@builtin
def _tma_add_36(tensor_desc, coord, src, _semantic=None):
    """Triton 3.6's TMA add, which its Gluon builder has but no Python name: adds a shared-memory tile
    into global memory at coord."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    add = ir.DESCRIPTOR_REDUCE_KIND.ADD
    _semantic.builder.create_async_tma_reduce(add, tensor_desc.handle, coord, src.handle)


tma_add = getattr(tma, "async_atomic_add", None) or _tma_add_36
# Triton 3.6 names the TMA store async_copy_shared_to_global; later releases async_store.
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# Triton 3.6 names the barrier of a partition's threads thread_barrier; later releases barrier.
barrier = getattr(gl, "barrier", None) or gl.thread_barrier


HEAD_DIMS = (64, 128)


LOG2E = gl.constexpr(1.4426950408889634)


LN2 = gl.constexpr(0.6931471805599453)


# Launch: the kernel's own warps are the first warpgroup; the partitions add one or two more warpgroups and
# the load warp (padded to a warpgroup), with kernels.common.max_registers of that many warpgroups.
WARPS = 4


@gluon.constexpr_function
def mma_layout(n):
    """Accumulator layout of one warpgroup's [64, n] products."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def transposed_slot(smem, slot, BN: gl.constexpr, D: gl.constexpr):
    """K (or V) of a slot, transposed: the B operand of Q K^T."""
    return smem.index(slot).reshape([BN, D]).permute((1, 0))


@gluon.jit
def ragged_row(start, length, row):
    """Coordinates of row `row` of the segment [start, start + length) in a ragged descriptor
    (triton.tools.ragged_tma): the hardware reads rows past the segment's end as zeros."""
    billion = 0x40000000
    return billion, start + length, billion - length + row


@gluon.jit
def load_pair(a_desc, b_desc, a_smem, b_smem, a_ready, b_ready, free, start, length, head, i, j):
    """Block i of two tensors of a segment (K and V, or Q and dO) into the ring slot of the j-th pair through
    the ring, once that slot is free; returns the slot."""
    BLOCK: gl.constexpr = a_desc.block_type.shape[2]
    NS: gl.constexpr = a_smem.type.shape[0]
    slot = j % NS
    # A slot's first use waits on phase 1, which a fresh mbarrier counts as complete.
    mbarrier.wait(free.index(slot), ((j // NS) & 1) ^ 1)
    a, b, c = ragged_row(start, length, i * BLOCK)
    mbarrier.expect(a_ready.index(slot), a_desc.block_type.nbytes)
    tma_load(a_desc, [a, b, c, head, 0], a_ready.index(slot), a_smem.index(slot))
    mbarrier.expect(b_ready.index(slot), b_desc.block_type.nbytes)
    tma_load(b_desc, [a, b, c, head, 0], b_ready.index(slot), b_smem.index(slot))
    return slot


@gluon.jit
def stream_pairs(a_desc, b_desc, a_smem, b_smem, a_ready, b_ready, free, start, length, head, lo, hi, j0):
    """Blocks lo .. hi - 1 of two tensors of a segment, each pair into the next ring slot once it is free.
    j0 pairs went through the ring before; returns the count after these."""
    for i in range(lo, hi):
        load_pair(a_desc, b_desc, a_smem, b_smem, a_ready, b_ready, free, start, length, head, i, j0 + i - lo)
    return j0 + hi - lo


@gluon.jit
def load_parts(desc, smem, bar, start, length, head, r0, FIRST: gl.constexpr, PARTS: gl.constexpr):
    """The PARTS parts (the descriptor's rows each) of a tile from row r0 on into smem slots FIRST ..
    FIRST + PARTS - 1, completing on bar."""
    ROWS: gl.constexpr = desc.block_type.shape[2]
    for h in gl.static_range(PARTS):
        a, b, c = ragged_row(start, length, r0 + h * ROWS)
        tma_load(desc, [a, b, c, head, 0], bar, smem.index(FIRST + h))


@gluon.jit
def table_entry(tile, tiles, n_tiles, cu_seqlens, n_docs, T, BM: gl.constexpr, BN: gl.constexpr):
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
def first_block(r0, left, BN: gl.constexpr):
    """The first key block that a query tile from row r0 sees, when row r sees keys r - left .. r."""
    return gl.maximum(r0 - left, 0) // BN


@gluon.jit
def needs_mask(block, last_block, last_row, left, BN: gl.constexpr, WINDOW: gl.constexpr):
    """Whether key block `block` holds keys that some of the rows up to last_row do not see: keys after a
    row (the tile's last blocks, from last_block on), or, under a window (WINDOW), before it."""
    cut = block >= last_block
    if WINDOW:
        cut = cut | (block * BN < last_row - left)
    return cut


@gluon.jit
def tile_ring(a_desc, b_desc, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """A ring of STAGES slots for pairs of tiles (K and V, or Q and dO) and their mbarriers (ready: the
    load landed; free: the CONSUMERS warpgroups are done with the slot), and one more mbarrier for the
    tiles that are loaded once."""
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
        mbarrier.init(free.index(i), count=CONSUMERS)
    return a_smem, b_smem, once, a_ready, b_ready, free


@gluon.jit
def store_zeros(X, start, r0, length, head, stride_t, BM: gl.constexpr, D: gl.constexpr,
                 layout: gl.constexpr):
    """Zeros into rows r0 .. r0 + BM - 1 (those before `length`) of the segment from token `start` of
    one head of a [T, H, D] tensor."""
    rows = r0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    offs = (start + rows).to(gl.int64)[:, None] * stride_t + head * D + cols[None, :]
    gl.store(X + offs, gl.zeros([BM, D], X.dtype.element_ty, layout), mask=(rows < length)[:, None])


def supported(*tensors: torch.Tensor) -> bool:
    """Whether these kernels can read these [T, H, D] tensors by TMA: a Hopper GPU, 16-bit, head dim 64 or
    128, 16-byte aligned bases and token/head strides."""
    q = tensors[0]
    if not is_hopper(q.device):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or q.shape[2] not in HEAD_DIMS:
        return False
    return all(
        x.data_ptr() % 16 == 0 and x.stride(2) == 1 and all(stride * 2 % 16 == 0 for stride in x.stride()[:2])
        for x in tensors
    )


def tma_descriptor(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """Ragged TMA descriptor of a [T, H, D] tensor for [rows, D] tiles of one head and one segment."""
    return TensorDescriptor(x, *_ragged_geometry(x.shape, x.stride(), x.dtype, rows))


@functools.lru_cache(maxsize=256)
def _ragged_geometry(shape, strides, dtype, rows):
    """(shape, strides, block shape, layout) of the ragged descriptor, made once per tensor geometry by
    triton's create_ragged_descriptor on a meta tensor: made per call, with that descriptor's checks and
    then the Gluon descriptor's, it took 18 us a descriptor under cProfile on an H200's host, and a forward
    + backward call makes ten."""
    ragged = create_ragged_descriptor(torch.empty_strided(shape, strides, dtype=dtype, device="meta"),
                                      [rows, 1, shape[2]])
    return ragged.shape, ragged.strides, ragged.block_shape, nvmma_layout(tuple(ragged.block_shape), dtype)
