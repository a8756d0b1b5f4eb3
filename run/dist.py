"""Distributed set-up for `torchrun` (NCCL on GPU, gloo on CPU; ranks and world size from the
environment, on one node or many) and the few collectives of the run's bookkeeping. The gradients'
collectives belong to the parallel mode (run/parallel.py).

Two timeouts. A collective of the run fails after `dist_timeout_s` (10 minutes by default, NCCL's own):
a rank that hangs (a stuck GPU, a lost node) ends the job instead of holding its allocation. Rank 0's work
alone before training (tokenizing the corpus, verifying the checkpoint to resume from) can take much
longer, so the other ranks wait for it (`wait_for_rank0`) on a gloo group of its own whose timeout is
WAIT_FOR_RANK0.
"""

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from configs.schema import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    waiting_group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)  # wait_for_rank0
    timeout: timedelta = timedelta(minutes=10)  # a collective's, on any group the run makes (dist_timeout_s)

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


WAIT_FOR_RANK0 = timedelta(hours=24)


def init_distributed(device_name: str, group_of_one: bool = False, timeout_s: float = 600) -> DistInfo:
    """This process's rank and device; the process group when there are several ranks, or a group of one
    with `group_of_one` (FSDP2 and ZeroRedundancyOptimizer need a group even alone), whose collectives
    fail after `timeout_s` seconds."""
    if not timeout_s > 0:
        raise ConfigError(f"dist_timeout_s={timeout_s} must be positive")
    timeout = timedelta(seconds=timeout_s)
    device = resolve_device(device_name)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)
    waiting_group = None
    if world_size > 1:
        dist.init_process_group(backend, device_id=device_id, timeout=timeout)
        waiting_group = dist.new_group(backend="gloo", timeout=WAIT_FOR_RANK0)
    elif group_of_one:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id, timeout=timeout
        )
    return DistInfo(rank, local_rank, world_size, device, waiting_group, timeout)


def shutdown(info: DistInfo) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wait_for_rank0(info: DistInfo) -> None:
    """Every rank waits here until rank 0 arrives from its work alone, for up to WAIT_FOR_RANK0."""
    if info.enabled:
        dist.barrier(group=info.waiting_group)


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


def from_rank0(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Rank 0's `tensor` on every rank (written into it)."""
    if info.enabled:
        dist.broadcast(tensor, src=0)
    return tensor


def mean_over_ranks(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= info.world_size
    return value
