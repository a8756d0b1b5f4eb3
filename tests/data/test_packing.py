"""The packer as a pure function, over random document-length mixes (hypothesis).

Synthetic layout: token value = its index in one flat array, so a batch shows exactly which token of
which document sits where, and the right target of every loss position is simply its input + 1.
"""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from data.config import segments
from data.packing import Documents, Packer, fill, pack_documents

FILLER = -7  # the filler's input id in these tests (a real bos id in training)


def synthetic(lengths) -> Documents:
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens = np.arange(int(lengths.sum()) + 1, dtype=np.int64)  # + the token after the last document
    return Documents([tokens], np.zeros(len(lengths), np.int32), starts, lengths)


@st.composite
def geometry(draw):
    T = draw(st.sampled_from([128, 256]))
    S = draw(st.sampled_from([s for s in (64, 128, 256) if s <= T]))
    N = draw(st.integers(segments(T, S) + 1, segments(T, S) + 6))
    window = draw(st.integers(1, 8))
    return T, S, N, window


def length_mix(T: int):
    """Documents as the packer sees them (bos included, so >= 1): empty (bos only), length 1, tiny,
    exactly T, around T and max_seqlen, several buffers long."""
    one = st.one_of(
        st.just(1),
        st.just(2),
        st.integers(1, 6),
        st.sampled_from([T - 1, T, T + 1, 63, 64, 65, 127, 128, 129]),
        st.integers(1, 3 * T + 5),
    )
    return st.lists(one, min_size=1, max_size=60)


@st.composite
def case(draw):
    T, S, N, window = draw(geometry())
    return T, S, N, window, draw(length_mix(T))


def check_batch(rows, cu, T, S, N) -> list[tuple[int, int]]:
    """Structural invariants of one batch; returns its segments (start, end), empty ones dropped."""
    inputs, targets, positions = rows
    assert rows.shape == (3, T) and cu.shape == (N + 1,) and cu.dtype == np.int32
    assert cu[0] == 0 and cu[-1] == T and (np.diff(cu) >= 0).all()
    segs = [(int(s), int(e)) for s, e in zip(cu[:-1], cu[1:], strict=True) if e > s]
    # Padding is exact: once T is reached, every later entry is T (zero-length documents).
    reached = int(np.argmax(cu == T))
    assert (cu[reached:] == T).all() and len(segs) == reached
    for s, e in segs:
        assert e - s <= S, "a segment longer than max_seqlen"
        assert (positions[s:e] == np.arange(e - s)).all(), "position_ids restart at every segment start"
        loss = targets[s:e] >= 0
        assert loss.all() or not loss.any(), "a segment mixes document tokens and filler"
        if loss.any():
            assert (np.diff(inputs[s:e]) == 1).all(), "a segment is not one contiguous piece of one document"
            assert (targets[s:e] == inputs[s:e] + 1).all(), "targets are the next tokens"
        else:
            assert (inputs[s:e] == FILLER).all() and (targets[s:e] == -1).all()
    return segs


def check_epoch(plans, docs: Documents, order, T, S, N, window) -> dict:
    """Every token of every document exactly once, in order; pieces and splits as declared."""
    stream, pieces_seen = [], {}
    for k, plan in enumerate(plans):
        # The oldest piece opens each buffer, and an unfinished document queues at the back: one
        # document opens two buffers in a row only when nothing else is pending.
        if k and window > 1 and plan.pieces[0][0] == plans[k - 1].pieces[0][0]:
            assert {d for d, _, _ in plan.pieces} == {plan.pieces[0][0]}
        rows, cu = fill(plan, docs, T, S, N, FILLER)
        segs = check_batch(rows, cu, T, S, N)
        # Segment boundaries: piece starts, plus splits every max_seqlen inside a piece, plus filler.
        expected, pos = [], 0
        for doc, a, b in plan.pieces:
            expected += [(s, min(s + S, pos + b - a)) for s in range(pos, pos + b - a, S)]
            pos += b - a
            pieces_seen.setdefault(doc, []).append((a, b, pos == T))
        expected += [(s, min(s + S, T)) for s in range(pos, T, S)]
        assert segs == expected
        assert plan.filler == T - pos
        if plan.filler and plan is not plans[-1]:
            assert plan.overflow, "filler before the end of the epoch without an overflow"
        stream.append(rows[0][rows[1] >= 0])
    stream = np.concatenate(stream) if stream else np.zeros(0, np.int64)
    doc_of = np.searchsorted(docs.start, stream, side="right") - 1
    # Stable sort by document keeps the stream order inside each document: it must be that document's
    # tokens, ascending, and all documents together exactly once.
    assert (stream[np.argsort(doc_of, kind="stable")] == np.arange(int(docs.length.sum()))).all()
    for doc, pieces in pieces_seen.items():
        # A piece starts where the document does or where its previous piece was cut; a cut piece
        # always fills its buffer to the end (a crop, declared in the plan).
        assert pieces[0][0] == 0 and pieces[-1][1] == docs.length[doc]
        for (_, end, at_buffer_end), (start, _, _) in zip(pieces, pieces[1:], strict=False):
            assert end == start and at_buffer_end, "a document was cut where its buffer still had room"
    assert set(pieces_seen) == set(order.tolist())
    return pieces_seen


