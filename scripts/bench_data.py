"""Data pipeline throughput on one process (a benchmark, not a test).

    python scripts/bench_data.py [data overrides] [+seconds=5] [+world_size=8]

Reports: prepare_data's tokenization (a fresh build of the same source in a temporary cache: BPE
training and tokenization timed apart), the packer alone (plan + fill), and the PackedLoader end to end
(background thread, torch tensors) for rank 0 of 1 and of `world_size` ranks (each rank plans every
global buffer and fills its own). Goal: a loader well above a GPU's appetite, >= 5 M tokens/s.
"""

import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from configs.data_schema import DataConfig  # noqa: E402
from configs.schema import register_configs  # noqa: E402
from data import DataError, PackedLoader, prepare  # noqa: E402
from data.packing import Documents, Packer, fill  # noqa: E402

register_configs()


def timed(step, seconds: float) -> tuple[int, float]:
    """Call step() (which returns a token count) for about `seconds`; (tokens, elapsed)."""
    tokens, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        tokens += step()
    return tokens, elapsed


def run(d: DataConfig, seed: int, seconds: float, world_size: int) -> None:
    T, S, N = d.tokens_per_micro_batch, d.max_seqlen, d.max_num_docs
    with tempfile.TemporaryDirectory() as tmp:
        fresh = prepare(replace(d, cache_dir=tmp), build=True)
        timing, counts = fresh.manifest["seconds"], fresh.manifest["counts"]
    rate = counts["tokens"] / timing["tokenize"]
    print(f"\nprepare_data on {d.source!r}: {counts['docs']:,} documents, {counts['tokens']:,} tokens")
    if d.tokenizer == "bpe":
        print(f"  BPE training ({fresh.vocab_size} tokens): {timing['tokenizer']:.1f} s")
    print(
        f"  tokenization ({d.num_workers or 'all'} CPUs):  {timing['tokenize']:.1f} s "
        f"= {rate / 1e6:.2f} M tokens/s"
    )

    prepared = prepare(d, build=True)
    docs = Documents.from_shards(prepared.shards["train"])
    rng = np.random.default_rng(seed)
    packer = Packer(docs.length, T, S, N, d.pack_window, lambda e: rng.permutation(len(docs)), infinite=True)

    def pack() -> int:
        fill(packer.next_plan(), docs, T, S, N, prepared.bos_id)
        return T

    results = [("packer (plan + fill, no thread)", *timed(pack, seconds))]
    for world in sorted({1, world_size}):
        loader = PackedLoader(prepared, d, world_size=world, seed=seed)
        next(loader)  # thread start-up is not throughput
        tokens, elapsed = timed(lambda loader=loader: next(loader).input_ids.numel(), seconds)
        results.append((f"PackedLoader, rank 0 of {world}", tokens, elapsed))
        stats = loader.stats()
        loader.close()
    print(f"\nloading T={T}, max_seqlen={S}, max_num_docs={N}, window={d.pack_window}:")
    for name, tokens, elapsed in results:
        print(f"  {name:<34} {tokens / elapsed / 1e6:7.2f} M tokens/s")
    print(
        f"  packing efficiency {stats['packing_efficiency']:.3f}, crop share {stats['crop_share']:.3f}, "
        f"overflow {stats['overflow']:.4f}, {stats['docs_per_batch']:.2f} documents per batch"
    )


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg) -> None:
    d = DataConfig(**OmegaConf.to_container(cfg.data, resolve=True))
    try:
        run(d, cfg.seed, float(cfg.get("seconds", 5)), int(cfg.get("world_size", 8)))
    except DataError as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
