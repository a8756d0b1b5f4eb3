"""Best-fit packing of documents into buffers of T tokens with at most N attention segments.

Planning (`Packer`) works on document lengths only, so every rank can plan the same global stream of
buffers cheaply and materialise (`fill`) only its own.

A window holds up to `window` pending documents in arrival order (the epoch's shuffled order). Each
is pending as its next piece: the rest of the document, at most T tokens of it. Per buffer:

- The oldest pending piece opens the buffer: no document waits long, so the stream follows the
  shuffled order instead of drifting (long documents first, short ones last, or the reverse).
- Best fit: while there is room, place whole the longest pending piece that fits (the oldest among
  equals), so the buffer fills with few cuts.
- Crop, only when nothing fits: the longest pending piece fills the rest of the buffer exactly.
- A document that is not finished (it was cropped, or its piece was T tokens of a longer document)
  queues its next piece at the back of the window: pieces of one long document spread over the
  stream instead of filling consecutive buffers. No token is ever dropped.
- A piece longer than max_seqlen (S) becomes consecutive segments of S tokens (declared splits).
- Segments never span two documents. If placing the next document would need more than N segments
  (keeping room to close the buffer), the buffer is closed early (overflow) with filler instead.
- Filler (no-loss tokens: inputs bos, targets -1) closes a buffer that overflowed or ended an epoch;
  it too is cut into segments of at most S, so no segment ever exceeds max_seqlen.
- An epoch's documents are all placed before the next epoch's first one (its last buffer may end in
  filler), so every token of every document appears exactly once per epoch, in order.

Targets: each position predicts the next token of its document; a document's last token predicts
bos (end of document, as with plain concatenation), a cropped or split piece's last token its true
next token. Position ids restart at 0 at every segment start.
"""

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from data.config import segments


@dataclass
class Documents:
    """The documents of a split: document i is tokens[shard[i]][start[i] : start[i] + length[i]], bos first,
    and tokens[shard[i]][start[i] + length[i]] is the token after it (a bos)."""

    tokens: list[np.ndarray]
    shard: np.ndarray  # int32 [n]
    start: np.ndarray  # int64 [n]
    length: np.ndarray  # int64 [n]

    @classmethod
    def from_shards(cls, shards: list[tuple[np.ndarray, np.ndarray]]) -> "Documents":
        tokens = [t.view(np.ndarray) for t, _ in shards]  # plain views: slicing a memmap object is slower
        shard = np.concatenate([np.full(len(o) - 1, i, np.int32) for i, (_, o) in enumerate(shards)] or [[]])
        start = np.concatenate([o[:-1] for _, o in shards] or [[]]).astype(np.int64)
        length = np.concatenate([np.diff(o) for _, o in shards] or [[]]).astype(np.int64)
        return cls(tokens, shard.astype(np.int32), start, length)

    def __len__(self) -> int:
        return len(self.length)


@dataclass
class Plan:
    """One buffer: its document pieces (doc, start, end) in order, then `filler` no-loss tokens."""

    pieces: list[tuple[int, int, int]]
    cropped: int  # tokens of the last piece when it was cut to fill the buffer, else 0
    filler: int
    overflow: bool  # closed early: one more document would have needed more than max_num_docs segments


