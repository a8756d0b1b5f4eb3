"""The data pipeline: sources -> tokenizer -> token shards -> best-fit packed varlen batches.

Usage (train.py):
    prepared = prepare(cfg.data, build=True)  # tokenizer + shards, built once and cached
    loader = PackedLoader(prepared, cfg.data, split="train", rank=r, world_size=w, seed=s, device=d)
    batch = next(loader)  # Batch: input_ids, targets, cu_seqlens, position_ids, max_seqlen
"""

from data.config import SEQ_MULTIPLE, DataError
from data.loader import Batch, PackedLoader
from data.shards import Prepared, prepare

__all__ = ["SEQ_MULTIPLE", "Batch", "DataError", "PackedLoader", "Prepared", "prepare"]
