"""The training loader's state does not depend on the number of ranks: after the same number of global
rounds (one batch per rank) every rank's `state_dict()` is the same, and loading it into loaders of any
world size continues the single global stream of buffers exactly (global buffer i goes to rank
i % world_size). The reference is always an uninterrupted world_size=1 loader's stream."""

import io
import json
import random
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from data import Batch, DataError, PackedLoader, prepare
from tests.data.test_pipeline import data_config

SEED = 11
FIELDS = ("input_ids", "targets", "cu_seqlens", "position_ids")


def write_docs(path: Path, n: int = 120, seed: int = 0) -> Path:
    """Documents of 1 to ~300 words, a few longer than a buffer, so that pieces carry across buffers."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 8))) for _ in range(150)]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(rng.choice([1, 3, 10, 40, 120, 300])))
            f.write(json.dumps({"id": f"d{i}", "text": text}) + "\n")
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("resharding")
    cfg = data_config(write_docs(root / "docs.jsonl"), root / "cache")
    return cfg, prepare(cfg)


def loader(prepared, rank=0, world_size=1, seed=SEED, **cfg_overrides) -> PackedLoader:
    cfg, data = prepared
    return PackedLoader(data, replace(cfg, **cfg_overrides), rank=rank, world_size=world_size, seed=seed)


def take(it: PackedLoader, n: int) -> list[Batch]:
    return [next(it) for _ in range(n)]


def same_batch(a: Batch, b: Batch) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS) and a.max_seqlen == b.max_seqlen


def same_state(a, b) -> bool:
    """Deep equality of two states, with tensors and numpy arrays compared by value (dtype and shape too)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_state, a, b))
    return type(a) is type(b) and a == b


