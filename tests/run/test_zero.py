"""parallel=zero's optimisers on two gloo ranks against the single-process optimisers: each rank keeps the
states of its own whole parameters only, the ranks together step what one process steps, and the state by
parameter name moves in and out of the single-process (ddp) form both ways."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from configs.schema import ModelConfig, OptimConfig
from model.gpt import GPT
from model.optim import build_optimizers
from run.parallel import load_model_state, model_state

WORLD = 2


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(depth=2, head_dim=16, aspect_ratio=32), 96, "reference", 32)


def set_grads(model: GPT, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def step(model: GPT, optimizers, seed: int) -> None:
    set_grads(model, seed)
    for opt in optimizers:
        opt.step()


def clone_state(state):
    if isinstance(state, dict):
        return {k: clone_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [clone_state(v) for v in state]
    return state.clone() if isinstance(state, torch.Tensor) else state


def rank_main(rank: int, init_file: str, out: str, name: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = make_model()
        optimizers = build_optimizers(model, OptimConfig(name=name), shard=True)
        step(model, optimizers, seed=1)
        step(model, optimizers, seed=2)
        saved = clone_state(model_state(model, optimizers))
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        # A fresh model and optimisers loaded from the single-process form, then one more step.
        reference = torch.load(os.path.join(out, "reference.pt"))
        fresh = make_model()
        fresh_optimizers = build_optimizers(fresh, OptimConfig(name=name), shard=True)
        load_model_state(fresh, fresh_optimizers, clone_state(reference["state"]))
        step(fresh, fresh_optimizers, seed=3)
        resumed = {k: v.clone() for k, v in fresh.state_dict().items()}
        torch.save(dict(saved=saved, weights=weights, resumed=resumed), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_zero_ranks_step_their_own_parameters_as_one_process_steps_all(tmp_path, name):
    # The single-process run: two steps, its state (the form ddp checkpoints hold), a third step.
    model = make_model()
    optimizers = build_optimizers(model, OptimConfig(name=name))
    step(model, optimizers, seed=1)
    step(model, optimizers, seed=2)
    two_steps = {k: v.clone() for k, v in model.state_dict().items()}
    state = clone_state(model_state(model, optimizers))
    torch.save(dict(state=state), tmp_path / "reference.pt")
    step(model, optimizers, seed=3)
    three_steps = model.state_dict()

    mp.spawn(rank_main, args=(str(tmp_path / "init"), str(tmp_path), name), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    names = dict(make_model().named_parameters())
    owned = [set(r["saved"]["optimizers"]["state"]) for r in ranks]
    # Every parameter's state on exactly one rank, each rank holding a fair share (the greedy balance by
    # size is within the largest parameter of half).
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(names)
    sizes = [sum(names[k].numel() for k in mine) for mine in owned]
    largest = max(p.numel() for p in names.values())
    assert abs(sizes[0] - sizes[1]) <= largest, sizes
    for r, mine in zip(ranks, owned, strict=True):
        # A rank's states are the single process's, and its param groups the single process's too (the
        # same on every rank, so a checkpoint's one copy serves any mode).
        for key in mine:
            for field, value in state["optimizers"]["state"][key].items():
                torch.testing.assert_close(
                    r["saved"]["optimizers"]["state"][key][field], value, rtol=1e-5, atol=1e-6
                )
        assert r["saved"]["optimizers"]["param_groups"] == state["optimizers"]["param_groups"]
        # Every rank ends with the whole model as one process steps it (the owners broadcast).
        for key, value in two_steps.items():
            torch.testing.assert_close(r["weights"][key], value, rtol=1e-5, atol=1e-6)
        # Loaded from the single-process state, a step gives the single process's third step.
        for key, value in three_steps.items():
            torch.testing.assert_close(r["resumed"][key], value, rtol=1e-5, atol=1e-6)
    # The steps moved the weights (the comparisons above are not of untouched initial values).
    assert any(not torch.equal(two_steps[k], make_model().state_dict()[k]) for k in two_steps)
