"""Varlen attention over a packed token buffer: the Triton kernel and its pure-PyTorch references.

`flash_attn_varlen` and `flash_attn_plan` are imported on first use, so that the references (the CPU
path) work where Triton is not installed.
"""

from kernels.reference import attention_masked, attention_reference

__all__ = ["flash_attn_varlen", "flash_attn_plan", "attention_masked", "attention_reference"]


def __getattr__(name: str):
    if name in ("flash_attn_varlen", "flash_attn_plan"):
        from kernels import op

        return getattr(op, name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
