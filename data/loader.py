"""The training loader: fixed-shape packed batches from memory-mapped shards, on the training device.

Every rank plans the same global stream of buffers (best-fit packing of the split's documents in a
seed-and-epoch-dependent order) and keeps buffers rank, rank + world_size, ...: ranks get disjoint
data that together covers it, and the stream does not depend on the number of ranks. A rank's state
after its k-th batch is the stream's position after the k-th round of world_size buffers, the same on
every rank: a checkpoint keeps one, and a run with another number of ranks continues the stream from it
(global buffer i goes to rank i % world_size). A background
thread builds the batches into (pinned, on CUDA) host memory; `next` copies them non-blocking.
"""

import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch

from data.config import DataError, check_config
from data.packing import Documents, Packer, fill
from data.shards import Prepared

_END = object()


@dataclass
class Batch:
    input_ids: torch.Tensor  # [T] long
    targets: torch.Tensor  # [T] long, -1 where no loss is taken (filler)
    cu_seqlens: torch.Tensor  # [max_num_docs + 1] int32: 0, segment ends..., then T repeated
    position_ids: torch.Tensor  # [T] long, 0 at every segment start
    max_seqlen: int  # data.max_seqlen, the same every batch


class PackedLoader:
    def __init__(
        self,
        prepared: Prepared,
        cfg,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        device: torch.device | None = None,
        infinite: bool = True,
    ):
        check_config(cfg)
        if split not in prepared.shards:
            raise DataError(f"split={split!r} must be one of {', '.join(prepared.shards)}")
        if not 0 <= rank < world_size:
            raise DataError(f"rank={rank} must be in [0, world_size={world_size})")
        self.docs = Documents.from_shards(prepared.shards[split])  # never empty: prepare() checks
        self.T, self.S, self.N = cfg.tokens_per_micro_batch, cfg.max_seqlen, cfg.max_num_docs
        self.bos, self.rank, self.world_size, self.prefetch = prepared.bos_id, rank, world_size, cfg.prefetch
        self.device = torch.device(device or "cpu")
        self.pin = self.device.type == "cuda"
        n = len(self.docs)
        if infinite:
            entropy = seed % 2**63  # SeedSequence takes non-negative ints

            def order(epoch):
                return np.random.default_rng([entropy, epoch]).permutation(n)
        else:
            # One pass in a fixed shuffled order, the same for every seed and evaluation: a partial
            # pass (eval_tokens) samples the whole split, not its first files.
            fixed = np.random.default_rng(0).permutation(n)

            def order(epoch):
                return fixed

        self.packer = Packer(self.docs.length, self.T, self.S, self.N, cfg.pack_window, order, infinite)
        # Checked on load_state_dict: a state only resumes the same stream (with any number of ranks).
        self.identity = {
            "data": prepared.key,
            "split": split,
            "seed": seed,
            "infinite": infinite,
            "geometry": [self.T, self.S, self.N, cfg.pack_window],
        }
        self._snapshot = self.packer.state()  # the state after the last batch handed out
        self._thread = None
        self._reset_stats()

    def pass_buffers(self, at_most: int) -> int:
        """How many buffers one pass of this finite split packs into over all ranks, counted up to `at_most`
        (planning only, no tokens read)."""
        mine = self.packer
        packer = Packer(mine.lengths, self.T, self.S, self.N, mine.window, mine.order_of, infinite=False)
        count = 0
        while count < at_most and packer.next_plan() is not None:
            count += 1
        return count

    # ---- iteration --------------------------------------------------------------------------------

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        if self._thread is None:
            self._start()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the data loader's background thread died") from None
        if item is _END:
            self._done = True
            self._stop()
            raise StopIteration
        if isinstance(item, BaseException):
            self._stop()
            raise item
        (rows, cu_seqlens), (loss, cropped, overflow, pieces), state, epoch = item
        rows = rows.to(self.device, non_blocking=True)
        cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)
        self._totals += (1, loss, cropped, overflow, pieces)
        self._snapshot, self._epoch = state, epoch
        return Batch(rows[0], rows[1], cu_seqlens, rows[2], self.S)

    def _start(self) -> None:
        self._halt = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        shape = (self.T, self.S, self.N, self.bos)
        args = (self.packer, self.docs, shape, self.rank, self.world_size, self.pin, self._halt, self._queue)
        self._thread = threading.Thread(target=_produce, args=args, daemon=True, name="packed-loader")
        self._thread.start()

    def _stop(self) -> None:
        if self._thread is None:
            return
        self._halt.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)  # unblock a producer waiting on a full queue
            except queue.Empty:
                pass
        self._thread = None
        # The thread planned ahead of what was handed out: rewind, so a restart continues exactly.
        self.packer.load_state(self._snapshot)

    def close(self) -> None:
        self._stop()

    def __del__(self):
        if getattr(self, "_thread", None) is not None:
            self._stop()

    # ---- resume and metrics -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {**self.identity, "packer": self._snapshot}

    def load_state_dict(self, state: dict) -> None:
        for key, value in self.identity.items():
            if state.get(key) != value:
                raise DataError(
                    f"this loader state was saved with {key}={state.get(key)!r}, "
                    f"but this loader has {value!r}: "
                    "it only resumes the same data, split, seed and packing settings"
                )
        if state["packer"]["buffer"] % self.world_size:
            buffers = state["packer"]["buffer"]
            raise DataError(
                f"this loader state is {buffers} buffers into the stream, not a whole number of rounds of "
                f"world_size={self.world_size}: rank {self.rank} would take another rank's buffers"
            )
        self._stop()
        self.packer.load_state(state["packer"])
        self._snapshot = self.packer.state()
        self._reset_stats()

    def _reset_stats(self) -> None:
        self._totals = np.zeros(5)  # batches, loss tokens, cropped tokens, overflows, document pieces
        self._epoch = self.packer.progress()
        self._done = False

    def stats(self) -> dict:
        """Cumulative since creation or the last load_state_dict, over this rank's batches."""
        batches, loss, cropped, overflow, pieces = self._totals.tolist()
        tokens = max(batches * self.T, 1)
        return {
            "packing_efficiency": loss / tokens,  # share of buffer tokens that carry a loss
            "crop_share": cropped / tokens,  # share of buffer tokens placed by a crop (cut to fill a buffer)
            "overflow": overflow / max(batches, 1),  # share of buffers closed early for max_num_docs
            "docs_per_batch": pieces / max(batches, 1),  # whole or partial documents per buffer
            "epoch": self._epoch,  # fractional epochs taken in by the packer
        }


def _produce(packer: Packer, docs: Documents, shape, rank, world_size, pin, halt, out) -> None:
    """Background thread: plan every global buffer; build this rank's, queued with the state at the end of
    its round (the other ranks' buffers of the round planned too), which is the same on every rank."""
    T, S, N, bos = shape

    def put(item) -> None:
        while not halt.is_set():
            try:
                out.put(item, timeout=0.05)
                return
            except queue.Full:
                pass

    try:
        while not halt.is_set():
            plan = packer.next_plan()
            if plan is None:
                put(_END)
                return
            if (packer.buffer - 1) % world_size != rank:
                continue
            rows, cu_seqlens = fill(plan, docs, T, S, N, bos)
            host = torch.from_numpy(rows), torch.from_numpy(cu_seqlens)
            if pin:
                host = host[0].pin_memory(), host[1].pin_memory()
            stats = (T - plan.filler, plan.cropped, plan.overflow, len(plan.pieces))
            while packer.buffer % world_size and packer.next_plan() is not None:
                pass
            put((host, stats, packer.state(), packer.progress()))
    except BaseException as err:  # handed to the caller's next()
        put(err)
