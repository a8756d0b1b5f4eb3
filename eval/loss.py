"""Validation loss and bits per byte.

bits per byte = total loss in nats / (ln 2 * total UTF-8 bytes of the predicted tokens). It does not
depend on the tokenizer, so runs with different vocabularies compare. As in nanochat, targets that
decode to no bytes (the <|bos|> end-of-document target) count in neither sum.
"""

import itertools
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
    """Mean loss per predicted token and bits per byte over the first buffers of the held-out pass that hold
    `max_tokens` buffer tokens (whole buffers, rounded up; the whole pass if it is shorter), over all ranks.

    `batches` is this rank's share of the pass: global buffers rank, rank + world_size, ... (data/loader.py).
    So the buffers counted, and the result up to float rounding, are the same for any number of ranks.
    `token_losses` is the model's (possibly compiled) per-position loss function.
    """
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)  # nats, predicted tokens, bytes
    byte_lengths = byte_lengths.to(info.device)
    batches, last, limit = iter(batches), None, None
    for first in itertools.count(0, info.world_size):  # the global index of this round's rank-0 buffer
        if limit is not None and first >= limit:
            break
        batch = next(batches, None)
        # Under fsdp every forward gathers weights from all ranks, so every rank runs one in each round
        # while any rank has a buffer left: a rank whose pass has ended repeats its last buffer, uncounted.
        if not any_rank(batch is not None, info):
            break
        if last is None and any_rank(batch is None, info):
            raise ValueError(
                f"the validation split packs into fewer buffers than the {info.world_size} ranks: "
                "raise data.val_fraction or use more data"
            )
        if limit is None:
            limit = max(1, math.ceil(max_tokens / batch.input_ids.numel()))
        counts = batch is not None and first + info.rank < limit
        batch = batch if batch is not None else last
        losses = token_losses(
            batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.max_seqlen, batch.targets
        )
        if counts:
            n_bytes = byte_lengths[batch.targets.clamp_min(0)] * (batch.targets >= 0)
            predicted = n_bytes > 0
            sums += torch.stack(
                [(losses * predicted).sum().double(), predicted.sum().double(), n_bytes.sum().double()]
            )
        last = batch
    nats, n_tokens, n_bytes = mean_over_ranks(sums, info).tolist()
    if n_tokens == 0:
        raise ValueError("the validation split produced no tokens: raise data.val_fraction or use more data")
    return {"val_loss": nats / n_tokens, "val_bpb": nats / (math.log(2) * n_bytes)}
