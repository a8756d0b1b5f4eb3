"""eval/loss.py: validation loss and bits per byte against a float64 sum over the same buffers, in one
process and on two FSDP2 ranks whose held-out passes end one buffer apart (each FSDP forward is a collective,
so both ranks must run as many), which count the buffers one process counts."""

import json
import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from data.loader import Batch
from eval.loss import evaluate
from run.dist import DistInfo
from run.parallel import parallelize
from tests.eval.test_core import tiny_gpt

T, DOCS = 48, 4
# Bytes per token of the byte vocabulary: the 256 bytes one each, BOS none.
BYTES = torch.tensor([1] * 256 + [0])


def batch(seed: int) -> Batch:
    """A buffer of three documents and filler (target -1), BOS first in each."""
    g = torch.Generator().manual_seed(seed)
    lengths = [20, 12, 10]
    ids = torch.randint(0, 256, (T,), generator=g)
    targets = torch.randint(0, 256, (T,), generator=g)
    starts = torch.tensor([0, 20, 32])
    ids[starts] = 256
    targets[starts + torch.tensor(lengths) - 1] = 256  # each document's last target: BOS, no bytes
    targets[sum(lengths) :] = -1
    cu = torch.tensor([0, 20, 32, 42, T], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in [*lengths, T - sum(lengths)]])
    return Batch(ids, targets, cu, pos, T)


def reference(model, batches: list[Batch]) -> dict:
    """nats over the tokens with bytes, per token and per byte (in bits), in float64, a document at a time."""
    nats, tokens, n_bytes = 0.0, 0, 0
    with torch.no_grad():
        for b in batches:
            cu = b.cu_seqlens.tolist()
            for start, end in zip(cu, cu[1:], strict=False):
                if end == start:
                    continue
                n = end - start
                logits = model(
                    b.input_ids[start:end], torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n
                )
                for i in range(n):
                    t = int(b.targets[start + i])
                    if t >= 0 and BYTES[t] > 0:
                        nats += -F.log_softmax(logits[i].double(), -1)[t].item()
                        tokens += 1
                        n_bytes += int(BYTES[t])
    return {"val_loss": nats / tokens, "val_bpb": nats / (math.log(2) * n_bytes)}


CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


@pytest.mark.parametrize("max_tokens", [2 * T, 10 * T])
def test_one_process_equals_the_float64_sum(max_tokens):
    model = tiny_gpt(max_seqlen=T)
    batches = [batch(s) for s in range(3)]
    got = evaluate(model.token_losses, batches, BYTES, max_tokens, CPU)
    want = reference(model, batches[: max_tokens // T])
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-12)
    assert got["val_bpb"] == pytest.approx(want["val_bpb"], rel=1e-12)


class Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def token_losses(self, *args):
        self.calls += 1
        return self.fn(*args)


def rank_main(rank: int, root, buffers: list[int], max_tokens: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    info = DistInfo(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"))
    parallel = parallelize(tiny_gpt(max_seqlen=T), "fsdp", info, compile=False, reshard_after_forward=True)
    counted = Counting(parallel.token_losses)
    # This rank's share of the global pass: buffers rank, rank + 2, ... (data/loader.py).
    mine = [batch(rank + 2 * i) for i in range(buffers[rank])]
    try:
        out = evaluate(counted.token_losses, mine, BYTES, max_tokens, info)
    except ValueError as err:
        out = {"error": str(err)}
    (root / f"rank{rank}.json").write_text(json.dumps({**out, "calls": counted.calls}))
    dist.barrier()
    os._exit(0)  # without tearing gloo down, as in test_core.py's rank_main


def two_ranks(root, buffers: list[int], max_tokens: int) -> list[dict]:
    mp.start_processes(rank_main, args=(root, buffers, max_tokens), nprocs=2, start_method="spawn")
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("limit", [3, 10])
def test_fsdp_ranks_count_the_buffers_of_one_process(tmp_path, limit):
    """A held-out pass of five buffers over two FSDP2 ranks (three on rank 0, two on rank 1): the first
    `limit` buffers of the pass are counted, as one process counts them, which is the float64 sum over
    them. Both ranks run as many forwards (each is a collective): rank 1 repeats its last buffer, uncounted,
    where its pass has ended."""
    ranks = two_ranks(tmp_path, [3, 2], limit * T)
    one = evaluate(tiny_gpt(max_seqlen=T).token_losses, [batch(s) for s in range(5)], BYTES, limit * T, CPU)
    want = reference(tiny_gpt(max_seqlen=T), [batch(s) for s in range(min(limit, 5))])
    for got in ranks:
        assert got["calls"] == min(math.ceil(limit / 2), 3)
        for key in ("val_loss", "val_bpb"):
            assert got[key] == pytest.approx(want[key], rel=1e-12)
            assert got[key] == pytest.approx(one[key], rel=1e-12)


def test_a_pass_of_fewer_buffers_than_ranks_is_refused_on_every_rank(tmp_path):
    ranks = two_ranks(tmp_path, [1, 0], 10 * T)
    for got in ranks:
        assert "fewer buffers than the 2 ranks" in got["error"]
        assert got["calls"] == 0
