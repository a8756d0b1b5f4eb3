"""The GPU kernels: Triton, with Gluon passes on Hopper, each beside its PyTorch reference.

- `kernels.attention`: the varlen FlashAttention over a packed token buffer.
- `kernels.fused`: the model's fused operators (q/k/v with RoPE and norm, the MLP, the residual projection,
  the soft-capped cross-entropy) and the Hopper matrix products under them.
- `kernels.common`: what every Triton module shares (the switch to the CPU interpreter, base-2 constants).

Importing the package also tags torch.compile's caches with a digest of the sources that define our custom
ops (`kernels/` and `model/`). Those caches key a graph by its code, which names an op but says nothing of
its fake implementation or its registered backward: after an edit or an upgrade that changes either, a warm
cache would serve the old compiled graph. A tag set beforehand (TORCH_COMPILE_CACHE_KEY_TAG) is kept, with
ours after it.
"""

import hashlib
from pathlib import Path

import torch.compiler.config


def source_tag() -> str:
    """A digest of the .py files under the repository's kernels/ and model/, their paths included."""
    root, digest = Path(__file__).resolve().parents[1], hashlib.sha256()
    for path in sorted(p for folder in ("kernels", "model") for p in (root / folder).rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return f"varlen-gpt-{digest.hexdigest()[:16]}"


_tags = (torch.compiler.config.cache_key_tag, source_tag())
torch.compiler.config.cache_key_tag = ":".join(tag for tag in _tags if tag)
