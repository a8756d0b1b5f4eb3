"""Sampling from a prompt, as one document (no KV cache: samples are short and this keeps one path)."""

import torch


@torch.no_grad()
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
) -> str:
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([bos_id] + tokenizer.encode_ordinary(prompt), device=device)
    for _ in range(max_new_tokens):
        context = ids[-model.max_seqlen :]  # the model never saw positions past max_seqlen
        n = context.numel()
        cu_seqlens = torch.tensor([0, n], dtype=torch.int32, device=device)
        logits = model(context, torch.arange(n, device=device), cu_seqlens, n)[-1]
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / temperature, dim=-1)
        next_id = torch.multinomial(probs, 1, generator=generator)
        if next_id.item() == bos_id:  # end of document
            break
        ids = torch.cat([ids, next_id])
    return tokenizer.decode(ids[1:].tolist())
