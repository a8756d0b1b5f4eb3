"""The error every bad data input raises, and the checks of the data config."""

SEQ_MULTIPLE = 64  # the attention kernel's block granularity: T and max_seqlen must be whole blocks


class DataError(ValueError):
    """A data source, file or config value that cannot work; the message names the path or key."""


def segments(length: int, max_seqlen: int) -> int:
    """Attention segments a run of `length` tokens takes when no segment may exceed max_seqlen."""
    return -(-length // max_seqlen)


def check_config(cfg) -> None:
    """Reject data knobs that cannot work, naming the key, before anything is read or built."""
    if not cfg.source:
        raise DataError(
            "data.source is empty: data=local takes it from the environment variable VARLEN_GPT_DATA "
            "(export VARLEN_GPT_DATA='corpus/*.parquet') or from the command line (data.source=...)"
        )
    T, S, N = cfg.tokens_per_micro_batch, cfg.max_seqlen, cfg.max_num_docs
    for key, value in (("tokens_per_micro_batch", T), ("max_seqlen", S)):
        if value <= 0 or value % SEQ_MULTIPLE:
            raise DataError(
                f"data.{key}={value} must be a positive multiple of {SEQ_MULTIPLE} "
                "(the attention kernel's block size)"
            )
    if S > T:
        raise DataError(f"data.max_seqlen={S} must not exceed data.tokens_per_micro_batch={T}")
    if N < 2:
        raise DataError(f"data.max_num_docs={N} must be at least 2")
    # One document may fill the buffer in ceil(T/S) segments; the next one needs one more, and a
    # buffer must always be closable with a filler segment.
    need = segments(T, S) + 1
    if N < need:
        raise DataError(
            f"data.max_num_docs={N} is too small for tokens_per_micro_batch={T} and max_seqlen={S}: "
            f"one buffer-long document takes {need - 1} segments and the next needs one more; "
            f"use at least {need}"
        )
    for key in ("pack_window", "prefetch", "shard_tokens", "tokenizer_max_chars"):
        if getattr(cfg, key) < 1:
            raise DataError(f"data.{key}={getattr(cfg, key)} must be at least 1")
    if cfg.num_workers < 0:
        raise DataError(f"data.num_workers={cfg.num_workers} must be 0 (one per usable CPU) or more")
    if cfg.max_docs is not None and cfg.max_docs < 1:
        raise DataError(f"data.max_docs={cfg.max_docs} must be at least 1 (or null for all documents)")
    if not 0 < cfg.val_fraction < 1:
        raise DataError(f"data.val_fraction={cfg.val_fraction} must be in (0, 1): every evaluation needs it")
    if cfg.tokenizer == "bpe" and cfg.vocab_size < 257:
        raise DataError(f"data.vocab_size={cfg.vocab_size} must be at least 257 (256 bytes + <|bos|>)")
