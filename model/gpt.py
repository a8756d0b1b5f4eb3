"""The GPT: token embedding, pre-norm blocks of RoPE attention (QK-norm, optional GQA, per-layer window)
and a ReLU^2 MLP, an untied output head with logit soft-capping. No biases; RMSNorm has no weights.

It runs on one packed buffer of T tokens (several documents one after another) described by the
batch contract of data/: input_ids [T], position_ids [T], cu_seqlens [N + 1], max_seqlen.

Generation runs on a KVCache: `prefill` runs a prompt as one document through the attention backend and
keeps every layer's keys and values; `decode` then feeds one token at a time, attending to them.

Init (nanochat's): embedding ~ N(0, 1); q/k/v and MLP input matrices ~ U(-a, a) with
a = sqrt(3 / width), i.e. std 1/sqrt(width); both output projections of every block start at zero, so
each block starts as the identity; the head ~ N(0, 0.001) so the first logits are near uniform.
"""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from configs.schema import ConfigError
from kernels.fused import RMS_EPS
from kernels.fused.numerics import E5M2
from model.attention import Attention
from model.fp8 import ChunkedLinear, linear


@dataclass(frozen=True)
class GPTShape:
    """Everything derived from the config that fixes the parameter shapes (checked on resume)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int

    @classmethod
    def from_config(cls, cfg, vocab_size: int) -> "GPTShape":
        if cfg.depth < 1:
            raise ConfigError(f"model.depth={cfg.depth} must be at least 1")
        if cfg.head_dim % 16 or cfg.head_dim < 16:
            raise ConfigError(f"model.head_dim={cfg.head_dim} must be a positive multiple of 16")
        n_embd = math.ceil(cfg.aspect_ratio * cfg.depth / cfg.head_dim) * cfg.head_dim
        n_head = n_embd // cfg.head_dim
        n_kv_head = cfg.n_kv_heads or n_head
        if n_head % n_kv_head:
            raise ConfigError(f"model.n_kv_heads={n_kv_head} must divide the number of heads ({n_head})")
        # A multiple of 64 keeps the head's matmul on fast tensor-core shapes.
        padded = math.ceil(vocab_size / 64) * 64
        return cls(cfg.depth, n_embd, n_head, n_kv_head, cfg.head_dim, vocab_size, padded)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """In x's dtype, reducing in fp32 inside the kernel. Autocast is off here: from torch 2.12 it casts
    rms_norm's input to fp32, so a bf16 x would come out fp32. eps is fp32's for every dtype: F.rms_norm's
    default follows x's dtype, 2^-7 for bf16."""
    with torch.autocast(x.device.type, enabled=False):
        return F.rms_norm(x, (x.shape[-1],), eps=RMS_EPS)