@settings(deadline=None, max_examples=1000)
@given(case())
def test_one_pass_covers_every_token_once_in_order(c):
    T, S, N, window, lengths = c
    docs = synthetic(lengths)
    plans = pack_documents(lengths, T, S, N, window)
    check_epoch(plans, docs, np.arange(len(lengths)), T, S, N, window)
    # Packing efficiency is high: only the epoch's last buffer and overflows carry filler.
    for plan in plans[:-1]:
        assert plan.overflow or plan.filler == 0
    assert sum(T - p.filler for p in plans) == sum(lengths)


@settings(deadline=None, max_examples=200)
@given(geometry(), st.integers(1, 4))
def test_many_tiny_documents_overflow_max_num_docs(g, tiny):
    T, S, N, window = g
    lengths = [tiny] * (3 * N)
    plans = pack_documents(lengths, T, S, N, max(window, N))
    check_epoch(plans, synthetic(lengths), np.arange(len(lengths)), T, S, N, max(window, N))
    # As many tiny documents as leave segments to close the buffer with filler, and not one more.
    first, placed = plans[0], len(plans[0].pieces)
    assert first.overflow and first.filler == T - tiny * placed
    assert placed + segments(first.filler, S) <= N < placed + 1 + segments(first.filler - tiny, S)


def test_document_longer_than_max_seqlen_becomes_consecutive_segments():
    T, S, N = 256, 64, 8
    plans = pack_documents([200], T, S, N, 4)
    rows, cu = fill(plans[0], synthetic([200]), T, S, N, FILLER)
    assert cu.tolist()[:6] == [0, 64, 128, 192, 200, 256]
    assert rows[2][190:202].tolist() == [62, 63, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1]


def test_oldest_opens_then_best_fit_then_crop_of_the_longest():
    # The oldest (100) opens; of 250, 5 and 300 (pending as its first 256), only the 5 fits the room of
    # 156; then nothing fits, so the longest piece is cropped to the 151 left.
    plans = pack_documents([100, 250, 5, 300], 256, 256, 8, 8)
    assert plans[0].pieces == [(0, 0, 100), (2, 0, 5), (3, 0, 151)] and plans[0].cropped == 151
    # The 250 is now the oldest; the rest of the 300 queued behind it, and is cropped again.
    assert plans[1].pieces == [(1, 0, 250), (3, 151, 157)] and plans[1].cropped == 6
    assert plans[2].pieces == [(3, 157, 300)] and plans[2].filler == 113 and not plans[2].overflow


def test_long_documents_interleave_instead_of_filling_consecutive_buffers():
    T = 256
    plans = pack_documents([10 * T, 10 * T, 10 * T] + [T // 4] * 60, T, 128, 8, 6)
    openers = [plan.pieces[0][0] for plan in plans]
    # Each long document queues its next piece at the back; short ones get their turn in between.
    assert openers[:8] == [0, 1, 2, 3, 0, 1, 2, 7]
    assert all(a != b for a, b in zip(openers, openers[1:], strict=False))


@settings(deadline=None, max_examples=300)
@given(geometry(), length_mix(128), st.integers(0, 40), st.integers(0, 2**32))
@example((128, 64, 4, 4), [1] * 6, 1, 0)  # ties in the window: the arrival order must survive a resume
def test_resume_from_state_reproduces_plans_across_epochs(g, lengths, k, seed):
    T, S, N, window = g
    lengths = np.asarray(lengths)

    def order(epoch):
        return np.random.default_rng([seed, epoch]).permutation(len(lengths))

    full = Packer(lengths, T, S, N, window, order, infinite=True)
    reference = [full.next_plan() for _ in range(k + 12)]
    first = Packer(lengths, T, S, N, window, order, infinite=True)
    for _ in range(k):
        first.next_plan()
    resumed = Packer(lengths, T, S, N, window, order, infinite=True)
    resumed.load_state(first.state())
    assert [resumed.next_plan() for _ in range(12)] == reference[k:]


@settings(deadline=None, max_examples=200)
@given(geometry(), length_mix(128), st.integers(0, 2**32))
def test_infinite_stream_covers_each_epoch_exactly_once(g, lengths, seed):
    T, S, N, window = g
    docs = synthetic(lengths)

    def order(epoch):
        return np.random.default_rng([seed, epoch]).permutation(len(lengths))

    packer = Packer(docs.length, T, S, N, window, order, infinite=True)
    epochs = {}
    while True:
        plan = packer.next_plan()
        if packer.epoch == 3:
            break
        epochs.setdefault(packer.epoch, []).append(plan)
    for epoch, plans in epochs.items():
        check_epoch(plans, docs, order(epoch), T, S, N, window)


def test_packer_refuses_no_documents():
    with pytest.raises(ValueError, match="no documents"):
        Packer(np.zeros(0, np.int64), 128, 64, 4, 4, lambda e: np.arange(0), infinite=True)