def saved_and_loaded(state: dict) -> dict:
    """Through torch.save / torch.load(weights_only=True), as a checkpoint's run_state.pt carries it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


@pytest.fixture(scope="module")
def per_epoch(prepared):
    """Buffers in one pass over the training split."""
    cfg, data = prepared
    one_pass = PackedLoader(data, cfg, seed=SEED, infinite=False)
    n = sum(1 for _ in one_pass)
    one_pass.close()
    assert n >= 12, "the corpus is too small for these tests"
    return n


@pytest.fixture(scope="module")
def stream(prepared, per_epoch):
    """The uninterrupted world_size=1 stream, well into the third epoch."""
    single = loader(prepared)
    out = take(single, 2 * per_epoch + 40)
    single.close()
    return out


def rounds_to(position: int, world: int) -> int:
    assert position % world == 0
    return position // world


def ranks_after(prepared, world: int, rounds: int, stream) -> list[PackedLoader]:
    """`world` loaders that each took `rounds` batches (checked against the stream on the way)."""
    loaders = [loader(prepared, rank=r, world_size=world) for r in range(world)]
    for r, it in enumerate(loaders):
        got = take(it, rounds)
        want = stream[r : world * rounds : world]
        assert len(got) == len(want) and all(map(same_batch, got, want)), (world, r)
    return loaders


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_has_the_same_state_after_the_same_rounds(prepared, per_epoch, stream, world):
    for rounds in (0, 1, 3, per_epoch // world + 1):  # the last one past an epoch boundary
        loaders = ranks_after(prepared, world, rounds, stream)
        states = [it.state_dict() for it in loaders]
        for it in loaders:
            it.close()
        for r in range(1, world):
            assert same_state(states[r], states[0]), (world, rounds, r, states[0], states[r])
        # Not a constant: the state after different rounds differs.
        if rounds:
            assert not same_state(states[0], loader(prepared, world_size=world).state_dict())


def test_state_is_the_same_after_prefetching_more_on_one_rank(prepared, stream):
    """A rank whose background thread ran further ahead still reports the state after its handed-out
    batches: the same as a rank that prefetches little."""
    fast = loader(prepared, rank=0, world_size=2, prefetch=8)
    slow = loader(prepared, rank=1, world_size=2, prefetch=1)
    take(fast, 3)
    take(slow, 3)
    time.sleep(0.2)  # let rank 0's thread fill its queue well past round 3
    a, b = fast.state_dict(), slow.state_dict()
    fast.close()
    slow.close()
    assert same_state(a, b)
    resumed = loader(prepared)
    resumed.load_state_dict(saved_and_loaded(a))
    assert all(map(same_batch, take(resumed, 4), stream[6:10]))
    resumed.close()


def positions(per_epoch: int, new_world: int, old_world: int) -> list[int]:
    """Global stream positions to resume at: early, mid-epoch and past the first epoch boundary; each a
    multiple of both world sizes (a run's position always is: steps take whole rounds)."""
    step = np.lcm(new_world, old_world)
    wanted = (step, 3 * step, per_epoch + 2, 2 * per_epoch - 1)
    return sorted({int(-(-p // step) * step) for p in wanted})


@pytest.mark.parametrize(("old_world", "new_world"), [(2, 1), (1, 2), (2, 4), (4, 2), (3, 1)])
def test_state_resumes_the_global_stream_on_another_world_size(
    prepared, per_epoch, stream, old_world, new_world
):
    for position in positions(per_epoch, new_world, old_world):
        rounds = rounds_to(position, old_world)
        before = ranks_after(prepared, old_world, rounds, stream)
        states = [saved_and_loaded(it.state_dict()) for it in before]
        for it in before:
            it.close()
        n = 6
        for r in range(new_world):
            # Any old rank's state will do (they are equal); take a different one per new rank.
            state = states[r % old_world]
            resumed = loader(prepared, rank=r, world_size=new_world)
            resumed.load_state_dict(state)
            got = take(resumed, n)
            resumed.close()
            want = [stream[position + r + new_world * j] for j in range(n)]
            for j, (a, b) in enumerate(zip(got, want, strict=True)):
                assert same_batch(a, b), (old_world, new_world, position, r, j)
        # The resumed loaders' own state goes on the same way: old -> new (old_world rounds) -> old again
        # lands on the uninterrupted stream.
        mid = [loader(prepared, rank=r, world_size=new_world) for r in range(new_world)]
        for it in mid:
            it.load_state_dict(states[0])
            take(it, old_world)
        again = [saved_and_loaded(it.state_dict()) for it in mid]
        for it in mid:
            it.close()
        assert all(same_state(s, again[0]) for s in again)
        back = loader(prepared, rank=old_world - 1, world_size=old_world)
        back.load_state_dict(again[-1])
        got = take(back, 3)
        back.close()
        start = position + old_world * new_world
        assert all(map(same_batch, got, stream[start + old_world - 1 :: old_world][:3]))


def test_resumed_state_at_an_epoch_boundary_reports_the_epoch(prepared, per_epoch, stream):
    """Resumed past an epoch boundary on another world size, the loader's stats count the epochs."""
    position = 2 * (per_epoch // 2 + 2)
    before = ranks_after(prepared, 2, position // 2, stream)
    state = before[0].state_dict()
    for it in before:
        it.close()
    resumed = loader(prepared)
    resumed.load_state_dict(state)
    take(resumed, 1)
    assert resumed.stats()["epoch"] > 1
    resumed.close()


@pytest.mark.parametrize("world", [1, 2])
def test_state_of_another_seed_is_refused_naming_the_key(prepared, stream, world):
    before = ranks_after(prepared, 2, 2, stream)
    state = before[0].state_dict()
    for it in before:
        it.close()
    other = loader(prepared, world_size=world, seed=SEED + 1)
    with pytest.raises(DataError, match="seed"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ({"pack_window": 4}, "geometry|pack_window"),
        ({"max_num_docs": 6}, "geometry|max_num_docs"),
        ({"tokens_per_micro_batch": 192, "max_seqlen": 64}, "geometry|tokens_per_micro_batch"),
    ],
)
@pytest.mark.parametrize("world", [1, 2])
def test_state_of_another_geometry_is_refused_naming_the_key(prepared, stream, world, override, names):
    before = ranks_after(prepared, 2, 2, stream)
    state = before[1].state_dict()
    for it in before:
        it.close()
    other = loader(prepared, world_size=world, **override)
    with pytest.raises(DataError, match=names):
        other.load_state_dict(state)
    # The refused state left the loader untouched: it still starts the stream of its own geometry.
    fresh = loader(prepared, world_size=world, **override)
    a, b = take(other, 2), take(fresh, 2)
    other.close()
    fresh.close()
    assert all(map(same_batch, a, b))


def test_state_of_another_split_is_refused(prepared, stream):
    cfg, data = prepared
    before = ranks_after(prepared, 2, 1, stream)
    state = before[0].state_dict()
    for it in before:
        it.close()
    val = PackedLoader(data, cfg, split="val", seed=SEED)
    with pytest.raises(DataError, match="split"):
        val.load_state_dict(state)


def test_state_between_rounds_of_the_new_world_size_is_refused(prepared, stream):
    """3 buffers into the stream cannot be continued by 2 ranks (global buffer 3 belongs to rank 1 of a
    round that rank 0 would have to skip): an error naming world_size, not a silently shifted stream."""
    single = loader(prepared)
    take(single, 3)
    state = single.state_dict()
    single.close()
    two = loader(prepared, rank=0, world_size=2)
    with pytest.raises(DataError, match="world_size"):
        two.load_state_dict(state)
    two.close()


def test_pass_buffers_counts_the_buffers_one_pass_yields(prepared):
    """Against iterating the pass to its end on one rank, and on 3 ranks (each taking every third buffer)."""
    cfg, data = prepared
    finite = dict(split="val", seed=SEED, infinite=False)
    whole = list(PackedLoader(data, cfg, **finite))
    assert len(whole) > 3
    on_ranks = [list(PackedLoader(data, cfg, rank=r, world_size=3, **finite)) for r in range(3)]
    assert sum(map(len, on_ranks)) == len(whole)
    counter = PackedLoader(data, cfg, world_size=3, **finite)
    assert counter.pass_buffers(at_most=10**6) == len(whole)
    assert counter.pass_buffers(at_most=2) == 2  # counting stops there
    assert len(list(counter)) == len(on_ranks[0])  # counting left the loader's own stream alone
