"""The GPU kernels: Triton, with Gluon passes on Hopper, each beside its PyTorch reference.

- `kernels.attention`: the varlen FlashAttention over a packed token buffer.
- `kernels.fused`: the model's fused operators (q/k/v with RoPE and norm, the MLP, the residual projection,
  the soft-capped cross-entropy) and the Hopper matrix products under them.
- `kernels.common`: what every Triton module shares (the switch to the CPU interpreter, base-2 constants).
"""
