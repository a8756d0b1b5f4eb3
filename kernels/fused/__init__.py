"""The model's fused operators and the Hopper matrix products under them.

Public surface (each a PyTorch custom op with autograd and a fake implementation, so torch.compile traces
through it with fullgraph=True; on the CPU each runs its PyTorch formula):
- `qkv_rope_norm(x, wq, wk, wv, cos, sin)`: attention's q, k, v with RoPE and the per-head RMSNorm of q and
  k applied in the product's epilogue (qkv.py); `supported_head_dim(head_dim)` says where it applies;
  `qkv_rope_norm_fp8`, the same with FP8 products.
- `relu2_mlp(x, w1, w2)`: the block's MLP, x + relu(rms_norm(x) W1^T)^2 W2^T (mlp.py); `relu2_mlp_fp8`, the
  same with FP8 products.
- `residual_linear(r, y, w)`: r + y W^T, attention's output projection with the residual added in the
  product's epilogue (residual.py); `residual_linear_fp8`, the same with FP8 products.
- `softcap_cross_entropy(logits, targets, scale, cap, grad_dtype)`: the soft-capped loss and its gradient
  (in bf16, or e5m2 for the FP8 head) in one kernel (cross_entropy.py).
- `RMS_EPS`: the RMSNorm epsilon that the model and the operators share (numerics.py).

Internal: gemm_hopper.py (the Gluon GEMM with epilogues), wgrad_hopper.py (the stream-K weight-gradient
product), products.py (which product runs where), numerics.py. The operators are imported on first use:
they import triton, which the model's CPU path does not need.
"""

from kernels.fused.numerics import RMS_EPS

__all__ = [
    "RMS_EPS",
    "qkv_rope_norm",
    "qkv_rope_norm_fp8",
    "supported_head_dim",
    "relu2_mlp",
    "relu2_mlp_fp8",
    "residual_linear",
    "residual_linear_fp8",
    "softcap_cross_entropy",
]

_OPERATORS = {
    "qkv_rope_norm": "qkv",
    "qkv_rope_norm_fp8": "qkv",
    "supported_head_dim": "qkv",
    "relu2_mlp": "mlp",
    "relu2_mlp_fp8": "mlp",
    "residual_linear": "residual",
    "residual_linear_fp8": "residual",
    "softcap_cross_entropy": "cross_entropy",
}


def __getattr__(name: str):
    if name in _OPERATORS:
        from importlib import import_module

        return getattr(import_module(f"kernels.fused.{_OPERATORS[name]}"), name)
    raise AttributeError(f"module 'kernels.fused' has no attribute {name!r}")