class Packer:
    """The planning state: the epoch's document order, a cursor in it, and the pending window.

    `order(epoch)` gives the document order of an epoch. With infinite=False, `next_plan` returns None
    after one epoch.
    """

    def __init__(self, lengths, T: int, S: int, N: int, window: int, order: Callable, infinite: bool):
        if len(lengths) == 0:
            raise ValueError("nothing to pack: no documents")
        self.lengths, self.T, self.S, self.N, self.window = lengths, T, S, N, window
        self.order_of, self.infinite = order, infinite
        self.load_state({"epoch": 0, "cursor": 0, "seq": 0, "buffer": 0, "pending": []})

    def state(self) -> dict:
        """Plain ints and lists; enough to resume the exact stream of plans. A pending entry is
        [doc, offset, arrival]: its piece is the next min(length - offset, T) tokens."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seq": self.seq,
            "buffer": self.buffer,
            "pending": [[doc, offset, -neg] for _, neg, doc, offset in self.pending],
        }

    def load_state(self, state: dict) -> None:
        self.epoch, self.cursor, self.seq, self.buffer = (
            state[k] for k in ("epoch", "cursor", "seq", "buffer")
        )
        self.order = self.order_of(self.epoch)
        # Sorted by (length, -arrival): the best fit is the last entry not longer than the room, and
        # among equal lengths that is the earliest arrival.
        self.pending = sorted(
            (min(int(self.lengths[d]) - o, self.T), -s, d, o) for d, o, s in state["pending"]
        )

    def progress(self) -> float:
        """Epochs done, fractional: the epoch index plus the share of its documents taken in."""
        return self.epoch + self.cursor / len(self.order)

    def _queue(self, doc: int, offset: int) -> None:
        """Append the next piece of a document (from `offset`) to the window."""
        bisect.insort(self.pending, (min(int(self.lengths[doc]) - offset, self.T), -self.seq, doc, offset))
        self.seq += 1

    def _refill(self) -> None:
        while len(self.pending) < self.window and self.cursor < len(self.order):
            self._queue(int(self.order[self.cursor]), 0)
            self.cursor += 1

    def next_plan(self) -> Plan | None:
        self._refill()
        if not self.pending:
            if not self.infinite:
                return None
            self.epoch, self.cursor = self.epoch + 1, 0
            self.order = self.order_of(self.epoch)
            self._refill()
        T, S, N, pending = self.T, self.S, self.N, self.pending
        pieces, pos, used, cropped, overflow = [], 0, 0, 0, False
        while pos < T and pending:
            room = T - pos
            if not pieces:  # the oldest opens the buffer (it fits: pieces are at most T long)
                i = max(range(len(pending)), key=lambda j: pending[j][1])
            else:
                i = bisect.bisect_right(pending, (room, math.inf)) - 1
            if i >= 0:
                length, _, doc, offset = pending[i]
                # Keep enough segments to close the buffer with filler afterwards.
                if used + segments(length, S) + segments(room - length, S) > N:
                    overflow = True
                    break
                del pending[i]
                used += segments(length, S)
            else:
                _, _, doc, offset = pending.pop()  # nothing fits: crop the longest piece
                length = cropped = room
                used += segments(length, S)
            pieces.append((doc, offset, offset + length))
            pos += length
            if offset + length < self.lengths[doc]:
                self._queue(doc, offset + length)
            self._refill()
        self.buffer += 1
        return Plan(pieces, cropped, T - pos, overflow)


def fill(plan: Plan, docs: Documents, T: int, S: int, N: int, bos: int) -> tuple[np.ndarray, np.ndarray]:
    """Materialise a plan: int64 [3, T] rows (input_ids, targets, position_ids), int32 [N + 1] cu_seqlens."""
    rows = np.empty((3, T), dtype=np.int64)
    inputs, targets, positions = rows
    bounds, pos = [0], 0
    for doc, a, b in plan.pieces:
        tokens, start, n = docs.tokens[docs.shard[doc]], docs.start[doc], b - a
        inputs[pos : pos + n] = tokens[start + a : start + b]
        targets[pos : pos + n] = tokens[start + a + 1 : start + b + 1]
        bounds.extend(range(pos + S, pos + n, S))
        pos += n
        bounds.append(pos)
    if pos < T:
        inputs[pos:] = bos
        targets[pos:] = -1
        bounds.extend(range(pos + S, T, S))
        bounds.append(T)
    cu_seqlens = np.full(N + 1, T, dtype=np.int32)
    cu_seqlens[: len(bounds)] = bounds
    np.subtract(np.arange(T), np.repeat(cu_seqlens[:-1], np.diff(cu_seqlens)), out=positions)
    return rows, cu_seqlens


def pack_documents(lengths, T: int, S: int, N: int, window: int) -> list[Plan]:
    """All plans of one pass over documents of these lengths, in their given order."""
    packer = Packer(
        np.asarray(lengths), T, S, N, window, lambda epoch: np.arange(len(lengths)), infinite=False
    )
    plans = []
    while (plan := packer.next_plan()) is not None:
        plans.append(plan)
    return plans