def rotary_tables(max_seqlen: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seqlen, head_dim / 2] of every position a segment can have."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(max_seqlen, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of x's last dim, in x's dtype (as nanochat): the compiled kernel still works
    in fp32 inside, while an fp32 round trip here left the backward with fp32 copies of q and k's
    gradients and a separate cast kernel each."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def training_fp8(mode: str) -> str:
    """The FP8 mode in effect: `mode` while autograd records (training), "none" otherwise. FP8 is a training
    recipe; evaluation, sampling and generation run the bf16 products, as nanochat evaluates its FP8 runs,
    so that validation measures the weights the recipe trained rather than FP8 inference. Each compiled
    function runs in one grad mode (dynamo guards on it), so this adds no recompile."""
    return mode if torch.is_grad_enabled() else "none"


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: GPTShape, window: int, fused_rope_norm: bool, fused_residual: bool, fp8: str):
        super().__init__()
        self.shape, self.window, self.fp8_mode = shape, window, fp8
        self.fused_rope_norm, self.fused_residual = fused_rope_norm, fused_residual
        d, hd = shape.n_embd, shape.head_dim
        self.c_q = nn.Linear(d, shape.n_head * hd, bias=False)
        self.c_k = nn.Linear(d, shape.n_kv_head * hd, bias=False)
        self.c_v = nn.Linear(d, shape.n_kv_head * hd, bias=False)
        self.c_proj = nn.Linear(shape.n_head * hd, d, bias=False)

    @property
    def fp8(self) -> str:
        return training_fp8(self.fp8_mode)

    def forward(self, x, residual, rotary, attention: Attention, ctx: dict):
        """residual + the attention's output projected, for x = rms_norm(residual)."""
        T, s = x.shape[0], self.shape
        if self.fused_rope_norm and hopper_kernels_run_on(x, s.head_dim):
            from kernels.fused import qkv_rope_norm, qkv_rope_norm_fp8

            op = qkv_rope_norm_fp8 if self.fp8 == "tensorwise" and fp8_kernels_run_on(x) else qkv_rope_norm
            weights = self.c_q.weight, self.c_k.weight, self.c_v.weight
            q, k, v = op(x, *weights, rotary[0][:, 0], rotary[1][:, 0])
            q = q.view(T, s.n_head, s.head_dim)
            k, v = k.view(T, s.n_kv_head, s.head_dim), v.view(T, s.n_kv_head, s.head_dim)
        else:
            q, k, v = self.plain_qkv(x, rotary)
        y = attention.attend(q, k, v, ctx, self.window).reshape(T, -1)
        if self.fused_residual and self.fp8 == "none" and hopper_kernels_run_on(residual):
            from kernels.fused import residual_linear

            return residual_linear(residual, y, self.c_proj.weight)
        if self.fused_residual and self.fp8 == "tensorwise" and fp8_kernels_run_on(residual):
            from kernels.fused import residual_linear_fp8

            return residual_linear_fp8(residual, y, self.c_proj.weight)
        return residual + linear(y, self.c_proj.weight, self.fp8)

    def plain_qkv(self, x, rotary):
        """q [T, H, D], k and v [T, H_kv, D] of x [T, C] in PyTorch products, RoPE and QK-norm."""
        T, s = x.shape[0], self.shape
        q = linear(x, self.c_q.weight, self.fp8).view(T, s.n_head, s.head_dim)
        k = linear(x, self.c_k.weight, self.fp8).view(T, s.n_kv_head, s.head_dim)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        q, k = rms_norm(q), rms_norm(k)  # QK-norm keeps attention logits bounded
        v = linear(x, self.c_v.weight, self.fp8).view(T, s.n_kv_head, s.head_dim)
        return q, k, v

    def decode(self, x, residual, rotary, cache: "LayerCache"):
        """forward for one new token x [1, C], whose keys and values join the cache: the plain PyTorch
        products, as the fused operators are made for many tokens."""
        q, k, v = self.plain_qkv(x, rotary)
        cache.store(k, v)
        y = cache.attend(q, self.window).reshape(1, -1)
        return residual + linear(y, self.c_proj.weight, self.fp8)


class MLP(nn.Module):
    def __init__(self, n_embd: int, fused: bool, fp8: str):
        super().__init__()
        self.fused, self.fp8_mode = fused, fp8
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    @property
    def fp8(self) -> str:
        return training_fp8(self.fp8_mode)

    def forward(self, x):
        """x + the MLP of rms_norm(x) (the fused operator never writes the normalised x out, and adds x in
        its last product's epilogue)."""
        if self.fused and self.fp8 == "none" and hopper_kernels_run_on(x):
            from kernels.fused import relu2_mlp

            return relu2_mlp(x, self.c_fc.weight, self.c_proj.weight)
        # FP8 on Hopper: the fused operator with FP8 products (row-scaled activations, tensor-scaled weights).
        if self.fused and self.fp8 == "tensorwise" and fp8_kernels_run_on(x):
            from kernels.fused import relu2_mlp_fp8

            return relu2_mlp_fp8(x, self.c_fc.weight, self.c_proj.weight)
        return self.plain(x)

    def plain(self, x):
        """forward in PyTorch products (the decode step's: the fused operator is made for many tokens)."""
        h = F.relu(linear(rms_norm(x), self.c_fc.weight, self.fp8)).square()
        return x + linear(h, self.c_proj.weight, self.fp8)


def fp8_kernels_run_on(x: torch.Tensor) -> bool:
    """Whether the FP8 operators (kernels/fused: qkv_rope_norm_fp8, relu2_mlp_fp8, residual_linear_fp8) run
    on x: the fused products' Hopper GPU and a bf16 residual stream, in which they write."""
    return hopper_kernels_run_on(x) and x.dtype == torch.bfloat16


