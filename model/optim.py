"""Optimisers and the learning-rate schedule.

"muon" (nanochat's recipe): Muon for the 2D matrices inside the blocks, AdamW for the embedding and
the head, whose learning rates scale with (width / 768) ** -0.5. "adamw": AdamW for everything.
Every rank holds all parameters and the same averaged gradients, so each rank steps the whole model.
"""

import torch

from configs.schema import ConfigError
from model.gpt import GPT


def orthogonalize(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximate U V^T of g = U S V^T by a quintic Newton-Schulz iteration (Muon).

    The coefficients push singular values towards 1 quickly rather than exactly; bf16 is enough.
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    x = x / (x.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x


class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum whose update is orthogonalised, scaled so that tall and wide
    matrices get updates of a similar RMS."""

    def __init__(self, params, lr: float, momentum: float):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                update = orthogonalize(p.grad.lerp(buf, group["momentum"]))
                scale = max(1.0, p.shape[0] / p.shape[1]) ** 0.5
                p.add_(update.to(p.dtype), alpha=-group["lr"] * scale)


def build_optimizers(model: GPT, cfg) -> list[torch.optim.Optimizer]:
    """The optimisers of a run; each param group remembers its base lr as `initial_lr`."""
    adam = dict(betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        optimizers = [torch.optim.AdamW(model.parameters(), lr=cfg.adamw_lr, **adam)]
    elif cfg.name == "muon":
        width_scale = (model.shape.n_embd / 768) ** -0.5
        groups = [
            dict(params=[model.wte.weight], lr=cfg.embedding_lr * width_scale),
            dict(params=[model.lm_head.weight], lr=cfg.unembedding_lr * width_scale),
        ]
        matrices = list(model.blocks.parameters())
        if any(p.ndim != 2 for p in matrices):
            raise ConfigError("Muon expects only 2D matrices inside the blocks")
        optimizers = [torch.optim.AdamW(groups, **adam), Muon(matrices, cfg.matrix_lr, cfg.muon_momentum)]
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
