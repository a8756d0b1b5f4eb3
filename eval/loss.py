"""Validation loss and bits per byte.

bits per byte = total loss in nats / (ln 2 * total UTF-8 bytes of the predicted tokens). It does not
depend on the tokenizer, so runs with different vocabularies compare. As in nanochat, targets that
decode to no bytes (the <|bos|> end-of-document target) count in neither sum.
"""

import math

import torch

from run.dist import DistInfo, any_rank, mean_over_ranks


def token_bytes(tokenizer, vocab_size: int) -> torch.Tensor:
    """UTF-8 length of every token id; 0 for special tokens."""
    special = set(tokenizer.special_tokens_set)
    lengths = []
    for i in range(vocab_size):
        piece = tokenizer.decode_single_token_bytes(i)
        lengths.append(0 if piece.decode("utf-8", "ignore") in special else len(piece))
    return torch.tensor(lengths, dtype=torch.int64)


@torch.no_grad()
def evaluate(token_losses, batches, byte_lengths: torch.Tensor, max_tokens: int, info: DistInfo) -> dict:
    """Mean loss per predicted token and bits per byte over up to `max_tokens` buffer tokens per rank, every
    rank evaluating as many buffers.

    `token_losses` is the model's (possibly compiled) per-position loss function.
    """
    nats = torch.zeros((), dtype=torch.float64, device=info.device)
    n_tokens = torch.zeros((), dtype=torch.float64, device=info.device)
    n_bytes = torch.zeros((), dtype=torch.float64, device=info.device)
    byte_lengths = byte_lengths.to(info.device)
    batches, seen = iter(batches), 0
    while True:
        batch = next(batches, None) if seen < max_tokens else None
        # The held-out pass can run out on one rank a buffer before another. Every rank stops at the first
        # buffer some rank lacks: under fsdp each forward gathers weights from all ranks, so an extra
        # forward on one rank would wait forever.
        if any_rank(batch is None, info):
            break
        losses = token_losses(
            batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen, batch.targets
        )
        counted = byte_lengths[batch.targets.clamp_min(0)] * (batch.targets >= 0)
        nats += (losses * (counted > 0)).sum()
        n_tokens += (counted > 0).sum()
        n_bytes += counted.sum()
        seen += batch.input_ids.numel()
    totals = mean_over_ranks(torch.stack([nats, n_tokens, n_bytes]), info)
    nats, n_tokens, n_bytes = totals.tolist()
    if n_tokens == 0:
        raise ValueError("the validation split produced no tokens: raise data.val_fraction or use more data")
    return {"val_loss": nats / n_tokens, "val_bpb": nats / (math.log(2) * n_bytes)}
