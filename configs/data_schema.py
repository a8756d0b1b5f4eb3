"""Schema of the data pipeline's knobs (the `data` config group)."""

from dataclasses import dataclass


@dataclass
class DataConfig:
    # "stdlib" (embedded default), a Hub dataset name, or local parquet/jsonl/txt files (path or glob).
    source: str = "stdlib"
    text_column: str = "text"
    hub_config: str | None = None
    hub_split: str = "train"
    max_docs: int | None = None  # cap on documents read from the source (quick experiments)
    val_fraction: float = 0.02  # share of documents (by hash of their id) held out for validation
    # "bpe" trains a byte-level BPE with rustbpe; anything else names a tiktoken encoding.
    tokenizer: str = "bpe"
    vocab_size: int = 4096
    tokenizer_max_chars: int = 100_000_000  # characters of training text fed to the BPE trainer
    cache_dir: str = "~/.cache/varlen-gpt"  # tokenizers and token shards live under here
    num_workers: int = 0  # tokenizer processes for prepare_data; 0 = one per CPU
    shard_tokens: int = 100_000_000  # tokens per shard file
    # Packing: one buffer of T tokens per micro-step, at most max_num_docs segments in it.
    tokens_per_micro_batch: int = 2048
    max_seqlen: int = 512
    max_num_docs: int = 32
    pack_window: int = 64  # pending documents the best-fit packer chooses from
    prefetch: int = 4  # batches built ahead by the background thread
