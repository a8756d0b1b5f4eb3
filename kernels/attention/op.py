"""`flash_attn_varlen`: the attention kernels as PyTorch custom operators with autograd.

The plan op returns the tile tables of a call (`flash_attn_plan`), the forward op (out, lse) and the
backward op (dq, dk, dv). All have fake implementations, so torch.compile traces through them without a
graph break. Nothing in them reads device values on the host and no shape depends on document
boundaries, so a compiled model does not recompile when the boundaries change between batches (with
cu_seqlens of a fixed length: pad it with zero-length documents). Eager calls of flash_attn_varlen run the
same autograd (setup and backward) without the ops' dispatch, whose host time left short calls host-bound.
"""

import math
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kernels.attention.backward import backward
from kernels.attention.forward import forward
from kernels.attention.plan import make_plan, plan_size


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernels take any token and head strides (such as views into a fused QKV projection).
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("varlen_gpt::flash_attn_plan", mutates_args=())
def flash_attn_plan_tables(
    cu_seqlens: torch.Tensor,
    num_tokens: int,
    head_dim: int,
    window_left: int,
    window_right: int,
    max_seqlen: int,
) -> torch.Tensor:
    return make_plan(cu_seqlens, num_tokens, head_dim, window_left, window_right, max_seqlen)


@flash_attn_plan_tables.register_fake
def _(cu_seqlens, num_tokens, head_dim, window_left, window_right, max_seqlen):
    n_docs = cu_seqlens.shape[0] - 1
    size = plan_size(num_tokens, n_docs, head_dim, window_left, window_right, max_seqlen, cu_seqlens.device)
    return cu_seqlens.new_empty(size)


@torch.library.custom_op("varlen_gpt::flash_attn_varlen_fwd", mutates_args=())
def flash_attn_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    plan: torch.Tensor | None,
    window_left: int,
    window_right: int,
    softmax_scale: float,
    max_seqlen: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_kernels(q, k, v, cu_seqlens, plan, window_left, window_right, softmax_scale, max_seqlen)


def _forward_kernels(q, k, v, cu_seqlens, plan, window_left, window_right, softmax_scale, max_seqlen):
    q, k, v = map(_last_dim_contiguous, (q, k, v))
    return forward(q, k, v, cu_seqlens, window_left, window_right, softmax_scale, plan, max_seqlen)


@flash_attn_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, plan, window_left, window_right, softmax_scale, max_seqlen):
    T, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((H, T), dtype=torch.float32)


@torch.library.custom_op("varlen_gpt::flash_attn_varlen_bwd", mutates_args=())
def flash_attn_varlen_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    plan: torch.Tensor | None,
    window_left: int,
    window_right: int,
    softmax_scale: float,
    max_seqlen: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_kernels(
        dout, q, k, v, out, lse, dlse, cu_seqlens, plan, window_left, window_right, softmax_scale, max_seqlen
    )


def _backward_kernels(
    dout, q, k, v, out, lse, dlse, cu_seqlens, plan, window_left, window_right, softmax_scale, max_seqlen
):
    dout, q, k, v = map(_last_dim_contiguous, (dout, q, k, v))
    dlse = None if dlse is None else dlse.contiguous()
    return backward(
        dout, q, k, v, out, lse, dlse, cu_seqlens, window_left, window_right, softmax_scale, plan, max_seqlen
    )


