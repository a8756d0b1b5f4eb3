"""Muon's orthogonalisation, the optimiser split, and the learning-rate schedule."""

import pytest
import torch

from configs.schema import ConfigError, ModelConfig, OptimConfig
from model.gpt import GPT
from model.optim import build_optimizers, lr_multiplier, orthogonalize


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32)])
def test_orthogonalize_approximates_polar_factor(shape):
    torch.manual_seed(0)
    u, _, vt = torch.linalg.svd(torch.randn(*shape, dtype=torch.float64), full_matrices=False)
    polar = u @ vt
    # Singular values spread over two decades (five iterations cannot lift ones near zero).
    g = 7.0 * u @ torch.diag(torch.logspace(-2, 0, min(shape), dtype=torch.float64)) @ vt
    out = orthogonalize(g).double()
    singular = torch.linalg.svdvals(out)
    # The quintic iteration trades exactness for speed: singular values land in a band around 1.
    assert singular.min() > 0.5 and singular.max() < 1.3
    cosine = (out * polar).sum() / (out.norm() * polar.norm())
    assert cosine > 0.95


def test_muon_takes_block_matrices_and_adamw_the_rest():
    model = GPT(ModelConfig(depth=2, head_dim=32), vocab_size=100, attention="reference", max_seqlen=64)
    adamw, muon = build_optimizers(model, OptimConfig(name="muon"))
    muon_params = {id(p) for g in muon.param_groups for p in g["params"]}
    adam_params = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert muon_params == {id(p) for p in model.blocks.parameters()}
    assert adam_params == {id(model.wte.weight), id(model.lm_head.weight)}
    (only,) = build_optimizers(model, OptimConfig(name="adamw"))
    assert sum(len(g["params"]) for g in only.param_groups) == len(list(model.parameters()))
    with pytest.raises(ConfigError, match="optim.name"):
        build_optimizers(model, OptimConfig(name="sgd"))


def test_muon_training_reduces_loss():
    torch.manual_seed(0)
    model = GPT(ModelConfig(depth=2, head_dim=32), vocab_size=50, attention="reference", max_seqlen=64)
    optimizers = build_optimizers(model, OptimConfig(name="muon"))
    ids = torch.randint(0, 50, (64,))
    cu, pos = torch.tensor([0, 64], dtype=torch.int32), torch.arange(64)
    losses = []
    for _ in range(30):
        loss = model(ids, pos, cu, 64, torch.roll(ids, -1))
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_schedule_warmup_constant_warmdown():
    cfg = OptimConfig(warmup_steps=10, warmdown_ratio=0.2, final_lr_frac=0.1)
    lrs = [lr_multiplier(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(v == 1.0 for v in lrs[10:80])
    assert lrs[80] == pytest.approx(1.0) and lrs[90] == pytest.approx(0.55)
    assert all(a > b for a, b in zip(lrs[80:], lrs[81:], strict=False))
    assert lrs[99] > 0.1


def test_batched_orthogonalize_matches_one_matrix_at_a_time():
    torch.manual_seed(0)
    batch = torch.randn(3, 48, 32)
    together = orthogonalize(batch).float()
    for i in range(3):
        torch.testing.assert_close(together[i], orthogonalize(batch[i]).float(), rtol=2e-2, atol=2e-2)
