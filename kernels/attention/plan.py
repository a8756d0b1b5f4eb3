"""Tile tables, and the plan that holds the tables of every launch of a forward and backward in one tensor.

Each kernel runs on a grid (tiles, heads) where a tile is one (segment, block) pair: a block of BLOCK rows
of one document, or of the tail of tokens past cu_seqlens[-1] that belong to no document. `tile_table`
lists them on the device, so the grid size depends on T and N only (never on the boundaries, and nothing
waits for the host); the table has at most cdiv(T, BLOCK) + N real tiles, zero-length documents have none,
and the unused entries exit at once. `make_plan` builds the tables of every launch in one tensor, which all
layers attending over the same documents can share.
"""

import functools  # noqa: I001 (kernels.common must come before triton)
from typing import NamedTuple

import torch

from kernels.attention import block_sizes
from kernels.attention.block_sizes import DELTA_ROWS, Blocks, Config
from kernels.common import check_interpreter, is_hopper

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


def window_bounds(T: int, left: int, right: int) -> tuple[int, int]:
    """-1 (unbounded) becomes T, which no distance inside the buffer reaches."""
    return (T if left < 0 else left), (T if right < 0 else right)


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


def longest_first(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int32 [N + 1]: the segments (documents, then the tail) from the longest to the shortest, equal
    lengths in their own order, as an order for tile_table."""
    sizes = torch.diff(cu_seqlens, append=cu_seqlens.new_full((1,), num_tokens))
    return torch.argsort(sizes, descending=True, stable=True).to(torch.int32)


def tile_table(
    cu_seqlens: torch.Tensor, num_tokens: int, block: int, last_block_first: bool, shortest: int = 0,
    longest: int | None = None, out: torch.Tensor | None = None, order: torch.Tensor | None = None,
) -> torch.Tensor:
    """int32 [2, n]: (segment, block index) of each tile of the segments of length in (shortest, longest],
    then (-1, *) padding. Written into `out` when given.

    Segment s < N is document s; segment N is the tail [cu_seqlens[N], num_tokens), which attends to
    nothing: it belongs to the table with shortest = 0 whatever its length, so that a plan bounded by
    max_seqlen, which launches no class above it, still writes the tail's rows. A segment of length L
    has cdiv(L, block) tiles, so the real tiles number at most n = cdiv(T, block) + N, where N may be
    lowered to T // (shortest + 1), the most segments longer than `shortest`.

    The segments run in `order` (a permutation of 0 .. N, e.g. longest_first's), else as in cu_seqlens.
    Within a segment the blocks run from the last to the first when last_block_first: under a causal mask
    the last query block does the most work, and starting the largest tiles first evens out the end of the
    launch.
    One small launch: a dozen torch ops would cost more than the table is worth on short batches.
    """
    n_docs = cu_seqlens.numel() - 1
    n_tiles = _n_tiles(num_tokens, n_docs, block, shortest)
    tiles = torch.empty((2, n_tiles), dtype=torch.int32, device=cu_seqlens.device) if out is None else out
    _tile_table_kernel[(triton.cdiv(n_tiles, 64),)](
        cu_seqlens, order, tiles, n_tiles, n_docs, num_tokens, shortest,
        num_tokens if longest is None else longest, BLOCK=block, LAST_BLOCK_FIRST=last_block_first,
        ORDERED=order is not None, TILES=64, SEGMENTS=256,
    )
    return tiles


@triton.jit
def _tile_table_kernel(
    cu_seqlens, order, tiles, n_tiles, n_docs, T, shortest, longest, BLOCK: tl.constexpr,
    LAST_BLOCK_FIRST: tl.constexpr, ORDERED: tl.constexpr, TILES: tl.constexpr, SEGMENTS: tl.constexpr,
):
    """Each program fills TILES entries, scanning the segments (in `order` where ORDERED) SEGMENTS at a
    time: a tile's segment is the one at the place given by the number of segments whose tiles all come
    before it."""
    tile = tl.program_id(0) * TILES + tl.arange(0, TILES)
    place = tl.zeros([TILES], tl.int32)
    first = tl.zeros([TILES], tl.int32)  # first tile of the tile's segment
    end = tl.full([TILES], 2**30, tl.int32)  # one past its last tile
    done = n_docs * 0  # tiles of the segments scanned so far
    for s0 in range(0, n_docs + 1, SEGMENTS):
        s = s0 + tl.arange(0, SEGMENTS)
        if ORDERED:
            s = tl.load(order + s, mask=s <= n_docs, other=n_docs + 1)
        start = tl.load(cu_seqlens + s, mask=s <= n_docs, other=T)
        stop = tl.load(cu_seqlens + s + 1, mask=s < n_docs, other=T)
        size = stop - start
        in_class = (size > shortest) & (size <= longest)
        blocks = tl.where(in_class | ((s == n_docs) & (shortest == 0)), tl.cdiv(size, BLOCK), 0)
        last = done + tl.cumsum(blocks, 0)  # one past each segment's last tile
        before = last[None, :] <= tile[:, None]
        place += tl.sum(before.to(tl.int32), 1)
        first = tl.maximum(first, tl.max(tl.where(before, last[None, :], 0), 1))
        end = tl.minimum(end, tl.min(tl.where(before, 2**30, last[None, :]), 1))
        done = tl.max(last, 0)
    if LAST_BLOCK_FIRST:
        index = end - 1 - tile
    else:
        index = tile - first
    inside = tile < n_tiles
    segment = place
    if ORDERED:
        segment = tl.load(order + place, mask=inside & (place <= n_docs), other=n_docs + 1)
    tl.store(tiles + tile, tl.where(segment <= n_docs, segment, -1), mask=inside)
    tl.store(tiles + n_tiles + tile, index, mask=inside)


class _Launch(NamedTuple):
    kernel: str  # "fwd", "delta", "dq", "dkdv" or "dq_stored"
    blocks: Blocks | None  # None for the delta pass, which has no inner loop
    block: int  # rows per tile of its table
    last_block_first: bool
    shortest: int
    longest: int
    # Documents from the longest to the shortest (see longest_first), else in their own order.
    longest_first: bool = False


def _stored_longest(config: Config, left: int, right: int) -> int:
    """Longest document whose dQ comes from the dS stored by its dK/dV pass (see `backward`); 0 for none."""
    longest = config["dkdv"][0][0]
    if "dq_stored" in config and longest is not None and right == 0:
        return longest
    return 0


def fused_shortest(config: Config, right: int) -> int | None:
    """Documents longer than this take their dQ from the Gluon dK/dV pass on Hopper (see hopper_backward):
    those of its `gluon` classes, under a causal mask; None for none."""
    gluon = [lo for lo, _, b in _classes(config["dkdv"], 1 << 62, 1 << 62) if b.gluon]
    return min(gluon) if gluon and right == 0 else None


def _launches(config: Config, T: int, max_seqlen: int, left: int, right: int) -> list[_Launch]:
    """The launches of a forward and a backward call over documents of at most max_seqlen tokens, in order."""
    stored = _stored_longest(config, left, right)
    fused = fused_shortest(config, right)
    launches = [_Launch("fwd", b, b.m, True, lo, hi) for lo, hi, b in _classes(config["fwd"], T, max_seqlen)]
    # delta, for the dK/dV passes that run before a dQ pass or compute dQ themselves (the dQ pass of the
    # other documents writes it; on other GPUs it writes the fused documents' delta a second time).
    if stored or fused is not None:
        launches.append(_Launch("delta", None, DELTA_ROWS, False, 0, T if fused is not None else stored))
    for lo, hi, b in _classes(config["dq"], T, max_seqlen):
        if max(lo, stored) < min(hi, max_seqlen):
            launches.append(_Launch("dq", b, b.m, True, max(lo, stored), hi))
    # Under a causal mask the first key blocks are seen by the most queries: run them first, except in the
    # Gluon pass, whose dQ adds wait for the key tiles after them (see hopper_backward). Its key tiles
    # then run the longest documents first: a program per key tile whose work grows with the document's
    # length, and the last to start, a document's first key tiles, are its longest, so that the shorter
    # documents' tiles fill the end of the launch. On an H200 the backward measured 0.4-1.3% faster on
    # mixes (a) and (c) of scripts/bench_attention.py and level on (b) (seven alternating rounds, gradients
    # bitwise equal). Under a window no key tile sees more than the window's query blocks: there the order
    # stays (sorted, 1% slower on (b) at head dim 64, level elsewhere), as it does in the persistent
    # forward, which claims its items in table order (sorted, 1.7% slower to 1.5% faster, cell by cell).
    launches += [
        _Launch("dkdv", b, b.n, b.gluon, lo, hi, b.gluon and left >= T)
        for lo, hi, b in _classes(config["dkdv"], T, max_seqlen)
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
    T: int, n_docs: int, head_dim: int, window_left: int, window_right: int, max_seqlen: int,
    part: str | None, on_hopper: bool,
):
    """(launches, offset of the dS slots or None, size) of a plan for pass `part` ("fwd", "bwd", or None for
    both) on a Hopper GPU or not, launches as (launch, offset, tiles): shapes only. Made once per shape and
    block config and looked up by every call after (making it took about 25 us of host time a pass)."""
    config = block_sizes.block_config(head_dim, on_hopper)
    frozen = tuple((key, tuple(value) if isinstance(value, list) else value) for key, value in config.items())
    return _layout(frozen, T, n_docs, window_left, window_right, max_seqlen, part)


@functools.lru_cache(maxsize=256)
def _layout(
    frozen_config, T: int, n_docs: int, window_left: int, window_right: int, max_seqlen: int, part: str | None
):
    config = dict(frozen_config)
    left, right = window_bounds(T, window_left, window_right)
    kernels = _PASSES[part] if part else _PASSES["fwd"] + _PASSES["bwd"]
    layout, size = [], 0
    for launch in _launches(config, T, max_seqlen, left, right):
        if launch.kernel in kernels:
            n = _n_tiles(T, n_docs, launch.block, launch.shortest)
            layout.append((launch, size, n))
            size += 2 * n
    slots_at = size if _stored_longest(config, left, right) and part != "fwd" else None
    return tuple(layout), slots_at, size + (0 if slots_at is None else n_docs + 1)


def plan_size(
    T: int, n_docs: int, head_dim: int, window_left: int, window_right: int, max_seqlen: int,
    device: torch.device,
) -> int:
    on_hopper = is_hopper(device)
    return _plan_layout(T, n_docs, head_dim, window_left, window_right, max_seqlen, None, on_hopper)[2]


def make_plan(
    cu_seqlens: torch.Tensor, T: int, head_dim: int, window_left: int, window_right: int, max_seqlen: int,
    part: str | None = None,
) -> torch.Tensor:
    """int32 [plan_size]: the tile table of every launch of a call over T tokens split by cu_seqlens,
    then, where short documents' dS is stored, the first dS slot of each document. It depends only on
    the documents, the head dim, the window and the bound max_seqlen on the documents' length (T or more
    for none), so every layer's forward and backward over the same documents can share one. `part` limits
    it to one pass ("fwd" or "bwd"), for a call of its own. The launches, and so the plan, differ between
    Hopper GPUs and others (see block_sizes)."""
    check_interpreter()
    layout = _plan_layout(
        T, cu_seqlens.numel() - 1, head_dim, window_left, window_right, max_seqlen, part,
        is_hopper(cu_seqlens.device),
    )
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
    order = longest_first(cu_seqlens, T) if any(launch.longest_first for launch, _, _ in layout) else None
    for launch, at, n in layout:
        tile_table(
            cu_seqlens, T, launch.block, launch.last_block_first, launch.shortest, launch.longest,
            out=plan[at : at + 2 * n].view(2, n), order=order if launch.longest_first else None,
        )
    if slots_at is not None:
        store = block_sizes.block_config(head_dim, is_hopper(cu_seqlens.device))["dkdv"][0]
        _ds_slots(cu_seqlens, store[0], store[1].m, store[1].n, plan[slots_at:])
    return plan


def _ds_slots(cu_seqlens: torch.Tensor, longest: int, bm: int, bn: int, out: torch.Tensor) -> None:
    """Writes the first dS slot of each document of at most `longest` tokens (int32 [N + 1]) into out.
    A document of L tokens takes sum over its key blocks b of cdiv(L - b bn, bm) slots (see `_ds_slot` in
    backward.py)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n_q, n_k = (lengths + bm - 1) // bm, (lengths + bn - 1) // bn
    slots = torch.where(lengths <= longest, n_k * n_q - (bn // bm) * n_k * (n_k - 1) // 2, 0)
    out.copy_(torch.cumsum(torch.cat([slots.new_zeros(1), slots]), 0))


def ds_slot_count(T: int, n_docs: int, longest: int, bm: int, bn: int) -> int:
    """A number of dS slots that no set of documents of at most `longest` tokens in T tokens exceeds.

    A document of L tokens takes sum over its key blocks b of cdiv(L - b bn, bm) <= (L - b bn) / bm + 1
    slots, which is at most L / bn + 1 + (L^2 / (2 bn) + L) / bm; summed over documents with sum L <= T and
    L <= longest, that is below longest T / (2 bm bn) + T / bn + T / bm + N."""
    return longest * T // (2 * bm * bn) + T // bn + T // bm + n_docs + 1


def planned(
    plan, cu_seqlens, T: int, head_dim: int, window_left: int, window_right: int, max_seqlen: int, part: str
):
    """([(launch, tile table)], dS slots or None) of pass `part` from a plan of both passes, or from one
    made here for this pass alone when plan is None."""
    n_docs = cu_seqlens.numel() - 1
    layout, slots_at, size = _plan_layout(
        T, n_docs, head_dim, window_left, window_right, max_seqlen, part if plan is None else None,
        is_hopper(cu_seqlens.device),
    )
    passes = _PASSES[part]
    if plan is None:
        plan = _fill_plan(cu_seqlens, T, head_dim, max_seqlen, layout, slots_at, size)
    elif plan.shape != (size,) or plan.dtype != torch.int32:
        raise ValueError(
            f"plan {plan.dtype} {tuple(plan.shape)} was not made for this call: {T} tokens, {n_docs} "
            f"documents, head dim {head_dim}, window ({window_left}, {window_right}) and max_seqlen "
            f"{max_seqlen} take int32 ({size},)"
        )
    tables = [
        (launch, plan[at : at + 2 * n].view(2, n)) for launch, at, n in layout if launch.kernel in passes
    ]
    return tables, None if slots_at is None else plan[slots_at:]
