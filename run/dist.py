"""Distributed set-up for `torchrun` (NCCL on GPU, gloo on CPU; ranks and world size from the
environment, on one node or many) and the few collectives of the run's bookkeeping. The gradients'
collectives belong to the parallel mode (run/parallel.py).
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


def init_distributed(device_name: str, group_of_one: bool = False) -> DistInfo:
    """This process's rank and device; the process group when there are several ranks, or a group of one
    with `group_of_one` (FSDP2 and ZeroRedundancyOptimizer need a group even alone)."""
    device = resolve_device(device_name)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)
    if world_size > 1:
        dist.init_process_group(backend, device_id=device_id)
    elif group_of_one:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    return DistInfo(rank, local_rank, world_size, device)


def shutdown(info: DistInfo) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


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
