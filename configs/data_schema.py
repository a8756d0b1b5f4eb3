"""Schema of the data pipeline's knobs (the `data` config group). Checks live in data/config.py."""

from dataclasses import dataclass


@dataclass
class DataConfig:
    # "stdlib" (embedded default), a Hub dataset name, hf://datasets/... files, or local parquet/jsonl/txt
    # files (file, folder, glob); jsonl/json may be .gz or .zst.
    source: str = "stdlib"
    text_column: str = "text"  # column holding the document text (txt files: always "text")
    hub_config: str | None = None  # Hub sources: the dataset's config (subset) name
    hub_split: str = "train"  # Hub sources: the split that is streamed
    hub_revision: str | None = None  # Hub sources: pin a commit so the cache key names fixed content
    max_docs: int | None = None  # cap on (non-empty) documents read from the source, for quick experiments
    val_fraction: float = 0.02  # share of documents (by hash of their id) held out for validation
    # "bpe" trains a byte-level BPE with rustbpe; anything else names a tiktoken encoding (e.g. cl100k_base).
    tokenizer: str = "bpe"
    vocab_size: int = 4096  # bpe: total vocabulary, <|bos|> included
    tokenizer_max_chars: int = 100_000_000  # bpe: characters of training-split text fed to the trainer
    cache_dir: str = "~/.cache/varlen-gpt"  # tokenizers and token shards live under here
    num_workers: int = 0  # tokenizer processes for prepare; 0 = one per CPU the process may use
    shard_tokens: int = 100_000_000  # tokens per shard file (a shard closes at the first batch past this)
    verify: bool = True  # rank 0 re-hashes every shard against the manifest at start (sizes: always checked)
    # Packing: one buffer of T tokens per micro-step, cut into at most max_num_docs attention segments.
    tokens_per_micro_batch: int = 2048  # T
    max_seqlen: int = 512  # longest segment; longer documents become consecutive segments
    max_num_docs: int = 32  # segments per buffer (cu_seqlens has max_num_docs + 1 entries)
    pack_window: int = 64  # pending documents the best-fit packer chooses from
    prefetch: int = 4  # batches built ahead by the background thread
