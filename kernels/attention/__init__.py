"""Varlen FlashAttention over a packed token buffer: Triton kernels, their Hopper (Gluon) passes, and the
pure-PyTorch references.

Public surface:
- `flash_attn_varlen(q, k, v, cu_seqlens, max_seqlen, causal, window_size, plan=...)`: attention of each
  document to itself, as flash-attn's varlen call; a PyTorch custom op with autograd that compiles with
  fullgraph=True.
- `flash_attn_plan(cu_seqlens, num_tokens, head_dim, window_size, max_seqlen)`: the tile tables of every
  launch, made once per batch and shared by all layers over the same documents.
- `attention_reference` (a loop over documents; the ground truth of the tests) and `attention_masked`
  (one dense mask; the CPU backend).

The modules behind them are internal: op.py (the custom ops), plan.py (tile tables and plans), block_sizes.py
(block sizes), tiles.py, forward.py and backward.py (the Triton passes), hopper*.py (the Gluon passes).
`flash_attn_varlen` and `flash_attn_plan` are imported on first use, so that the references (the CPU path)
work where Triton is not installed.
"""

from kernels.attention.reference import attention_masked, attention_reference

__all__ = ["flash_attn_varlen", "flash_attn_plan", "attention_masked", "attention_reference"]


def __getattr__(name: str):
    if name in ("flash_attn_varlen", "flash_attn_plan"):
        from kernels.attention import op

        return getattr(op, name)
    raise AttributeError(f"module 'kernels.attention' has no attribute {name!r}")
