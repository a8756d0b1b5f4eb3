"""Documents per buffer for a prepared shard set, and the max_num_docs to use for a given T.

    python scripts/doc_stats.py data.tokens_per_micro_batch=8192 data.max_seqlen=2048 [+buffers=20000]

Packs (a sample of) the train split as training would, with no limit on segments, and prints how many
attention segments (documents, splits of documents longer than max_seqlen, filler) each buffer needed.
A max_num_docs below a buffer's need closes that buffer early (overflow): the rest becomes filler.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
import numpy as np  # noqa: E402

from configs.schema import register_configs  # noqa: E402
from data import DataError, prepare  # noqa: E402
from data.config import segments  # noqa: E402
from data.packing import Documents, Packer  # noqa: E402

register_configs()
TARGET_OVERFLOW = 0.001  # recommend the smallest max_num_docs that overflows at most this share of buffers


def main_stats(cfg, max_buffers: int) -> None:
    d = cfg.data
    T, S = d.tokens_per_micro_batch, d.max_seqlen
    prepared = prepare(d, build=True)
    docs = Documents.from_shards(prepared.shards["train"])
    lengths = docs.length
    print(f"\n{len(lengths):,} train documents, {int(lengths.sum()):,} tokens (bos included)")
    print("document length percentiles (tokens):")
    for q in (10, 50, 90, 99, 100):
        print(f"  p{q:<3} {int(np.percentile(lengths, q)):>10,}")
    print(
        f"  longer than max_seqlen={S}: {np.mean(lengths > S):.1%}; "
        f"longer than T={T}: {np.mean(lengths > T):.1%}"
    )

    rng = np.random.default_rng(cfg.seed)
    packer = Packer(
        lengths, T, S, T + 1, d.pack_window, lambda e: rng.permutation(len(lengths)), infinite=False
    )
    needed, pieces = [], []
    while len(needed) < max_buffers and (plan := packer.next_plan()) is not None:
        needed.append(sum(segments(b - a, S) for _, a, b in plan.pieces) + segments(plan.filler, S))
        pieces.append(len(plan.pieces))
    needed, pieces = np.array(needed), np.array(pieces)
    print(f"\npacked {len(needed):,} buffers of T={T} (max_seqlen={S}, window={d.pack_window})")
    p50, p90, p99 = np.percentile(pieces, [50, 90, 99])
    print(
        f"documents (whole or partial) per buffer: mean {pieces.mean():.1f}, p50 {p50:.0f}, p90 {p90:.0f}, "
        f"p99 {p99:.0f}, max {pieces.max()}"
    )
    print("segments per buffer (documents + splits + filler):")
    counts = np.bincount(needed)
    scale = 50 / counts.max()
    for n in np.nonzero(counts)[0]:
        print(f"  {n:>5} {counts[n]:>8,} {'#' * max(1, round(counts[n] * scale))}")

    floor = segments(T, S) + 1  # data/config.py's lower bound
    print("\nmax_num_docs -> share of buffers that would overflow (close early with filler):")
    candidates = sorted({floor, d.max_num_docs, *np.percentile(needed, [50, 90, 99, 99.9, 100]).astype(int)})
    for n in candidates:
        if n >= floor:
            mark = "  <- current" if n == d.max_num_docs else ""
            print(f"  {n:>5}  {np.mean(needed > n):7.2%}{mark}")
    best = next(n for n in range(floor, int(needed.max()) + 2) if np.mean(needed > n) <= TARGET_OVERFLOW)
    best = -(-best // 8) * 8  # a round number: spare segments cost almost nothing (zero-length documents)
    print(
        f"\nrecommended: data.max_num_docs={max(best, floor)} for T={T}, max_seqlen={S} "
        f"(at most {TARGET_OVERFLOW:.1%} of buffers overflow)"
    )


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg) -> None:
    try:
        main_stats(cfg, int(cfg.get("buffers", 20000)))
    except DataError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
