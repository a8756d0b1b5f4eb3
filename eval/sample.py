"""Sampling from a prompt, as one document, on the model's KV cache (model/gpt.py's KVCache).

The model sees at most the last max_seqlen tokens, at positions from 0: it never saw later positions. Up to
max_seqlen tokens, each new token is one decode step on the cache. Past it, every new token shifts the whole
context, so every position's keys and values change: each such step re-prefills the last max_seqlen tokens,
which computes exactly what recomputing the context does, at its cost.
"""

import codecs
from collections.abc import Callable, Iterable, Iterator

import torch

from model.gpt import KVCache


@torch.no_grad()
def generate_tokens(
    model,
    ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = 50,
    seed: int = 0,
    stop_id: int | None = None,
    cache: KVCache | bool = True,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[int]:
    """Yield up to max_new_tokens tokens sampled after `ids` (a document's beginning, BOS first), stopping
    before `stop_id`. top-k sampling at `temperature`, seeded; temperature 0 is greedy. `cache`: True for a
    new eager KVCache of the positions this needs; a KVCache to reuse (with compile=True, its compiled
    step and CUDA graph are made once for all the calls that pass it); False to recompute the whole context
    for every token (what the cache saves; for benchmarks). `agree`, where ranks generate together (under
    fsdp each forward is a collective), maps each rank's picked token to the one all ranks take, so that
    they stop at the same token even if their logits differ in the last bits. The only wait for the device
    per token is for the token picked."""
    if not ids:
        raise ValueError("generation needs at least one token to continue (BOS)")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = list(ids)
    needed = min(model.max_seqlen, len(ids) + max_new_tokens)
    kv = KVCache(model.shape, needed) if cache is True else cache or None
    if kv is not None and kv.capacity < needed:
        raise ValueError(f"the cache's {kv.capacity} positions are fewer than the {needed} this may need")
    token = None
    for step in range(max_new_tokens):
        if kv is not None and step > 0 and kv.length < model.max_seqlen:
            logits = model.decode(token, kv)
        else:
            context = torch.tensor(ids[-model.max_seqlen :], device=device)
            if kv is not None:
                logits = model.prefill(context, kv)
            else:
                n = context.numel()
                cu_seqlens = torch.tensor([0, n], dtype=torch.int32, device=device)
                logits = model(context, torch.arange(n, device=device), cu_seqlens, n)[-1]
        token = pick(logits, temperature, top_k, generator)
        if agree is not None:
            token = agree(token)
        next_id = token.item()
        if next_id == stop_id:  # end of document
            return
        ids.append(next_id)
        yield next_id


def pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator):
    """The next token [1] from logits [V], on their device: the likeliest at temperature 0, else a sample
    among the top_k."""
    if temperature == 0:
        return logits.argmax().view(1)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def generate(
    model,
    tokenizer,
    bos_id: int,
    prompt: str,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = 50,
    seed: int = 0,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> str:
    """The prompt and its continuation: up to max_new_tokens tokens, ending early at BOS."""
    ids = [bos_id] + tokenizer.encode_ordinary(prompt)
    options = {"temperature": temperature, "top_k": top_k, "seed": seed, "stop_id": bos_id, "agree": agree}
    new = list(generate_tokens(model, ids, max_new_tokens, **options))
    return tokenizer.decode(ids[1:] + new)


def stream_text(tokenizer, tokens: Iterable[int]) -> Iterator[str]:
    """The text of `tokens` piece by piece as they come, each piece whole characters: a character whose
    UTF-8 bytes span several tokens comes out with its last byte. The pieces join into tokenizer.decode's
    text (invalid bytes become U+FFFD alike)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token in tokens:
        piece = decoder.decode(tokenizer.decode_single_token_bytes(token))
        if piece:
            yield piece
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail
