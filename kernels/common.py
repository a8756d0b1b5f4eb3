"""What every Triton kernel module of this package shares: the switch to Triton's CPU interpreter, and the
constants of base-2 softmax.

Without CUDA, the kernels run in Triton's interpreter (slow; for tests on CPU). Triton decides at decoration
time, and decorates its own library functions (tl.sum, tl.max...) when it is first imported, so
TRITON_INTERPRET=1 must be set before anything imports triton (torch._dynamo does): this module sets it when
it comes first, so every kernel module imports it before triton. Otherwise set it in the environment.
"""

import functools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when @triton.jit decorates functions

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Whether triton.language was set up for the interpreter too (see the module docstring).
_LIBRARY_INTERPRETED = isinstance(tl.sum, InterpretedFunction)
# The kernels work in base 2: scores scaled by log2(e) so that exp2 replaces exp; the LSE goes back by ln 2.
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


def max_registers(warpgroups: int) -> int:
    """A thread's registers in a launch of `warpgroups` warpgroups: the register file (64K) shared evenly, in
    ptxas' steps of 8. Warp-specialised kernels then share it out unevenly (setmaxnreg): 240 / 240 / 24 with
    two warpgroups beside a load warp padded to one (168 each at launch), 160 / 160 / 160 / 24 with three."""
    return 65536 // (128 * warpgroups) // 8 * 8


def check_interpreter() -> None:
    """Refuse to launch in the interpreter when triton's library was set up without it."""
    if INTERPRET and not _LIBRARY_INTERPRETED:
        raise RuntimeError(
            "triton was imported before kernels.common without TRITON_INTERPRET=1, so its library cannot "
            "run in the interpreter: set TRITON_INTERPRET=1 in the environment"
        )


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def _device_properties(device: torch.device):
    return _properties(torch.cuda.current_device() if device.index is None else device.index)


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device, looked up once: each launch of a persistent kernel
    asks, and torch's own lookup costs microseconds of host time."""
    return _device_properties(device).multi_processor_count


def l2_bytes(device: torch.device) -> int:
    """The L2 cache of a CUDA device, in bytes (see sm_count)."""
    return _device_properties(device).L2_cache_size


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, looked up once (see sm_count)."""
    p = _device_properties(device)
    return p.major, p.minor


def is_hopper(device: torch.device) -> bool:
    """Whether a device is a Hopper GPU (sm_90), which runs the Gluon kernels."""
    return device.type == "cuda" and capability(device)[0] == 9


@functools.cache
def nvmma_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The shared-memory layout (Hopper's swizzled NVMMA layout) of TMA blocks of this shape and dtype, made
    once per block and dtype: building it costs more host time than the descriptor it goes into."""
    from triton.experimental.gluon import language as gl  # Gluon only where a Hopper kernel launches

    gl_dtypes = {
        torch.bfloat16: gl.bfloat16,
        torch.float16: gl.float16,
        torch.float8_e4m3fn: gl.float8e4nv,
        torch.float8_e5m2: gl.float8e5,
        torch.float32: gl.float32,
    }
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtypes[dtype])