def hopper_kernels_run_on(x: torch.Tensor, head_dim: int | None = None) -> bool:
    """Whether the fused products of kernels/fused/gemm_hopper.py run on x: a Hopper GPU and a 16-bit x
    (under autocast, the residual stream's dtype), and for the q/k product, heads of head_dim that it takes.
    Decided while tracing, from the device, dtype and shape alone: gemm_hopper.supported also reads pointers
    for their alignment, which dynamo cannot trace; the operators check that at run time and fall back to
    PyTorch."""
    if not (
        x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(x.device)[0] == 9
    ):
        return False
    if head_dim is None:
        return True
    from kernels.fused import supported_head_dim

    return supported_head_dim(head_dim)


class Block(nn.Module):
    def __init__(self, shape: GPTShape, window: int, cfg):
        super().__init__()
        fp8 = str(cfg.fp8)
        self.attn = CausalSelfAttention(
            shape, window, bool(cfg.fused_rope_norm), bool(cfg.fused_residual), fp8
        )
        self.mlp = MLP(shape.n_embd, bool(cfg.fused_mlp), fp8)

    def forward(self, x, rotary, attention, ctx, cache: "LayerCache | None" = None):
        """With a `cache` (GPT.decode), x is one new token attending to the cached keys and values; the
        decode step runs through here too, so that FSDP2's hooks on the block gather its weights."""
        if cache is not None:
            return self.mlp.plain(self.attn.decode(rms_norm(x), x, rotary, cache))
        x = self.attn(rms_norm(x), x, rotary, attention, ctx)  # x + attention
        return self.mlp(x)  # x + MLP


def layer_windows(pattern: str, short_window: int, n_layer: int) -> list[int]:
    """Left attention window of each layer (-1 = full context). The last layer always sees everything."""
    if not pattern or set(pattern) - {"S", "L"}:
        raise ConfigError(f"model.window_pattern={pattern!r} must be a string of 'S' and 'L'")
    windows = [short_window if pattern[i % len(pattern)] == "S" else -1 for i in range(n_layer)]
    windows[-1] = -1
    return windows


