"""Optimisers and the learning-rate schedule.

"muon" (nanochat's recipe): Muon for the 2D matrices inside the blocks, AdamW for the embedding and
the head, whose learning rates scale with (width / 768) ** -0.5. "adamw": AdamW for everything.
Under parallel=ddp every rank holds all parameters and the same averaged gradients and steps the whole
model. Under parallel=zero each optimiser is torch's ZeroRedundancyOptimizer around it: every rank steps
(and keeps the states of) whole parameters of its own, a greedy balance by size, then broadcasts them, so
Muon orthogonalises whole matrices as in one process. Under parallel=fsdp the parameters, gradients and
states are DTensor shards: AdamW is elementwise and steps each rank's shard; Muon keeps its momentum
sharded and gathers each whole matrix only to orthogonalise it, which gives the single-process update.
"""

from functools import partial

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate

from configs.schema import ConfigError
from model.gpt import GPT


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximate U V^T of each g = U S V^T in a batch [..., m, n] by a quintic Newton-Schulz
    iteration (Muon).

    The coefficients push singular values towards 1 quickly rather than exactly; bf16 is enough.
    Each step is a x + (b G + c G G) x with G = x x^T, as two baddbmm: the scaled sums happen in the
    products' epilogues, with no elementwise kernels between them.
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16().reshape(-1, *g.shape[-2:])
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if tall:
        x = x.mT
    return x.reshape(g.shape)


def shape_groups(params) -> list[dict]:
    """One param group per shape, in a fixed order."""
    shapes = sorted({tuple(p.shape) for p in params})
    return [dict(params=[p for p in params if tuple(p.shape) == shape]) for shape in shapes]


class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum whose update is orthogonalised, scaled so that tall and wide
    matrices get updates of a similar RMS.

    Each param group holds matrices of one shape, orthogonalised together as one batch: a few large
    batched matmuls instead of many small launches. Given plain parameters, it groups them by shape; given
    groups (as ZeroRedundancyOptimizer passes each rank's part of them), each must be of one shape.
    """

    def __init__(self, params, lr: float, momentum: float):
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else shape_groups(params)
        super().__init__(groups, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            momentum, lr = group["momentum"], group["lr"]
            scale = max(1.0, params[0].shape[0] / params[0].shape[1]) ** 0.5
            if isinstance(params[0], DTensor):
                self._sharded_step(params, grads, bufs, momentum, lr * scale)
                continue
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            nesterov = torch.stack(grads).lerp_(torch.stack(bufs), momentum)
            update = orthogonalize(nesterov).to(params[0].dtype)
            torch._foreach_add_(params, list(update.unbind(0)), alpha=-lr * scale)

    @staticmethod
    def _sharded_step(params, grads, bufs, momentum: float, step_size: float) -> None:
        """The same update for DTensor shards: momentum on each rank's shard, the whole matrices gathered
        to orthogonalise (on every rank alike), and each rank's rows of the update applied."""
        nesterov = []
        for grad, buf in zip(grads, bufs, strict=True):
            buf.lerp_(grad, 1 - momentum)
            nesterov.append(grad.lerp(buf, momentum).full_tensor())
        update = orthogonalize(torch.stack(nesterov))
        for p, u in zip(params, update.unbind(0), strict=True):
            whole = DTensor.from_local(u.to(p.dtype), p.device_mesh, [Replicate()] * p.device_mesh.ndim)
            p.add_(whole.redistribute(p.device_mesh, p.placements), alpha=-step_size)


OPTIMIZERS = ("muon", "adamw")


def build_optimizers(model: GPT, cfg, shard: bool = False) -> list[torch.optim.Optimizer]:
    """The optimisers of a run; each param group remembers its base lr as `initial_lr`. With `shard`
    (parallel=zero), each is a ZeroRedundancyOptimizer that steps this rank's parameters only."""

    def make(cls):
        return partial(ZeroRedundancyOptimizer, optimizer_class=cls) if shard else cls

    adam = dict(betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        optimizers = [make(torch.optim.AdamW)(list(model.parameters()), lr=cfg.adamw_lr, **adam)]
    elif cfg.name == "muon":
        width_scale = (model.shape.n_embd / 768) ** -0.5
        groups = [
            dict(params=[model.wte.weight], lr=cfg.embedding_lr * width_scale),
            dict(params=[model.lm_head.weight], lr=cfg.unembedding_lr * width_scale),
        ]
        matrices = list(model.blocks.parameters())
        if any(p.ndim != 2 for p in matrices):
            raise ConfigError("Muon expects only 2D matrices inside the blocks")
        optimizers = [
            make(torch.optim.AdamW)(groups, **adam),
            make(Muon)(shape_groups(matrices), lr=cfg.matrix_lr, momentum=cfg.muon_momentum),
        ]
    else:
        raise ConfigError(f"optim.name={cfg.name!r} must be 'muon' or 'adamw'")
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def lr_multiplier(step: int, max_steps: int, cfg) -> float:
    """Linear warmup over warmup_steps, constant, then linear warmdown to final_lr_frac over the last
    warmdown_ratio of the run. `step` counts completed optimiser steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    warmdown = round(cfg.warmdown_ratio * max_steps)
    if warmdown == 0 or step < max_steps - warmdown:
        return 1.0
    progress = (max_steps - step) / warmdown
    return progress + (1 - progress) * cfg.final_lr_frac


def set_lr(optimizers, multiplier: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * multiplier
