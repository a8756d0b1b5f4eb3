"""Varlen attention over a packed token buffer: the Triton kernel and its pure-PyTorch references.

`flash_attn_varlen` is imported on first use, so that the references (the CPU path) work where Triton
is not installed.
"""

from kernels.reference import attention_masked, attention_reference

__all__ = ["flash_attn_varlen", "attention_masked", "attention_reference"]


def __getattr__(name: str):
    if name == "flash_attn_varlen":
        from kernels.op import flash_attn_varlen

        return flash_attn_varlen
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
