"""The `fa4` attention backend (model/fa4.py): FlashAttention-4 as torch custom ops.

On any machine: the start-up errors, and the wrapper itself (arguments, fake implementations, autograd,
compiling as one graph) over a stand-in for FA4's two functions that computes attention in float64 by
FA4's conventions. On a CUDA GPU of sm90 or later with flash-attn-4 installed (`-m gpu`): the real FA4
in bf16 against the fp32 `reference` backend, its deterministic backward, and a compiled model.
"""

import math
import os
import sys
import types
from contextlib import contextmanager

import pytest
import torch

from configs.schema import ConfigError, ModelConfig
from model.attention import Attention, check_backend
from model.gpt import GPT
from tests.train_helpers import run_train, small_run


def fa4_runs_here() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:
        return False
    return True


needs_fa4 = pytest.mark.skipif(
    not fa4_runs_here(), reason="needs flash-attn-4 and a CUDA GPU of sm90 or later"
)


def packed(lengths: list[int], max_num_docs: int, device="cpu") -> torch.Tensor:
    """cu_seqlens of documents of these lengths, padded with zero-length documents to max_num_docs, as
    the loader hands them to the model."""
    ends = torch.tensor(lengths).cumsum(0).tolist()
    padding = [ends[-1]] * (max_num_docs - len(lengths))
    return torch.tensor([0, *ends, *padding], dtype=torch.int32, device=device)


def positions(lengths: list[int], device="cpu") -> torch.Tensor:
    return torch.cat([torch.arange(n, device=device) for n in lengths])


