"""Pure-PyTorch references for varlen attention, in any dtype.

`attention_reference` loops over documents and is the ground truth for tests (run it in float64).
`attention_masked` computes the same function with one dense document/causal/window mask, without
host synchronisation, so it compiles with fullgraph=True; it is the CPU backend of the model and
costs O(T^2) memory, so it is meant for small buffers.
"""

import math

import torch


def _window_mask(n_q: int, n_k: int, causal: bool, window_size: tuple[int, int], device) -> torch.Tensor:
    """Which keys j each query i may see, for query and key positions 0..n-1 of one document."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_k, device=device)[None, :]
    left, right = window_size
    if causal:
        right = 0
    ok = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-document softmax attention. q [T, H, D], k/v [T, H_kv, D] -> (out [T, H, D], lse [H, T]).

    Tokens past cu_seqlens[-1] and query rows with no visible key get out = 0 and lse = -inf.
    """
    T, H, D = q.shape
    group = H // k.shape[1]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros_like(q)
    lse = torch.full(
        (H, T), -math.inf, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype, device=q.device
    )
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        qd = q[start:end].transpose(0, 1)  # [H, L, D]
        kd = k[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
        vd = v[start:end].transpose(0, 1).repeat_interleave(group, dim=0)
        scores = (qd @ kd.transpose(1, 2)) * scale
        visible = _window_mask(end - start, end - start, causal, window_size, q.device)
        scores = scores.masked_fill(~visible, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is visible
        probs = torch.exp(scores - row_lse[..., None].clamp_min(torch.finfo(scores.dtype).min))
        probs = probs.masked_fill(~visible, 0.0)
        out[start:end] = (probs @ vd).transpose(0, 1).to(q.dtype)
        lse[:, start:end] = row_lse.to(lse.dtype)
    return out, lse


def attention_masked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Same output as attention_reference, through one dense [T, T] mask (no host sync)."""
    T, H, D = q.shape
    pos = torch.arange(T, device=q.device)
    # Document of each token: how many boundaries lie at or before it. Tokens past the last
    # boundary form a document of their own that nobody attends from or to (masked below).
    doc = torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True)
    inside = pos < cu_seqlens[-1]
    visible = (doc[:, None] == doc[None, :]) & inside[:, None] & inside[None, :]
    visible &= _window_mask(T, T, causal, window_size, q.device)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=visible,
        scale=softmax_scale,
        enable_gqa=k.shape[1] != H,
    )[0].transpose(0, 1)
    # SDPA gives NaN on fully masked rows; such rows have nothing to attend to and get 0.
    return torch.where(visible.any(dim=1)[:, None, None], out, 0.0).to(q.dtype)