@flash_attn_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens, plan, window_left, window_right, softmax_scale, max_seqlen):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, plan, window_left, window_right, softmax_scale, max_seqlen = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, plan)
    ctx.args = (window_left, window_right, softmax_scale, max_seqlen)
    # An output that gets no gradient (lse, nearly always) comes to _backward as None, not as zeros that
    # autograd would allocate and fill for every call and the backward would then read.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens, plan = ctx.saved_tensors
    if dout is None:  # only lse was used
        dout = torch.zeros_like(out)
    run = flash_attn_varlen_bwd if _traced() else _backward_kernels
    dq, dk, dv = run(dout, q, k, v, out, lse, dlse, cu_seqlens, plan, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


flash_attn_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


def _traced() -> bool:
    """Whether torch.compile, or any dispatch mode (tracing, fake tensors, a flop counter), is watching: it
    must see the custom ops, where an eager call goes straight to the kernels."""
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


class _EagerAttention(torch.autograd.Function):
    """The forward op's autograd (the same setup and backward) without the dispatcher, for eager calls: the
    custom ops' dispatch and the autograd layer that register_autograd generates took 0.1-0.5 ms of host
    time a forward + backward on an H200's host, enough to leave calls of under 2 ms host-bound."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward_kernels(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    backward = staticmethod(_backward)


class FlashAttnPlan(NamedTuple):
    """The tile tables of every kernel launch for one set of documents (`flash_attn_plan`), with what they
    were made for, so that a call they do not fit fails on the host."""

    tables: torch.Tensor
    num_tokens: int
    head_dim: int
    window: tuple[int, int]  # (left, right) as the kernels take it: causal has right = 0
    max_seqlen: int  # no document is longer (num_tokens: no bound)


def _window(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    left, right = window_size
    return (left, 0) if causal else (left, right)


def flash_attn_plan(
    cu_seqlens: torch.Tensor,
    num_tokens: int,
    head_dim: int,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    max_seqlen: int | None = None,
) -> FlashAttnPlan:
    """Schedule the kernels once for calls that share their documents (as flash-attn 3's scheduler
    metadata): pass it as `plan=` to every layer's `flash_attn_varlen` over the same cu_seqlens, and the
    forward and backward of each reuse it instead of building their tile tables per call (about seven
    small launches). A plan is only valid for the cu_seqlens it was made from; the token count, head dim
    and window are checked at each call, the boundaries are not (that would wait on the device).

    max_seqlen, where given, promises that no document is longer: the kernels' length classes above it
    are then not launched (a launch with nothing to do still costs its programs' start-up, tens of us).
    The promise is checked on the device, without waiting for it; on CUDA a broken one is a device-side
    assert. A plan over a fixed max_seqlen (the loader's) compiles once; pass None where it varies."""
    window = _window(causal, window_size)
    if max_seqlen is not None and max_seqlen < 1:
        raise ValueError(f"max_seqlen must be positive, got {max_seqlen}")
    bound = num_tokens if max_seqlen is None else min(max_seqlen, num_tokens)
    tables = flash_attn_plan_tables(cu_seqlens.to(torch.int32), num_tokens, head_dim, *window, bound)
    return FlashAttnPlan(tables, num_tokens, head_dim, window, bound)


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    plan: FlashAttnPlan | None = None,
) -> torch.Tensor:
    """Attention within each document of a packed buffer, as flash-attn's varlen function.

    q: [T, H, D]; k, v: [T, H_kv, D] with H divisible by H_kv; float16, bfloat16 or float32; D <= 256.
    cu_seqlens: int32 [N + 1] document boundaries, trailing zero-length documents allowed; tokens past
    cu_seqlens[-1] get 0. window_size=(left, right): query i sees keys i - left .. i + right of its
    document, -1 meaning unbounded; causal sets right = 0. softmax_scale defaults to 1 / sqrt(D).
    plan: from `flash_attn_plan` over the same cu_seqlens, or None for the forward and the backward to
    build their own tile tables.
    max_seqlen is accepted for compatibility with flash-attn and not used: the work is scheduled from
    cu_seqlens on the device, so a new value does not recompile. A plan's max_seqlen bounds its launches.
    """
    T, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != T or k.shape[2] != D or H % k.shape[1]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q [T, H, D] "
            "and k, v [T, H_kv, D] with H divisible by H_kv"
        )
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"q, k, v must share a dtype among float16, bfloat16, float32; got {q.dtype}, "
            f"{k.dtype}, {v.dtype}"
        )
    if D > 256:
        raise ValueError(f"head dim {D} > 256 is not supported")
    window = _window(causal, window_size)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    if scale <= 0:  # the kernels take the row max of unscaled scores
        raise ValueError(f"softmax_scale must be positive, got {scale}")
    if plan is not None and (plan.num_tokens, plan.head_dim, plan.window) != (T, D, window):
        raise ValueError(
            f"plan was made for {plan.num_tokens} tokens, head dim {plan.head_dim}, window {plan.window}; "
            f"this call has {T} tokens, head dim {D}, window {window}"
        )
    tables, bound = (None, T) if plan is None else (plan.tables, plan.max_seqlen)
    inputs = (q, k, v, cu_seqlens.to(torch.int32), tables, *window, scale, bound)
    if _traced():
        out, _ = flash_attn_varlen_fwd(*inputs)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out, _ = _EagerAttention.apply(*inputs)
    else:
        out, _ = _forward_kernels(*inputs)
    return out