def qkv(T, heads, kv_heads, d, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [
        torch.randn(T, h, d, device=device, generator=gen).to(torch.bfloat16)
        for h in (heads, kv_heads, kv_heads)
    ]


def out_and_grads(attention: Attention, q, k, v, cu, max_seqlen, window, dout):
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    ctx = attention.prepare(cu, max_seqlen, q.shape[0])
    out = attention.attend(*inputs, ctx, window)
    return (out.detach(), *torch.autograd.grad(out, inputs, dout))


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


@contextmanager
def deterministic_algorithms():
    """As run/determinism.py sets them for deterministic=true, and back."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill


# Start-up errors.


def test_check_backend_without_flash_attn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn.cute raises ImportError
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    with pytest.raises(ConfigError) as err:
        check_backend("fa4", torch.device("cpu"))
    message = str(err.value)
    assert message.startswith("attention=fa4 cannot run here")
    assert "flash_attn.cute does not import" in message and "pip install 'flash-attn-4==4.0.0b36'" in message
    assert "this run is on cpu" in message


def stand_in_modules(monkeypatch, interface: types.ModuleType | None = None) -> None:
    package = types.ModuleType("flash_attn")
    package.cute = types.ModuleType("flash_attn.cute")
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", package.cute)
    if interface is not None:
        package.cute.interface = interface
        monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)


def test_check_backend_with_flash_attn_refuses_cpu_and_gpus_before_sm90(monkeypatch):
    stand_in_modules(monkeypatch)
    with pytest.raises(ConfigError, match="this run is on cpu") as err:
        check_backend("fa4", torch.device("cpu"))
    assert "install" not in str(err.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(ConfigError, match=r"compute capability 9\.0 or later .*this one is 8\.6"):
        check_backend("fa4", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    check_backend("fa4", torch.device("cuda"))  # Blackwell: accepted


def test_train_with_fa4_where_flash_attn_does_not_import_stops_before_any_work(tmp_path, corpus):
    shadow = tmp_path / "shadow" / "flash_attn"  # first on the path: flash_attn fails to import here
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('flash-attn-4 hidden by the test')\n")
    path = os.pathsep.join(p for p in (str(shadow.parent), os.environ.get("PYTHONPATH")) if p)
    proc = run_train(
        small_run(corpus, tmp_path / "run", "attention=fa4"),
        check=False,
        timeout=120,
        env_extra={"PYTHONPATH": path},
    )
    assert proc.returncode != 0
    assert "error: attention=fa4 cannot run here: flash_attn.cute does not import" in proc.stderr
    assert "flash-attn-4 hidden by the test" in proc.stderr and "pip install" in proc.stderr
    assert "data:" not in proc.stdout and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


# The wrapper, over a stand-in for FA4's functions.


class StandIn:
    """`_flash_attn_fwd` and `_flash_attn_bwd` of flash_attn/cute/interface.py (4.0.0b36) for the calls
    model/fa4.py makes: varlen over shared cu_seqlens, causal, window_size_left None for unbounded; out
    [T, H, D] and lse [H, T] float32, and (dq, dk, dv). Float64 math one document at a time, with the
    backward written out; every call's keyword arguments are kept in `calls`."""

    def __init__(self):
        self.calls = []

    def module(self) -> types.ModuleType:
        interface = types.ModuleType("flash_attn.cute.interface")
        interface._flash_attn_fwd, interface._flash_attn_bwd = self.fwd, self.bwd
        return interface

    def probs(self, q, k, cu, scale, window_left):
        """Per document: (start, end, P [H, L, L], lse [H, L]) in float64, K/V heads shared by groups."""
        group = q.shape[1] // k.shape[1]
        bounds = cu.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if end == start:
                continue
            qd = q[start:end].double().transpose(0, 1)
            kd = k[start:end].double().transpose(0, 1).repeat_interleave(group, 0)
            i = torch.arange(end - start)
            visible = i[:, None] >= i[None, :]
            if window_left is not None:
                visible &= i[:, None] - i[None, :] <= window_left
            s = (qd @ kd.transpose(1, 2) * scale).masked_fill(~visible, -math.inf)
            lse = s.logsumexp(-1)
            yield start, end, (s - lse[..., None]).exp(), lse

    def check(self, q, k, v, cu, causal):
        assert causal and cu.dtype == torch.int32 and cu.stride(0) == 1
        assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16)
        assert k.shape == v.shape and k.shape[0] == q.shape[0] and q.shape[1] % k.shape[1] == 0

    def fwd(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size_left, **kw):
        self.calls.append({"fn": "fwd", "window_size_left": window_size_left, **kw})
        self.check(q, k, v, cu_seqlens_q, causal)
        assert cu_seqlens_k is cu_seqlens_q and kw["return_lse"]
        group = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
        for start, end, p, row_lse in self.probs(q, k, cu_seqlens_q, softmax_scale, window_size_left):
            vd = v[start:end].double().transpose(0, 1).repeat_interleave(group, 0)
            out[start:end] = (p @ vd).transpose(0, 1)
            lse[:, start:end] = row_lse
        return out.to(q.dtype), lse.float(), None, None, None

    def bwd(self, q, k, v, out, dout, lse, softmax_scale, causal, *, window_size_left, cu_seqlens_q, **kw):
        self.calls.append({"fn": "bwd", "window_size_left": window_size_left, **kw})
        self.check(q, k, v, cu_seqlens_q, causal)
        H, group = q.shape[1], q.shape[1] // k.shape[1]
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v))
        dlse = kw["dlse"]
        for start, end, p, _ in self.probs(q, k, cu_seqlens_q, softmax_scale, window_size_left):
            qd, kd, vd = (x[start:end].double().transpose(0, 1) for x in (q, k, v))
            kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
            do = dout[start:end].double().transpose(0, 1)
            o = out[start:end].double().transpose(0, 1)
            ds = p * (do @ vd.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
            if dlse is not None:
                ds += p * dlse[:, start:end, None].double()
            dq[start:end] = (ds @ kd * softmax_scale).transpose(0, 1)
            # Each K/V head's gradient sums over the query heads of its group.
            dk_h = (ds.transpose(1, 2) @ qd * softmax_scale).view(H // group, group, end - start, -1).sum(1)
            dv_h = (p.transpose(1, 2) @ do).view(H // group, group, end - start, -1).sum(1)
            dk[start:end], dv[start:end] = dk_h.transpose(0, 1), dv_h.transpose(0, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.fixture
def stand_in(monkeypatch):
    fa4 = StandIn()
    stand_in_modules(monkeypatch, fa4.module())
    return fa4


@pytest.mark.parametrize(("window", "kv_heads"), [(-1, 4), (-1, 2), (5, 4), (5, 1)])
def test_wrapper_matches_reference_backend_on_padded_documents(stand_in, window, kv_heads):
    lengths, max_seqlen = [7, 1, 30, 22, 4, 32], 32
    cu = packed(lengths, max_num_docs=10)
    T = sum(lengths)
    q, k, v = qkv(T, 4, kv_heads, 16)
    dout = torch.randn(T, 4, 16).to(torch.bfloat16)
    got = out_and_grads(Attention("fa4", [window], 16), q, k, v, cu, max_seqlen, window, dout)
    fp32 = [x.float() for x in (q, k, v, dout)]
    want = out_and_grads(Attention("reference", [window], 16), *fp32[:3], cu, max_seqlen, window, fp32[3])
    for name, x, ref in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert x.dtype == torch.bfloat16 and x.shape == ref.shape
        assert rel_err(x, ref) < 1e-2, name
    fwd, bwd = stand_in.calls
    assert fwd["fn"] == "fwd" and bwd["fn"] == "bwd"
    for call in (fwd, bwd):
        assert call["window_size_left"] == (None if window < 0 else window)
        assert call["max_seqlen_q"] == call["max_seqlen_k"] == max_seqlen
    assert bwd["deterministic"] is False


def test_wrapper_asks_for_the_deterministic_backward_in_deterministic_mode(stand_in):
    cu = packed([20, 12], max_num_docs=4)
    q, k, v = qkv(32, 2, 2, 16)
    attention = Attention("fa4", [-1], 16)
    with deterministic_algorithms():
        out_and_grads(attention, q, k, v, cu, 20, -1, torch.ones(32, 2, 16, dtype=torch.bfloat16))
    out_and_grads(attention, q, k, v, cu, 20, -1, torch.ones(32, 2, 16, dtype=torch.bfloat16))
    assert [c["deterministic"] for c in stand_in.calls if c["fn"] == "bwd"] == [True, False]


def test_wrapper_refuses_fp32():
    q = torch.zeros(8, 2, 16)
    with pytest.raises(ValueError, match="attention=fa4 takes bf16 or fp16"):
        Attention("fa4", [-1], 16).attend(q, q, q, {"cu_seqlens": packed([8], 2), "max_seqlen": 8}, -1)


def test_compiled_model_with_the_wrapper_has_one_graph_and_the_reference_loss(stand_in):
    """A GPT with attention=fa4 under torch.compile(fullgraph=True, dynamic=False) and bf16 autocast: two
    steps over other document boundaries compile once, and give the reference backend's losses and
    gradients (the stand-in's math behind the custom ops)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = ModelConfig(
        depth=2, head_dim=16, aspect_ratio=32, n_kv_heads=2, window_pattern="SL", short_window=9
    )
    models = {}
    for name in ("fa4", "reference"):
        torch.manual_seed(0)
        models[name] = GPT(cfg, vocab_size=97, attention=name, max_seqlen=64)
        with torch.no_grad():  # zero-initialised projections would hide attention's gradients
            for p in models[name].parameters():
                p.normal_(0, 0.3)
    compiled = torch.compile(models["fa4"], fullgraph=True, dynamic=False)
    ids, targets = torch.randint(0, 97, (128,)), torch.randint(0, 97, (128,))
    for lengths in ([40, 1, 60, 27], [64, 64]):
        cu, pos = packed(lengths, max_num_docs=6), positions(lengths)
        losses = []
        for model, forward in ((models["fa4"], compiled), (models["reference"], models["reference"])):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = forward(ids, pos, cu, 64, targets)
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-2 * abs(losses[1])
        for a, b in zip(models["fa4"].parameters(), models["reference"].parameters(), strict=True):
            assert rel_err(a.grad, b.grad) < 3e-2
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    assert sum(c["fn"] == "fwd" for c in stand_in.calls) == 2 * 2  # two layers, two steps: FA4 ran


# The real FlashAttention-4 on the GPU.

T_GPU = 8192
# Documents up to max_seqlen, one of length 1, and zero-length documents padding cu_seqlens to 16.
LENGTHS_GPU = [2048, 1, 1500, 2047, 700, 129, 1767]
CASES = [(128, 8, -1), (128, 2, -1), (128, 8, 256), (64, 2, 256)]  # head dim, kv heads (of 8), window


@pytest.mark.parametrize(("d", "kv_heads", "window"), CASES, ids=[f"d{d}-kv{kv}-w{w}" for d, kv, w in CASES])
@pytest.mark.gpu
@needs_fa4
def test_fa4_matches_fp32_reference_backend(d, kv_heads, window):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    assert sum(LENGTHS_GPU) == T_GPU
    cu = packed(LENGTHS_GPU, max_num_docs=16, device="cuda")
    q, k, v = qkv(T_GPU, 8, kv_heads, d, device="cuda")
    dout = torch.randn(T_GPU, 8, d, device="cuda").to(torch.bfloat16)
    got = out_and_grads(Attention("fa4", [window], d), q, k, v, cu, 2048, window, dout)
    with sdpa_kernel(SDPBackend.MATH):  # fp32 products, no reduced-precision fused kernel
        reference = Attention("reference", [window], d)
        want = out_and_grads(reference, q.float(), k.float(), v.float(), cu, 2048, window, dout.float())
    errors = [rel_err(x, ref) for x, ref in zip(got, want, strict=True)]
    assert all(x.isfinite().all() for x in got)
    assert errors[0] < 1e-2 and max(errors[1:]) < 2e-2, errors


@pytest.mark.gpu
@needs_fa4
def test_fa4_backward_is_bitwise_deterministic_in_deterministic_mode():
    cu = packed(LENGTHS_GPU, max_num_docs=16, device="cuda")
    q, k, v = qkv(T_GPU, 8, 2, 128, device="cuda")
    dout = torch.randn(T_GPU, 8, 128, device="cuda").to(torch.bfloat16)
    attention = Attention("fa4", [-1], 128)
    with deterministic_algorithms():
        first = out_and_grads(attention, q, k, v, cu, 2048, -1, dout)
        for _ in range(3):
            again = out_and_grads(attention, q, k, v, cu, 2048, -1, dout)
            assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.gpu
@needs_fa4
def test_compiled_model_with_fa4_has_one_graph_and_the_reference_loss():
    """A d4 GPT (4 heads of 64, 2 K/V heads, windows SL) with attention=fa4, compiled with
    fullgraph=True, dynamic=False under bf16 autocast: two training steps over other document boundaries
    compile once and give the reference backend's losses and gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    V = 4096
    cfg = ModelConfig(depth=4, head_dim=64, n_kv_heads=2, window_pattern="SL", short_window=256)
    models = {}
    for name in ("fa4", "reference"):
        torch.manual_seed(0)
        models[name] = GPT(cfg, V, attention=name, max_seqlen=2048).cuda()
        with torch.no_grad():  # zero-initialised output projections would leave the blocks' inputs ungraded
            for block in models[name].blocks:
                block.attn.c_proj.weight.normal_(0, 0.02)
                block.mlp.c_proj.weight.normal_(0, 0.02)
    backend = CompileCounterWithBackend("inductor")
    compiled = torch.compile(models["fa4"], backend=backend, fullgraph=True, dynamic=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, V, (T_GPU,), device="cuda", generator=gen)
    for lengths in (LENGTHS_GPU, [1024] * 6 + [2048]):
        cu, pos = packed(lengths, max_num_docs=16, device="cuda"), positions(lengths, device="cuda")
        losses = []
        for model, forward in ((models["fa4"], compiled), (models["reference"], models["reference"])):
            model.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward(ids, pos, cu, 2048, ids.roll(-1))
            loss.backward()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-3 * abs(losses[1])
        for a, b in zip(models["fa4"].parameters(), models["reference"].parameters(), strict=True):
            assert rel_err(a.grad, b.grad) < 3e-2
    assert backend.frame_count == 1
    assert not counters["graph_break"]
