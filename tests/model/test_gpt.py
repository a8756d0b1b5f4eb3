"""The GPT on packed buffers: no bleed between documents, the chunked loss, backends, shapes, compile."""

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

from configs.schema import ConfigError, ModelConfig, register_configs
from model.gpt import GPT, GPTShape, layer_windows
from tests.train_helpers import ROOT

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


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


@pytest.mark.parametrize(
    ("logit_softcap", "loss_chunk_tokens"),
    [(15.0, 40), (0.0, 40), (15.0, 128), (0.0, 1000)],  # chunks of 40 leave a last chunk of 8
)
def test_chunked_loss_matches_full_cross_entropy_and_gradients(logit_softcap, loss_chunk_tokens):
    model = tiny_model(logit_softcap=logit_softcap, loss_chunk_tokens=loss_chunk_tokens)
    cu, pos = segments([50, 37, 41])
    ids = torch.randint(0, 97, (128,))
    targets = torch.randint(0, 97, (128,))
    targets[::5] = -1
    targets[40:80] = -1  # a whole chunk of 40 without targets
    loss = model(ids, pos, cu, 64, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(ids, pos, cu, 64)
    reference = F.cross_entropy(logits, targets, ignore_index=-1)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-9, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-9, msg=name)
    losses = model.token_losses(ids, pos, cu, 64, targets)
    per_token = F.cross_entropy(logits.detach(), targets, ignore_index=-1, reduction="none")
    torch.testing.assert_close(losses, per_token, rtol=1e-9, atol=1e-12)
    assert (losses[targets < 0] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_loss_kernel_matches_full_cross_entropy_and_gradients():
    model = tiny_model(dtype=torch.float32).cuda()  # fp32 on CUDA: the loss takes the Triton kernel
    cu, pos = segments([50, 37, 41])
    cu, pos = cu.cuda(), pos.cuda()
    ids, targets = torch.randint(0, 97, (128,), device="cuda"), torch.randint(0, 97, (128,), device="cuda")
    targets[::5] = -1
    loss = model(ids, pos, cu, 64, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = F.cross_entropy(model(ids, pos, cu, 64).double(), targets, ignore_index=-1)
    reference.backward()
    # The kernel's tanh is PTX's tanh.approx (relative error up to 2^-10.99 per logit).
    torch.testing.assert_close(loss.double(), reference, rtol=1e-4, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=2e-3, atol=1e-6, msg=name)
    # Compiled as training compiles it: one graph, the same loss as eager.
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(ids, pos, cu, 64, targets), loss, rtol=1e-5, atol=0)
    assert not counters["graph_break"]


def test_chunked_loss_without_targets_is_zero():
    model = tiny_model()
    cu, pos = segments([128])
    loss = model(torch.randint(0, 97, (128,)), pos, cu, 128, torch.full((128,), -1))
    loss.backward()
    assert loss.item() == 0 and all((p.grad == 0).all() for p in model.parameters())


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


# nanochat's shapes: width = 64 * depth, in heads of 128.
@pytest.mark.parametrize(
    ("preset", "width", "heads"),
    [("d12", 768, 6), ("d20", 1280, 10), ("d24", 1536, 12), ("d26", 1664, 13), ("d32", 2048, 16)],
)
def test_model_presets_compose_to_nanochats_shapes(preset, width, heads):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("config", overrides=[f"model={preset}"])
    shape = GPTShape.from_config(cfg.model, vocab_size=32768)
    assert (shape.n_layer, shape.n_embd, shape.n_head) == (int(preset[1:]), width, heads)


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


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_autocast_runs_the_residual_stream_and_attention_in_bf16(device):
    model = tiny_model(dtype=torch.float32).to(device)
    cu, pos = segments([50, 37, 41])
    cu, pos = cu.to(device), pos.to(device)
    ids, targets = torch.randint(0, 97, (128,), device=device), torch.randint(0, 97, (128,), device=device)
    fp32_loss = model(ids, pos, cu, 64, targets)
    dtypes = set()
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: dtypes.add(out.dtype))

    def attend(q, k, v, *args, attend=model.attention.attend):
        dtypes.update((q.dtype, k.dtype, v.dtype))
        return attend(q, k, v, *args)

    model.attention.attend = attend
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = model(ids, pos, cu, 64, targets)
        h = model.hidden_states(ids, pos, cu, 64)
    loss.backward()
    assert dtypes == {torch.bfloat16} and h.dtype == torch.bfloat16
    assert loss.dtype == torch.float32
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    torch.testing.assert_close(loss, fp32_loss, rtol=0.02, atol=0)


@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_model_has_no_graph_break_and_no_recompile(autocast):
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = tiny_model(dtype=torch.float32)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    ids, targets = torch.randint(0, 97, (128,)), torch.randint(0, 97, (128,))
    tolerance = 2e-3 if autocast else 1e-4  # bf16 roundings fall in different places once fused
    for lengths in ([128, 0, 0, 0], [10, 50, 60, 8], [1, 1, 1, 125], [64, 64, 0, 0]):
        cu, pos = segments(lengths)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = compiled(ids, pos, cu, 128, targets)
            eager = model(ids, pos, cu, 128, targets)
        loss.backward()
        torch.testing.assert_close(loss, eager, rtol=tolerance, atol=tolerance)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("fusion", ["fused_mlp", "fused_rope_norm", "fused_residual"])
def test_compiled_model_with_fused_products_matches_the_unfused_one(fusion):
    """A compiled d4 GPT under bf16 autocast on a packed 16,384-token buffer: each of the fused products
    (kernels/fused/gemm_hopper.py) gives the unfused model's loss and gradients, with one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    T, V = 16384, 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, V, (T,), device="cuda", generator=gen)
    lengths = [3000, 1, 5000, 2048, T - 10049]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])
    results = []
    for fused in (False, True):
        torch.manual_seed(0)
        unfused = {"fused_mlp": False, "fused_rope_norm": False, "fused_residual": False}
        cfg = ModelConfig(depth=4, **{**unfused, fusion: fused})
        model = GPT(cfg, V, "triton", max_seqlen=8192).cuda()
        with torch.no_grad():  # zero-initialised output projections would leave the blocks' inputs ungraded
            for block in model.blocks:
                block.attn.c_proj.weight.normal_(0, 0.02)
                block.mlp.c_proj.weight.normal_(0, 0.02)
        backend = CompileCounterWithBackend("inductor")
        forward = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(ids, pos, cu, max(lengths), ids.roll(-1))
        loss.backward()
        assert backend.frame_count == 1
        results.append((loss.item(), [p.grad.float() for p in model.parameters()]))
    (loss_plain, grads_plain), (loss_fused, grads_fused) = results
    assert abs(loss_fused - loss_plain) < 1e-3 * abs(loss_plain)
    for a, b in zip(grads_fused, grads_plain, strict=True):
        assert ((a - b).norm() / b.norm()).item() < 3e-2
