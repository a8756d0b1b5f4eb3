"""The `fa4` attention backend: FlashAttention-4 (`flash_attn.cute` of flash-attn-4, an optional dependency:
`pip install -e '.[fa4]'`), for GPUs where our Hopper kernels do not apply, such as Blackwell.

flash-attn-4's public `flash_attn_varlen_func` is an autograd.Function around CuTe kernels that dynamo
cannot trace. Its forward and backward (`_flash_attn_fwd`, `_flash_attn_bwd` of flash_attn/cute/interface.py,
not public API, hence the exact version pin in pyproject.toml) are wrapped here as torch.library custom ops
with fake implementations and a registered autograd, so that `torch.compile(fullgraph=True, dynamic=False)`
keeps the model in one graph. Nothing in them depends on document boundaries on the host: padded
cu_seqlens (zero-length trailing documents) of a fixed length do not recompile.
"""

import math

import torch

from configs.schema import ConfigError

INSTALL = "pip install 'flash-attn-4==4.0.0b36' (or pip install -e '.[fa4]')"


def check_fa4(device: torch.device) -> None:
    """Refuse, at start-up, a run where FlashAttention-4 cannot run, naming every reason at once."""
    problems = []
    try:
        import flash_attn.cute  # noqa: F401
    except Exception as err:  # not installed, or its CUDA libraries fail to load: either way, unusable
        problems.append(f"flash_attn.cute does not import ({err}): install FlashAttention-4 with {INSTALL}")
    if device.type != "cuda":
        problems.append(
            f"it needs a CUDA GPU of compute capability 9.0 or later; this run is on {device.type}"
        )
    elif (capability := torch.cuda.get_device_capability(device)) < (9, 0):
        problems.append(
            f"it needs a GPU of compute capability 9.0 or later (Hopper, Blackwell); this one is "
            f"{capability[0]}.{capability[1]}"
        )
    if problems:
        raise ConfigError(f"attention=fa4 cannot run here: {'; '.join(problems)}")


def _window_left(window: int) -> int | None:
    return None if window < 0 else window  # FA4 takes None for an unbounded side


@torch.library.custom_op("varlen_gpt::fa4_fwd", mutates_args=())
def fa4_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    window: int,
    softmax_scale: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, H, D], lse [H, T] float32). `deterministic` is for the backward, which the autograd
    formula below takes from here."""
    from flash_attn.cute.interface import _flash_attn_fwd

    # Under autograd the inputs here do not require grad, so FA4 writes the lse only when asked for it.
    out, lse, *_ = _flash_attn_fwd(
        q, k, v,
        cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
        softmax_scale=softmax_scale, causal=True, window_size_left=_window_left(window), return_lse=True,
    )  # fmt: skip
    return out, lse


@fa4_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, window, softmax_scale, deterministic):
    T, H, _ = q.shape
    return q.new_empty(T, H, v.shape[-1]), q.new_empty((H, T), dtype=torch.float32)


@torch.library.custom_op("varlen_gpt::fa4_bwd", mutates_args=())
def fa4_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    window: int,
    softmax_scale: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from flash_attn.cute.interface import _flash_attn_bwd

    # FA4 allocates the gradients like its inputs: contiguous ones give the fake's layout.
    dout, q, k, v, out = (x.contiguous() for x in (dout, q, k, v, out))
    return _flash_attn_bwd(
        q, k, v, out, dout, lse, softmax_scale, True,
        window_size_left=_window_left(window), cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, deterministic=deterministic, dlse=dlse,
    )  # fmt: skip


@fa4_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens, max_seqlen, window, softmax_scale, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, window, softmax_scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.args = (max_seqlen, window, softmax_scale, deterministic)
    # lse, which the model does not use, gets no gradient: None instead of zeros allocated every call.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    dq, dk, dv = fa4_bwd(dout, q, k, v, out, lse, dlse, cu_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


fa4_fwd.register_autograd(_backward, setup_context=_setup_context)


def fa4_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, window: int) -> torch.Tensor:
    """Causal attention within each document, keys at most `window` back (-1: all), as the `fa4` backend.

    q [T, H, D], k and v [T, H_kv, D] in bf16 or fp16 (the model's dtype under autocast); cu_seqlens int32,
    trailing zero-length documents allowed; max_seqlen bounds every document (FA4 sizes its work by it).
    The backward is deterministic when torch's deterministic algorithms are on, as `deterministic=true`
    sets them (run/determinism.py)."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"attention=fa4 takes bf16 or fp16 q, k, v (autocast on CUDA); got {q.dtype}")
    deterministic = torch.are_deterministic_algorithms_enabled()
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, _ = fa4_fwd(q, k, v, cu_seqlens.to(torch.int32), max_seqlen, window, scale, deterministic)
    return out