class KVCache:
    """Every layer's keys and values of one sequence, for generation (GPT.prefill and GPT.decode); `length`
    positions are filled, at most `capacity`. The buffers are allocated once, for the whole capacity, by the
    first prefill, in the keys' dtype (bf16 under autocast), zeroed (a masked slot must not hold a NaN, which
    a zero attention weight would still spread), and reused after a reset. A plain class: FSDP2 rebuilds the
    dataclasses among a forward's arguments, and the caller must keep its own cache.

    The decode step has fixed shapes: it attends over the whole capacity with a mask, and reads the token's
    position from a device tensor, so that nothing in it waits for the host. With `compile`, the step runs
    through torch.compile and, on CUDA, is captured once in a CUDA graph and replayed for every token (one
    launch instead of hundreds); the graph reads the weights where they are (updates in place show), and is
    captured again for another model or autocast setting. Leave it off where the blocks' hooks must run
    (FSDP2 gathers each block's weights in them)."""

    def __init__(self, shape: GPTShape, capacity: int, compile: bool = False):
        self.shape, self.capacity, self.compile, self.length = shape, capacity, compile, 0
        self.k = self.v = None  # per layer: [n_kv_head, capacity, head_dim]
        self.position = self.slots = None  # [1]: the decoded token's position; [capacity]: 0..capacity-1
        self.graph = self.graph_key = self.graph_token = self.graph_logits = None

    def reset(self) -> None:
        self.length = 0

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values [n, n_kv_head, head_dim] of the n tokens at the cache's end."""
        if self.k is None:
            s = self.shape
            size = (s.n_kv_head, self.capacity, s.head_dim)
            self.k = [k.new_zeros(size) for _ in range(s.n_layer)]
            self.v = [v.new_zeros(size) for _ in range(s.n_layer)]
            self.position = torch.zeros(1, dtype=torch.long, device=k.device)
            self.slots = torch.arange(self.capacity, device=k.device)
        start = self.length
        self.k[layer][:, start : start + k.shape[0]] = k.transpose(0, 1)
        self.v[layer][:, start : start + v.shape[0]] = v.transpose(0, 1)

    def step(self, model: "GPT", input_ids: torch.Tensor) -> torch.Tensor:
        """decode_step's logits for the token input_ids [1] at `position`: eager, compiled, or replayed."""
        args = (self.position, self.slots, self.k, self.v)
        if not self.compile:
            return decode_step(model, input_ids, *args)
        step = compiled_decode_step()
        if not input_ids.is_cuda:
            return step(model, input_ids, *args)
        key = (model, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        if self.graph is None or self.graph_key != key:
            self.capture(step, model, input_ids, key)
        self.graph_token.copy_(input_ids)
        self.graph.replay()
        return self.graph_logits.clone()  # the graph's output is overwritten by the next replay

    def capture(self, step, model: "GPT", input_ids: torch.Tensor, key: tuple) -> None:
        """Capture `step` for this token and position in a CUDA graph, after warm-up calls (the first one
        compiles) on a side stream, as capture requires. Each call writes this token's keys and values to
        its slot, which the replay then writes again alike."""
        self.graph = None  # an older graph's memory goes before the new one takes its own
        self.graph_token = input_ids.clone()
        args = (model, self.graph_token, self.position, self.slots, self.k, self.v)
        side = torch.cuda.Stream(device=input_ids.device)
        side.wait_stream(torch.cuda.current_stream(input_ids.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step(*args)
        torch.cuda.current_stream(input_ids.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.graph_logits = step(*args)
        self.graph, self.graph_key = graph, key


class LayerCache:
    """One layer's keys and values [n_kv_head, capacity, head_dim] in a decode step, which stores the new
    token's at `position` [1] and attends over every slot, masked to those the token sees."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, slots: torch.Tensor):
        self.k, self.v, self.position, self.slots = k, v, position, slots

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values [1, n_kv_head, head_dim] of the token at `position`."""
        self.k.index_copy_(1, self.position, k.transpose(0, 1))
        self.v.index_copy_(1, self.position, v.transpose(0, 1))

    def attend(self, q: torch.Tensor, window: int) -> torch.Tensor:
        """Attention [1, H, D] of the query q [1, H, D] of the token just stored over the keys it sees: all
        before it, or those at most `window` positions back. Later slots (empty, or left from an earlier
        sequence) are masked out."""
        visible = self.slots <= self.position
        if window >= 0:
            visible = visible & (self.slots >= self.position - window)
        n_kv_head, _, head_dim = self.k.shape
        # Each K/V head's group of query heads as that head's queries: GQA without repeating K and V (query
        # head h reads K/V head h // group, as the varlen kernels do).
        q = q.view(1, n_kv_head, -1, head_dim)
        y = F.scaled_dot_product_attention(q, self.k[None], self.v[None], attn_mask=visible.view(1, 1, 1, -1))
        return y.reshape(1, -1, head_dim)


def decode_step(model: "GPT", input_ids, position, slots, keys: list, values: list) -> torch.Tensor:
    """The logits [V] after the token input_ids [1] at `position` [1], which attends to the cached keys and
    values (`keys`, `values`: each layer's) and adds its own. Tensors only in and out, of the same shapes at
    every position: one compiled graph serves every step and every cache of the same size. Each block runs
    through its __call__, so that FSDP2's hooks gather its weights."""
    rotary = model.rotary_cos[position][:, None, :], model.rotary_sin[position][:, None, :]
    x = model.embed(input_ids)
    for block, k, v in zip(model.blocks, keys, values, strict=True):
        x = block(x, rotary, None, None, cache=LayerCache(k, v, position, slots))
    logits = softcap(model.lm_head(rms_norm(x)), model.logit_softcap)
    return logits[0, : model.shape.vocab_size]


@functools.cache
def compiled_decode_step():
    """decode_step compiled, one wrapper per process: fixed shapes, so one graph per cache size, dtype and
    autocast setting (models of one config share it: their parameters are the graph's inputs)."""
    return torch.compile(decode_step, fullgraph=True, dynamic=False)


class _Prefill:
    """The attention backend, storing each layer's keys and values in the cache on the way."""

    def __init__(self, attention: Attention, cache: KVCache, layer: int):
        self.attention, self.cache, self.layer = attention, cache, layer

    def attend(self, q, k, v, ctx: dict, window: int) -> torch.Tensor:
        self.cache.store(self.layer, k, v)
        return self.attention.attend(q, k, v, ctx, window)


class GPT(nn.Module):
    def __init__(self, cfg, vocab_size: int, attention: str, max_seqlen: int):
        super().__init__()
        self.shape = s = GPTShape.from_config(cfg, vocab_size)
        self.max_seqlen = max_seqlen  # the longest segment the model sees (RoPE positions 0..max_seqlen-1)
        # Plain floats and ints, not the config object: the compiled forward reads them.
        self.rope_base, self.logit_softcap = float(cfg.rope_base), float(cfg.logit_softcap)
        self.loss_chunk_tokens = int(cfg.loss_chunk_tokens)
        self.fp8_mode = str(cfg.fp8) if cfg.fp8_head else "none"  # the head's products
        windows = layer_windows(cfg.window_pattern, cfg.short_window, s.n_layer)
        self.attention = Attention(attention, windows, s.head_dim)
        self.wte = nn.Embedding(s.padded_vocab_size, s.n_embd)
        self.blocks = nn.ModuleList(Block(s, w, cfg) for w in windows)
        self.lm_head = nn.Linear(s.n_embd, s.padded_vocab_size, bias=False)
        # Precomputed once: computed inside the compiled forward, the cos/sin would be fused into (and
        # recomputed by) every layer's rotary kernel. Not saved: they follow from the config.
        cos, sin = rotary_tables(max_seqlen, s.head_dim, self.rope_base)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        nn.init.normal_(self.wte.weight, std=1.0)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        bound = math.sqrt(3.0 / self.shape.n_embd)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.uniform_(lin.weight, -bound, bound)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)

    @property
    def fp8(self) -> str:
        """The head's FP8 mode in effect (training_fp8)."""
        return training_fp8(self.fp8_mode)

    def embed(self, input_ids) -> torch.Tensor:
        """The normed embeddings, the start of the residual stream. It runs in autocast's dtype (bf16 on GPU),
        as with nanochat's bf16 embedding: half the traffic and saved activations of an fp32 stream. The
        parameters stay fp32."""
        x = rms_norm(self.wte(input_ids))
        device = input_ids.device.type
        if torch.is_autocast_enabled(device):
            x = x.to(torch.get_autocast_dtype(device))
        return x

    def hidden_states(self, input_ids, position_ids, cu_seqlens, max_seqlen: int) -> torch.Tensor:
        # [T, 1, head_dim / 2], broadcast over heads
        rotary = self.rotary_cos[position_ids][:, None, :], self.rotary_sin[position_ids][:, None, :]
        ctx = self.attention.prepare(cu_seqlens, max_seqlen, input_ids.shape[0])
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, rotary, self.attention, ctx)
        return rms_norm(x)

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen: int, targets=None):
        """Mean cross-entropy over positions with targets >= 0; or, without targets, the logits [T, V]."""
        h = self.hidden_states(input_ids, position_ids, cu_seqlens, max_seqlen)
        if targets is None:
            logits = softcap(linear(h, self.lm_head.weight, self.fp8), self.logit_softcap)
            return logits[:, : self.shape.vocab_size]
        return ChunkedCrossEntropy.apply(
            h,
            self.lm_head.weight,
            targets,
            self.logit_softcap,
            self.loss_chunk_tokens,
            self.shape.vocab_size,
            self.fp8,
        )

    @torch.no_grad()
    def token_losses(self, input_ids, position_ids, cu_seqlens, max_seqlen: int, targets) -> torch.Tensor:
        """Per-position loss in nats (0 where targets < 0), by the training loss's formula in PyTorch."""
        h = self.hidden_states(input_ids, position_ids, cu_seqlens, max_seqlen)
        w = self.lm_head.weight[: self.shape.vocab_size].to(h.dtype)
        chunk, out = self.loss_chunk_tokens, []
        for start in range(0, h.shape[0], chunk):
            hc, tc = h[start : start + chunk], targets[start : start + chunk]
            out.append(chunk_losses(hc @ w.t(), tc, self.logit_softcap)[-1])
        return torch.cat(out)

    @torch.no_grad()
    def prefill(self, input_ids, cache: KVCache) -> torch.Tensor:
        """The logits [V] of the token after input_ids [n], run as one document at positions 0..n-1 through
        the attention backend; the cache, emptied first, then holds their keys and values. A context longer
        than the model's max_seqlen is the caller's to cut (see eval/sample.py)."""
        n = input_ids.shape[0]
        if cache.shape != self.shape:
            raise ValueError(f"the cache is shaped for {cache.shape}, not this model's {self.shape}")
        if cache.capacity > self.max_seqlen:
            raise ValueError(f"a cache of {cache.capacity} positions outruns max_seqlen={self.max_seqlen}")
        if not 1 <= n <= cache.capacity:
            raise ValueError(f"a prompt of {n} tokens does not fit the cache's {cache.capacity} positions")
        cache.reset()
        rotary = self.rotary_cos[:n, None, :], self.rotary_sin[:n, None, :]
        x = self.embed(input_ids)
        cu_seqlens = torch.tensor([0, n], dtype=torch.int32, device=input_ids.device)
        ctx = self.attention.prepare(cu_seqlens, n, n)
        for i, block in enumerate(self.blocks):
            x = block(x, rotary, _Prefill(self.attention, cache, i), ctx)
        cache.length = n
        logits = softcap(self.lm_head(rms_norm(x[-1:])), self.logit_softcap)
        return logits[0, : self.shape.vocab_size]

    @torch.no_grad()
    def decode(self, input_ids, cache: KVCache) -> torch.Tensor:
        """The logits [V] of the token after input_ids [1] (on the model's device), the token at position
        cache.length, which attends to the cached keys and values and adds its own (decode_step). Nothing
        here waits for the GPU."""
        if input_ids.shape != (1,):
            raise ValueError(f"decode takes one token, not input_ids of shape {tuple(input_ids.shape)}")
        if cache.k is None:
            raise ValueError("decode continues a prefilled cache: call prefill first")
        if cache.length >= cache.capacity:
            raise ValueError(
                f"{cache.length} cached + 1 new tokens exceed the cache's {cache.capacity} positions"
            )
        cache.position.fill_(cache.length)
        logits = cache.step(self, input_ids)
        cache.length += 1
        return logits

    def matmul_params(self) -> int:
        """Parameters that take part in a matmul per token (the embedding is a lookup)."""
        return sum(p.numel() for p in self.parameters()) - self.wte.weight.numel()


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """Soft-capped logits, in fp32 at least: the softmax of a large vocabulary needs it."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return cap * torch.tanh(logits / cap) if cap > 0 else logits


def chunk_losses(logits, targets, cap: float):
    """Soft-capped logits [n, V] of n tokens, which of them are the targets [n, V], the rows' log-sum-exp
    [n] and each token's loss [n] (0 where targets < 0)."""
    capped = softcap(logits, cap)
    # Soft-capped logits lie in (-cap, cap): for cap <= 50 their exp stays far inside fp32's range, so the
    # log-sum-exp needs no pass for the row's max.
    lse = capped.exp().sum(dim=-1).log() if 0 < cap <= 50 else capped.logsumexp(dim=-1)
    # The target's logit as a masked sum over the row, which the compiler folds into the log-sum-exp's
    # pass. With a gather, inductor fuses every chunk's gather into one kernel after the last chunk, and
    # all chunks' logits stay alive until then (4.3 GB at d12).
    is_target = torch.arange(capped.shape[1], device=capped.device) == targets[:, None]
    target_logit = torch.where(is_target, capped, 0.0).sum(dim=-1)
    return capped, is_target, lse, torch.where(targets >= 0, lse - target_logit, 0.0)


def fused_chunk_loss(logits, targets, scale, cap: float, grad_dtype: torch.dtype):
    """Losses and scaled gradient of a chunk in one Triton pass (imported here: CPU runs need no Triton)."""
    from kernels.fused import softcap_cross_entropy

    return softcap_cross_entropy(logits, targets, scale, cap, grad_dtype)


@torch.library.custom_op("varlen_gpt::add_into", mutates_args=("total",))
def add_into(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part, as one step the compiler cannot merge with others. As plain additions, inductor fuses
    the loss chunks' weight gradients into one sum after the last chunk, and keeps every chunk's [V, d]
    gradient alive until then (eight of 0.1 GB in float32 at d12)."""
    total.add_(part)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Head matmul + soft-cap + cross-entropy, `chunk` tokens at a time.

    The logits of the whole buffer ([T, V]: 4.3 GB in bf16 at T=65,536, V=32,768) never exist at once: each
    chunk's gradient with respect to h and to the head weight is computed in the forward pass, right after
    its loss, and the backward only scales the stored gradients. On CUDA one Triton kernel per chunk
    computes the losses and writes the logits' gradient in h's dtype, or e5m2 under tensorwise FP8
    (kernels/fused/cross_entropy.py).
    Elsewhere the same math runs compiled from PyTorch in two passes over the logits (log-sum-exp, then the
    gradient), also without a [chunk, V] tensor in fp32.

    The head's three products (the logits, and the gradients of h and of the weight) run in `fp8`
    (model/fp8.py's ChunkedLinear), the mode in effect that GPT.fp8 gives, as the blocks' linear layers do.
    """

    @staticmethod
    def forward(ctx, h, weight, targets, cap: float, chunk: int, vocab_size: int, fp8: str):
        head = ChunkedLinear(h, weight[:vocab_size], fp8)  # padded vocabulary rows can never be predicted
        n_valid = (targets >= 0).sum().clamp_min(1)
        loss = torch.zeros((), device=h.device, dtype=torch.promote_types(h.dtype, torch.float32))
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros((vocab_size, weight.shape[1]), device=h.device, dtype=loss.dtype)
        fused = h.is_cuda and h.dtype != torch.float64  # the kernel computes in fp32
        inv_valid = 1.0 / n_valid.float()
        # Each element of a token's gradient, a softmax minus a one-hot through the soft-cap's tanh' <= 1,
        # lies within 1. Under tensorwise that bound is the gradient's e5m2 scale, so the pass that computes
        # the gradient writes it in e5m2, with no amax pass and no bf16 copy. The bound is about what an
        # amax would find: in a chunk some token gives its target a small probability. The products then
        # read only constants and the 1 / n_valid waits for the backward: a product scaled by n_valid,
        # which inductor computes in one kernel with the loss's sum over every chunk, would wait for the
        # last chunk, and every chunk's gradient with it (2.1 GB at d12).
        fp8_grad = fp8 == "tensorwise"
        top = torch.finfo(E5M2).max
        grad_dtype, grad_scale = (E5M2, torch.full_like(inv_valid, top)) if fp8_grad else (h.dtype, inv_valid)
        grad_inv = torch.full_like(inv_valid, 1.0 / top) if fp8_grad else None
        after = inv_valid if fp8_grad else torch.ones_like(inv_valid)
        for start in range(0, h.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits, tc = head.forward(rows), targets[rows]
            if fused:
                losses, grad = fused_chunk_loss(logits, tc, grad_scale, max(cap, 0.0), grad_dtype)
            else:
                capped, is_target, lse, losses = chunk_losses(logits, tc, cap)
                # d(loss)/d(capped) = softmax - onehot(target), then through the soft-cap's tanh; valid
                # rows only, over n_valid. One pointwise expression, so the compiler fuses it into one pass.
                grad = torch.exp(capped - lse[:, None]) - is_target.to(capped.dtype)
                if cap > 0:
                    grad = grad * (1.0 - (capped / cap).square())
                valid = (tc >= 0).to(grad.dtype)
                grad = (grad * (valid * top if fp8_grad else valid / n_valid)[:, None]).to(grad_dtype)
            loss = loss + losses.sum()
            grad_h[rows], grad_w_chunk = head.backward(grad, rows, grad_inv)
            add_into(grad_w, grad_w_chunk)
        grad_w = F.pad(grad_w, (0, 0, 0, weight.shape[0] - vocab_size))  # padded rows: never predicted
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype), after)
        return loss / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w, after = ctx.saved_tensors
        scale = grad_loss * after
        return grad_h * scale, grad_w * scale, None, None, None, None, None
