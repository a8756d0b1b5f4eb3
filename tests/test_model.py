"""The GPT on packed buffers: no bleed between documents, the chunked loss, backends, shapes, compile."""

import pytest
import torch
import torch.nn.functional as F

from configs.schema import ConfigError, ModelConfig
from model.gpt import GPT, GPTShape, layer_windows


def segments(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens and position_ids of documents of these lengths, one after another."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths if n > 0])
    return cu, pos


def tiny_model(attention="reference", dtype=torch.float64, **overrides) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(
        **{"depth": 2, "head_dim": 16, "aspect_ratio": 32, "loss_chunk_tokens": 40, **overrides}
    )
    model = GPT(cfg, vocab_size=97, attention=attention, max_seqlen=128).to(dtype)
    with torch.no_grad():  # zero-initialised projections would hide mixing between tokens
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("overrides", [{}, {"n_kv_heads": 1}, {"window_pattern": "SL", "short_window": 5}])
def test_packed_logits_equal_each_document_alone(overrides):
    model = tiny_model(**overrides)
    lengths = [7, 1, 30, 0, 22, 4]
    cu, pos = segments(lengths)
    ids = torch.randint(0, 97, (int(cu[-1]),))
    packed = model(ids, pos, torch.cat([cu, cu[-1:].repeat(3)]), 30)  # plus trailing padding documents
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        if end > start:
            n = end - start
            alone = model(ids[start:end], torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n)
            torch.testing.assert_close(packed[start:end], alone, rtol=1e-9, atol=1e-9)


def test_chunked_loss_matches_full_cross_entropy_and_gradients():
    model = tiny_model()
    cu, pos = segments([50, 37, 41])
    ids = torch.randint(0, 97, (128,))
    targets = torch.randint(0, 97, (128,))
    targets[::5] = -1
    loss = model(ids, pos, cu, 64, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = F.cross_entropy(model(ids, pos, cu, 64), targets, ignore_index=-1)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-9, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-9, msg=name)
    losses = model.token_losses(ids, pos, cu, 64, targets)
    assert (losses[targets < 0] == 0).all()
    torch.testing.assert_close(losses.sum() / (targets >= 0).sum(), reference, rtol=1e-9, atol=0)


def test_flex_backend_matches_reference():
    reference, flex = tiny_model(dtype=torch.float32), tiny_model("flex", dtype=torch.float32)
    flex.load_state_dict(reference.state_dict())
    cu, pos = segments([40, 1, 60, 27])
    ids = torch.randint(0, 97, (128,))
    with torch.no_grad():  # FlexAttention has no backward on CPU
        torch.testing.assert_close(flex(ids, pos, cu, 64), reference(ids, pos, cu, 64), rtol=1e-4, atol=1e-4)


def test_sdpa_packed_bleeds_across_documents_within_a_row():
    reference, packed = tiny_model(), tiny_model("sdpa_packed")
    packed.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 97, (64,))
    one_doc_per_row, _ = segments([32, 32])
    pos = torch.arange(64) % 32
    torch.testing.assert_close(
        packed(ids, pos, one_doc_per_row, 32), reference(ids, pos, one_doc_per_row, 32)
    )
    two_docs_in_row, pos2 = segments([16, 16, 32])
    bled = packed(ids, pos2, two_docs_in_row, 32)
    clean = reference(ids, pos2, two_docs_in_row, 32)
    torch.testing.assert_close(bled[:16], clean[:16])  # the first document of a row sees only itself
    assert (bled[16:32] - clean[16:32]).abs().max() > 1e-3  # the second one sees the first


def test_width_and_heads_follow_depth():
    shape = GPTShape.from_config(ModelConfig(depth=12), vocab_size=32768)
    assert (shape.n_embd, shape.n_head, shape.n_kv_head, shape.padded_vocab_size) == (768, 6, 6, 32768)
    shape = GPTShape.from_config(ModelConfig(depth=20), vocab_size=50000)
    assert (shape.n_embd, shape.n_head, shape.padded_vocab_size) == (1280, 10, 50048)
    with pytest.raises(ConfigError, match="n_kv_heads"):
        GPTShape.from_config(ModelConfig(depth=12, n_kv_heads=4), vocab_size=100)
    with pytest.raises(ConfigError, match="window_pattern"):
        layer_windows("SX", 8, 4)
    assert layer_windows("SSL", 8, 4) == [8, 8, -1, -1]


def test_initial_loss_is_near_uniform():
    torch.manual_seed(0)
    model = GPT(
        ModelConfig(depth=2, head_dim=16, aspect_ratio=32),
        vocab_size=97,
        attention="reference",
        max_seqlen=64,
    )
    cu, pos = segments([64])
    ids, targets = torch.randint(0, 97, (64,)), torch.randint(0, 97, (64,))
    assert abs(model(ids, pos, cu, 64, targets).item() - torch.log(torch.tensor(97.0)).item()) < 0.05


def test_compiled_model_has_no_graph_break_and_no_recompile():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = tiny_model(dtype=torch.float32)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    ids, targets = torch.randint(0, 97, (128,)), torch.randint(0, 97, (128,))
    for lengths in ([128, 0, 0, 0], [10, 50, 60, 8], [1, 1, 1, 125], [64, 64, 0, 0]):
        cu, pos = segments(lengths)
        loss = compiled(ids, pos, cu, 128, targets)
        loss.backward()
        torch.testing.assert_close(loss, model(ids, pos, cu, 128, targets), rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
