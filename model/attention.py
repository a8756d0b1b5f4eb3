"""Attention backends. Every backend takes the same packed batch: q [T, H, D], k/v [T, H_kv, D] and the
document boundaries `cu_seqlens` (int32 [N + 1], trailing zero-length documents allowed).

- triton:       our varlen FlashAttention kernel (kernels/attention/); the default on CUDA.
- reference:    pure PyTorch, one dense document mask; the default on CPU (O(T^2) memory).
- flex:         FlexAttention with a document mask built from cu_seqlens.
- torch_varlen: torch.nn.attention.varlen.varlen_attn (CUDA only).
- sdpa_packed:  plain causal SDPA over fixed rows of max_seqlen tokens; documents bleed into each
                other inside a row. The pre-varlen baseline, for comparisons only.
- fa4:          FlashAttention-4 (flash-attn-4, optional; model/fa4.py) on CUDA GPUs of compute
                capability 9.0 or later: for those where our Hopper kernels do not apply (Blackwell).

A backend is used in two steps: `prepare` once per forward (work shared by all layers: our kernel's
plans, FlexAttention's block masks), then `attend` in every layer.
"""

import os

import torch
import torch.nn.functional as F

from configs.schema import ConfigError
from kernels.attention import attention_masked
from model.fa4 import check_fa4, fa4_attention

BACKENDS = ("triton", "reference", "flex", "torch_varlen", "sdpa_packed", "fa4")


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "reference"


def check_backend(name: str, device: torch.device) -> None:
    """Refuse, at start-up, a backend that cannot run on `device`."""
    if name == "fa4":
        check_fa4(device)
        return
    if device.type == "cuda" or name in ("reference", "sdpa_packed"):
        return
    if name == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        return  # Triton's CPU interpreter: slow, for tests
    raise ConfigError(
        f"attention={name} needs a CUDA device, and this run is on {device.type}: "
        "use attention=auto (reference on CPU) or attention=reference"
    )


class Attention:
    def __init__(self, name: str, windows: list[int], head_dim: int):
        if name not in BACKENDS:
            raise ConfigError(f"attention={name!r} is not one of {', '.join(BACKENDS)}")
        self.name = name
        self.windows = sorted(set(windows))  # left window sizes in use, -1 = unbounded
        self.head_dim = head_dim
        if name == "triton":
            from kernels.attention import flash_attn_plan, flash_attn_varlen

            self._flash, self._plan = flash_attn_varlen, flash_attn_plan

    def prepare(self, cu_seqlens: torch.Tensor, max_seqlen: int, num_tokens: int) -> dict:
        ctx = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
        if self.name == "triton":
            plan = self._plan
            ctx["plans"] = {
                w: plan(cu_seqlens, num_tokens, self.head_dim, window_size=(w, 0), max_seqlen=max_seqlen)
                for w in self.windows
            }
        if self.name == "flex":
            ctx["block_masks"] = {w: _document_block_mask(cu_seqlens, num_tokens, w) for w in self.windows}
        return ctx

    def attend(self, q, k, v, ctx: dict, window: int) -> torch.Tensor:
        cu, max_seqlen = ctx["cu_seqlens"], ctx["max_seqlen"]
        if self.name == "triton":
            plan = ctx["plans"][window]
            return self._flash(q, k, v, cu, max_seqlen, causal=True, window_size=(window, 0), plan=plan)
        if self.name == "reference":
            return attention_masked(q, k, v, cu, causal=True, window_size=(window, 0))
        if self.name == "flex":
            return _flex(q, k, v, ctx["block_masks"][window])
        if self.name == "torch_varlen":
            return _torch_varlen(q, k, v, cu, max_seqlen, window)
        if self.name == "fa4":
            return fa4_attention(q, k, v, cu, max_seqlen, window)
        return _sdpa_packed(q, k, v, max_seqlen, window)


def _document_block_mask(cu_seqlens: torch.Tensor, num_tokens: int, window: int):
    from torch.nn.attention.flex_attention import create_block_mask

    pos = torch.arange(num_tokens, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True)

    def document_causal(b, h, q_idx, kv_idx):
        visible = (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        if window >= 0:
            visible = visible & (q_idx - kv_idx <= window)
        return visible

    return create_block_mask(document_causal, None, None, num_tokens, num_tokens, device=cu_seqlens.device)


def _flex(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    def heads_first(x):
        return x.transpose(0, 1)[None]

    out = flex_attention(
        heads_first(q),
        heads_first(k),
        heads_first(v),
        block_mask=block_mask,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)


def _torch_varlen(q, k, v, cu_seqlens, max_seqlen, window):
    from torch.nn.attention.varlen import varlen_attn

    group = q.shape[1] // k.shape[1]
    if group > 1:  # varlen_attn in torch 2.11 has no GQA: repeat K/V (comparison backend only)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(window, 0))


def _sdpa_packed(q, k, v, max_seqlen, window):
    T, H, D = q.shape

    def rows(x):  # [T, h, D] -> [T / max_seqlen, h, max_seqlen, D]
        return x.view(T // max_seqlen, max_seqlen, x.shape[1], D).transpose(1, 2)

    mask = None
    if window >= 0:
        i = torch.arange(max_seqlen, device=q.device)
        mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= window)
    out = F.scaled_dot_product_attention(
        rows(q), rows(k), rows(v), attn_mask=mask, is_causal=mask is None, enable_gqa=k.shape[1] != H
    )
    return out.transpose(1, 2).reshape(T, H, D)
