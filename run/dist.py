"""Distributed set-up for `torchrun` (NCCL on GPU, gloo on CPU) and the few collectives a run needs.

Gradients are averaged by hand after the last micro-step rather than by DDP: the compiled model stays
one graph (DDP would split it at bucket boundaries) and there is one flat all-reduce per step.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from configs.schema import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"device={name!r} must be one of auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available")
    return torch.device(name)


def init_distributed(device_name: str) -> DistInfo:
    device = resolve_device(device_name)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
        )
    return DistInfo(rank, local_rank, world_size, device)


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


@torch.no_grad()
def average_gradients(params, info: DistInfo) -> None:
    """Average .grad over ranks with one flat all-reduce (gloo has no AVG, so SUM then scale)."""
    if not info.enabled:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= info.world_size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def gather_objects(obj, info: DistInfo) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank when `flag` is true on any rank."""
    if not info.enabled:
        return flag
    value = torch.tensor([float(flag)], device=info.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def broadcast_object(obj, info: DistInfo):
    """Rank 0's `obj` on every rank."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def mean_over_ranks(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= info.world_size
    return value
