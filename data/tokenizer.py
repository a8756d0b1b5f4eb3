"""Tokenizers: a byte-level BPE trained with rustbpe, or a named tiktoken encoding, both wrapped as a
tiktoken.Encoding with a <|bos|> special token (the id right after the base vocabulary) that starts
every document. Saved as one canonical JSON file next to the shards, so loading needs no network.
"""

import base64
import hashlib
import json
from collections.abc import Iterable

import tiktoken

from data.config import DataError

BOS = "<|bos|>"
# GPT-4's split pattern (cl100k_base): contractions, letters, 1-3 digits, punctuation runs, whitespace.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)


def train_bpe(texts: Iterable[str], vocab_size: int) -> tiktoken.Encoding:
    """Train on `texts`: vocab_size ids, <|bos|> included, unless the text runs out of pairs to merge."""
    import rustbpe  # only needed to train: loading prepared data works without it

    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), vocab_size - 1, pattern=SPLIT_PATTERN)
    ranks = {bytes(piece): rank for piece, rank in trainer.get_mergeable_ranks()}
    return tiktoken.Encoding(
        "bpe", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={BOS: len(ranks)}
    )


def named_encoding(name: str) -> tiktoken.Encoding:
    """A tiktoken encoding by name, plus <|bos|>. Its file is downloaded on first use, then cached."""
    try:
        base = tiktoken.get_encoding(name)
    except ValueError as err:
        raise DataError(
            f"data.tokenizer={name!r} is neither 'bpe' nor a tiktoken encoding "
            f"({', '.join(tiktoken.list_encoding_names())})"
        ) from err
    except Exception as err:
        raise DataError(
            f"data.tokenizer={name!r}: tiktoken cannot load this encoding's file "
            f"({type(err).__name__}: {err}). "
            "It is downloaded on first use and kept in $TIKTOKEN_CACHE_DIR (default: <tmp>/data-gym-cache); "
            "offline, copy the cached file there from a machine with a network, or use data.tokenizer=bpe."
        ) from err
    special = {**base._special_tokens, BOS: base.n_vocab}
    return tiktoken.Encoding(
        name, pat_str=base._pat_str, mergeable_ranks=base._mergeable_ranks, special_tokens=special
    )


def to_json(enc: tiktoken.Encoding) -> bytes:
    """Canonical bytes of an encoding: the same tokenizer always gives the same file (and fingerprint)."""
    ranks = sorted(enc._mergeable_ranks.items(), key=lambda item: item[1])
    doc = {
        "name": enc.name,
        "pattern": enc._pat_str,
        "special_tokens": dict(sorted(enc._special_tokens.items())),
        "mergeable_ranks": [[base64.b64encode(piece).decode(), rank] for piece, rank in ranks],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def from_json(raw: bytes) -> tiktoken.Encoding:
    doc = json.loads(raw)
    ranks = {base64.b64decode(piece): rank for piece, rank in doc["mergeable_ranks"]}
    return tiktoken.Encoding(
        doc["name"], pat_str=doc["pattern"], mergeable_ranks=ranks, special_tokens=doc["special_tokens"]
    )


def fingerprint(raw: bytes, enc: tiktoken.Encoding) -> str:
    """Stable id of a tokenizer file: name, vocabulary size and a hash of its canonical bytes."""
    return f"{enc.name}-{enc.n_vocab}-{hashlib.sha256(raw).hexdigest()[:12]}"
