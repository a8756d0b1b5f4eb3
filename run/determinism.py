"""Bitwise-reproducible training (`deterministic=true`).

Our own kernels are deterministic by construction (attention's backward writes every element from one
program; the stream-K weight gradients add their partial sums in a fixed order). What is not, without
this switch, is torch's and inductor's:
- the embedding's backward, which inductor compiles to a scatter with atomic adds (on CPU with more than
  one thread too): torch's deterministic algorithms make it fall back to ATen's sorted, atomic-free kernel;
- inductor's choice between kernel variants by timing them on the device, which can pick differently from
  run to run: its deterministic mode picks without timing;
- cuBLAS, which needs a fixed workspace configuration to give the same bits on every call.

torch's deterministic mode also fills every new uninitialised tensor with NaN, a debugging aid that cost
10% of d12's tokens/s on an H100: it is turned off. What is left costs about 1% (README "Reproducibility").
"""

import os

import torch


def configure_determinism(deterministic: bool) -> None:
    """Call before the first matrix product on CUDA: cuBLAS reads its workspace setting when it starts."""
    if not deterministic:
        return
    import torch._inductor.config as inductor_config  # 2 s to import: not before a run needs it

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.benchmark = False
    inductor_config.deterministic = True
