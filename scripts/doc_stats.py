"""Documents per buffer for a prepared shard set, and the max_num_docs to use for a given T; with `+ranks=N`,
how evenly N ranks share the attention work of each step.

    python scripts/doc_stats.py data.tokens_per_micro_batch=8192 data.max_seqlen=2048 [+buffers=20000] \
        [+ranks=2 [+steps=30] model=d12 total_batch_tokens=524288]

Packs (a sample of) the train split as training would, with no limit on segments, and prints how many
attention segments (documents, splits of documents longer than max_seqlen, filler) each buffer needed.
A max_num_docs below a buffer's need closes that buffer early (overflow): the rest becomes filler.

With `+ranks=N`, loads the first `+steps` steps of each of N ranks as training does (each rank's
micro-batches of `total_batch_tokens`) and prints the in-document attention FLOPs of each rank's share of a
step for the configured model, and their spread across ranks: every micro-batch holds as many tokens, but
attention's work grows with the square of the document lengths, and a rank with less of it waits for the
others at the gradient all-reduce.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from configs.schema import ConfigError, register_configs  # noqa: E402
from data import DataError, PackedLoader, prepare  # noqa: E402
from data.config import segments  # noqa: E402
from data.packing import Documents, Packer  # noqa: E402
from eval.metrics import attention_flops  # noqa: E402
from model.gpt import GPTShape, layer_windows  # noqa: E402
from run.dist import DistInfo  # noqa: E402
from run.preflight import check_config  # noqa: E402

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


def rank_balance(cfg, ranks: int, steps: int) -> None:
    d, m = cfg.data, cfg.model
    accum = cfg.total_batch_tokens // (d.tokens_per_micro_batch * ranks)
    prepared = prepare(d, build=True)
    shape = GPTShape.from_config(m, prepared.vocab_size)
    windows = layer_windows(m.window_pattern, m.short_window, shape.n_layer)
    work = np.zeros((steps, ranks))
    for rank in range(ranks):
        loader = PackedLoader(prepared, d, "train", rank=rank, world_size=ranks, seed=cfg.seed)
        batches = iter(loader)
        for step in range(steps):
            for _ in range(accum):
                cu = next(batches).cu_seqlens
                work[step, rank] += float(attention_flops(cu, windows, shape.n_head, shape.head_dim))
        loader.close()
    spread = work.max(axis=1) - work.min(axis=1)
    print(
        f"\nattention work per rank and step, {ranks} ranks x {accum} micro-batches, {steps} steps, "
        f"{shape.n_layer} layers x {shape.n_head} heads x {shape.head_dim}: "
        f"mean {work.mean() / 1e12:.4g} TFLOP"
    )
    print(
        f"spread between ranks (most - least) per step: mean {spread.mean() / 1e12:.4g} TFLOP "
        f"({spread.mean() / work.mean():.1%} of a rank's), max {spread.max() / 1e12:.4g} TFLOP"
    )


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg) -> None:
    try:
        ranks = int(cfg.get("ranks", 0))
        if ranks:  # the run's own checks (total_batch_tokens against the ranks), before any work
            check_config(cfg, DistInfo(rank=0, local_rank=0, world_size=ranks, device=torch.device("cpu")))
        main_stats(cfg, int(cfg.get("buffers", 20000)))
        if ranks:
            torch.set_num_threads(1)  # small tensors: threads cost more than they give
            rank_balance(cfg, ranks, int(cfg.get("steps", 30)))
    except (DataError, ConfigError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
