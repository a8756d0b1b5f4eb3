"""varlen-gpt's GPT for transformers: the math of model/gpt.py on padded [batch, length] input, one document
per row, with a KV cache so that generate() runs one token per step.

Token embedding, RMS-normed (no weights); pre-norm blocks of attention (q/k/v without bias, RoPE on the two
halves of each head, then QK RMS-norm, grouped K/V heads, causal, each layer's left window) and a ReLU^2
MLP; a final RMSNorm; an untied head whose logits are soft-capped, cap * tanh(logits / cap), in float32
(or float64 for a float64 model).
Positions count from 0 at each row's first token that the attention mask keeps, so left and right padding
both work.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_varlen_gpt import VarlenGPTConfig

# transformers renamed the cache of model inputs and outputs from `past_key_values` to `cache` (5.x); the
# model takes either and returns it under the installed version's name, which is what generate() reads.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """In x's dtype, reduced in float32 inside the kernel; autocast left out, as in model/gpt.py."""
    with torch.autocast(x.device.type, enabled=False):
        return F.rms_norm(x, (x.shape[-1],), eps=eps)


def rotary(position_ids: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [batch, length, 1, head_dim / 2] of the positions, computed in float64 like the training
    model's tables, so they round to the same float32 values."""
    inv_freq = base ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device) / head_dim
    )
    angles = position_ids.to(torch.float64)[..., None] * inv_freq
    return angles.cos().float()[:, :, None], angles.sin().float()[:, :, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: VarlenGPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.window = layer_idx, config.layer_windows[layer_idx]
        self.n_head, self.n_kv_head, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.eps = config.rms_norm_eps
        d, hd = config.hidden_size, config.head_dim
        self.c_q = nn.Linear(d, self.n_head * hd, bias=False)
        self.c_k = nn.Linear(d, self.n_kv_head * hd, bias=False)
        self.c_v = nn.Linear(d, self.n_kv_head * hd, bias=False)
        self.c_proj = nn.Linear(self.n_head * hd, d, bias=False)

    def forward(self, x, rotary_cs, visible, cache):
        B, L, _ = x.shape
        q = self.c_q(x).view(B, L, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, L, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, L, self.n_kv_head, self.head_dim)
        q, k = apply_rotary(q, *rotary_cs), apply_rotary(k, *rotary_cs)
        q, k = rms_norm(q, self.eps), rms_norm(k, self.eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, L, head_dim]
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # every earlier token's keys and values, then these
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible[self.window], enable_gqa=self.n_kv_head != self.n_head
        )
        return self.c_proj(y.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, config: VarlenGPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=False)
        self.c_proj = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: VarlenGPTConfig, layer_idx: int):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, rotary_cs, visible, cache):
        x = x + self.attn(rms_norm(x, self.eps), rotary_cs, visible, cache)
        return x + self.mlp(rms_norm(x, self.eps))


def visibility(attention_mask: torch.Tensor, past: int, length: int, windows: set[int]) -> dict:
    """Per window, which keys [batch, 1, length, past + length] each new token sees: kept by the attention
    mask, not after it, and at most `window` tokens before it. Distances are counted in the cache, where a
    row's tokens lie side by side (padding only before or after them), so they equal position distances.
    A padding query that would see nothing sees everything instead: its output is unused, and a row with
    no visible key would give NaN."""
    device = attention_mask.device
    q = torch.arange(past, past + length, device=device)[:, None]
    k = torch.arange(past + length, device=device)[None, :]
    kept = attention_mask.bool()[:, None, None, :]
    out = {}
    for window in windows:
        ok = k <= q
        if window >= 0:
            ok = ok & (k >= q - window)
        ok = ok & kept
        out[window] = ok | ~ok.any(dim=-1, keepdim=True)
    return out


class VarlenGPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = VarlenGPTConfig
    base_model_prefix = "varlen_gpt"
    _no_split_modules = ["Block"]

    def __init__(self, config: VarlenGPTConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits [batch, length (or the last logits_to_keep), vocab_size], float32 at least; with labels,
        the mean cross-entropy of predicting labels[:, 1:] (positions labelled -100 left out)."""
        cfg = self.config
        cache = cache if cache is not None else past_key_values
        use_cache = use_cache if use_cache is not None else cfg.use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        B, L = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(B, past + L, dtype=torch.long, device=input_ids.device)
        if attention_mask.shape != (B, past + L):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; expected ({B}, {past + L}): "
                "the cached tokens, then these"
            )
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -L:]
        rotary_cs = rotary(position_ids, cfg.head_dim, cfg.rope_base)
        visible = visibility(attention_mask, past, L, set(cfg.layer_windows))
        x = rms_norm(self.wte(input_ids), cfg.rms_norm_eps)
        for block in self.blocks:
            x = block(x, rotary_cs, visible, cache)
        h = rms_norm(x, cfg.rms_norm_eps)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # a large softmax needs fp32
        if cfg.logit_softcap > 0:
            logits = cfg.logit_softcap * torch.tanh(logits / cfg.logit_softcap)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})
