"""Generation on the KV cache (model/gpt.py's KVCache, eval/sample.py), checked against recomputing the whole
context with the model's plain forward for every token; scripts/generate.py and bench_generate.py as a user
runs them."""

import json
import os
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from configs.schema import ModelConfig
from data import tokenizer as tok
from eval.sample import generate, generate_tokens, stream_text
from model.gpt import GPT, KVCache
from run.dist import DistInfo, from_rank0
from tests.scripts.test_export import checkpoint, checkpoint_model, run_data, script
from tests.train_helpers import run_train, small_run

VOCAB, MAX_SEQLEN = 97, 24


def tiny_model(device="cpu", attention="reference", **overrides) -> GPT:
    """GQA (4 query heads on 2 K/V heads) and a sliding window of 5 on every other layer."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        **{
            "depth": 2,
            "head_dim": 16,
            "aspect_ratio": 32,
            "n_kv_heads": 2,
            "window_pattern": "SL",
            "short_window": 5,
            **overrides,
        }
    )
    model = GPT(cfg, VOCAB, attention, MAX_SEQLEN)
    with torch.no_grad():  # zero-initialised projections would hide mixing between tokens
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.to(device).eval()


def full_logits(model, context: list[int]) -> torch.Tensor:
    """Logits [n, V] of the context as one document, by the model's plain forward."""
    n = len(context)
    ids = torch.tensor(context, device=model.rotary_cos.device)
    cu = torch.tensor([0, n], dtype=torch.int32, device=ids.device)
    with torch.no_grad():
        return model(ids, torch.arange(n, device=ids.device), cu, n)


def recomputed_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, each from the whole context recomputed (its last max_seqlen tokens, from 0)."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(full_logits(model, ids[-model.max_seqlen :])[-1].argmax()))
    return ids[-n:]


def prompt(n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()


@pytest.mark.parametrize("prompt_len", [1, 10, 30])  # one token, past the short window, past max_seqlen
def test_cached_greedy_generation_equals_recomputation(prompt_len):
    model = tiny_model()
    ids = prompt(prompt_len)
    got = list(generate_tokens(model, ids, 40, temperature=0))  # runs past max_seqlen (24) in every case
    assert got == recomputed_greedy(model, ids, 40)


def check_decode_steps(model, cache: KVCache, tol: float) -> None:
    """Each decode step's logits equal the full forward's at its position, through the short window and to
    the cache's end; and again after a prefill of a shorter prompt, whose decode steps must mask out the
    slots the first sequence left."""
    device = model.rotary_cos.device
    ids = prompt(MAX_SEQLEN)
    want = full_logits(model, ids)

    def tokens(a, b):
        return torch.tensor(ids[a:b], device=device)

    torch.testing.assert_close(model.prefill(tokens(0, 7), cache), want[6], rtol=tol, atol=tol)
    for i in range(7, MAX_SEQLEN):
        got = model.decode(tokens(i, i + 1), cache)
        assert cache.length == i + 1
        torch.testing.assert_close(got, want[i], rtol=tol, atol=tol, msg=f"position {i}")
    with pytest.raises(ValueError, match="exceed the cache's 24 positions"):
        model.decode(tokens(0, 1), cache)
    other = ids[:3] + prompt(5)
    want = full_logits(model, other)
    got = model.prefill(torch.tensor(other[:3], device=device), cache)
    torch.testing.assert_close(got, want[2], rtol=tol, atol=tol)
    assert cache.length == 3
    for i in range(3, len(other)):
        got = model.decode(torch.tensor(other[i : i + 1], device=device), cache)
        torch.testing.assert_close(got, want[i], rtol=tol, atol=tol, msg=f"second prompt, position {i}")


def test_each_decode_steps_logits_equal_the_full_forward():
    model = tiny_model()
    with pytest.raises(ValueError, match="call prefill first"):
        model.decode(torch.tensor([0]), KVCache(model.shape, MAX_SEQLEN))
    with pytest.raises(ValueError, match="outruns max_seqlen=24"):
        model.prefill(torch.tensor([0]), KVCache(model.shape, MAX_SEQLEN + 1))
    check_decode_steps(model, KVCache(model.shape, MAX_SEQLEN), 1e-5)


@pytest.mark.slow
def test_compiled_decode_step_on_cpu():
    """torch.compile's step (no CUDA graph on the CPU): the same logits as the full forward."""
    model = tiny_model()
    check_decode_steps(model, KVCache(model.shape, MAX_SEQLEN, compile=True), 1e-5)


def test_a_reused_cache_generates_as_a_new_one():
    model = tiny_model()
    cache = KVCache(model.shape, MAX_SEQLEN)
    for n in (12, 3):  # the second sequence is shorter: the first one's slots must not leak into it
        ids = prompt(n)
        assert list(generate_tokens(model, ids, 30, temperature=0, cache=cache)) == recomputed_greedy(
            model, ids, 30
        )
    with pytest.raises(ValueError, match="cache's 8 positions are fewer than the 13"):
        list(generate_tokens(model, prompt(3), 10, cache=KVCache(model.shape, 8)))


def test_seeded_sampling_is_reproducible_and_matches_recomputation():
    model = tiny_model()
    ids = prompt(6)
    options = {"temperature": 0.8, "top_k": 10}
    first = list(generate_tokens(model, ids, 30, seed=3, **options))
    assert first == list(generate_tokens(model, ids, 30, seed=3, **options))
    assert first == list(generate_tokens(model, ids, 30, seed=3, cache=False, **options))
    assert first != list(generate_tokens(model, ids, 30, seed=4, **options))


def test_generation_stops_before_the_stop_token():
    model = tiny_model()
    ids = prompt(6)
    greedy = recomputed_greedy(model, ids, 12)
    stop = greedy[8]
    cut = greedy.index(stop)
    assert list(generate_tokens(model, ids, 12, temperature=0, stop_id=stop)) == greedy[:cut]


class RankDependent(torch.nn.Module):
    """A stand-in for a model sharded across ranks: each forward is a collective (an all-reduce, as FSDP's
    weight gathers are), and greedy decoding follows the last token by one on rank 0, by two on rank 1."""

    max_seqlen = MAX_SEQLEN

    def __init__(self, rank: int):
        super().__init__()
        self.step = rank + 1
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, position_ids, cu_seqlens, max_seqlen):
        dist.all_reduce(torch.ones(1))
        logits = torch.zeros(input_ids.numel(), VOCAB)
        logits[-1, (input_ids[-1] + self.step) % VOCAB] = 1.0
        return logits


def generate_on_rank(rank: int, root) -> None:
    init = f"file://{root / 'store'}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    info = DistInfo(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"))
    agree = partial(from_rank0, info=info)
    tokens = generate_tokens(RankDependent(rank), [5], 6, temperature=0, stop_id=8, cache=False, agree=agree)
    (root / f"rank{rank}.json").write_text(json.dumps(list(tokens)))
    dist.barrier()
    os._exit(0)  # without tearing gloo down, as in test_core.py's rank_main


def test_ranks_generating_together_take_rank0s_tokens_and_stop_together(tmp_path):
    """Rank 0 alone would give 6, 7 and stop before 8; rank 1 alone 7, 9, 11, ... and never stop. Taking rank
    0's tokens, both give 6, 7 and run the same forwards (else rank 1's fourth would wait forever)."""
    mp.start_processes(generate_on_rank, args=(tmp_path,), nprocs=2, start_method="spawn")
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [[6, 7], [6, 7]]


@pytest.fixture(scope="module")
def encoding():
    return tok.train_bpe(["naïve café, ok ok ok " * 20], 300)


def test_streamed_text_never_splits_a_character(encoding):
    text = "naïve € 😀 café"
    ids = encoding.encode_ordinary(text)
    pieces = list(stream_text(encoding, ids))
    assert len(pieces) < len(ids)  # € and 😀 span several tokens each: no piece until their last byte
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    broken = ids + encoding.encode_ordinary("€")[:1]  # a character cut short at the end
    assert "".join(stream_text(encoding, broken)) == encoding.decode(broken)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("prompt_len", [1, 10])
def test_cached_greedy_generation_equals_recomputation_on_cuda_bf16(compile, prompt_len):
    """The triton backend under bf16 autocast (on Hopper the prefill takes the fused operators, the decode
    the plain products), eager or compiled and replayed as a CUDA graph: every cached token is the likeliest
    of the logits recomputed from its context, but at a near tie, where bf16 rounding may pick either: both
    sides round differently (the eager step after every operation), a few times 2^-8 of logits up to ~10.
    A slot read or masked wrongly moves logits by whole units; the fp32 test below checks the exact math."""
    model = tiny_model("cuda", "triton", head_dim=64, aspect_ratio=64, n_kv_heads=1)
    ids = prompt(prompt_len)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        cache = KVCache(model.shape, MAX_SEQLEN, compile=compile)
        got = list(generate_tokens(model, ids, 40, temperature=0, cache=cache))
        context = list(ids)
        for token in got:
            logits = full_logits(model, context[-MAX_SEQLEN:])[-1].float()
            assert logits[token] >= logits.max() - 0.25, (len(context), token, int(logits.argmax()))
            context.append(token)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_decode_equals_the_full_forward_on_cuda_fp32():
    """The compiled step replayed from one CUDA graph (captured at the first decode, kept through the
    re-prefills), in fp32 (the reference attention: our kernels take 16-bit inputs): each step's logits are
    the full forward's, and greedy tokens recomputation's (GQA, sliding window, past max_seqlen)."""
    model = tiny_model("cuda", "reference", head_dim=64, aspect_ratio=64, n_kv_heads=1)
    cache = KVCache(model.shape, MAX_SEQLEN, compile=True)
    check_decode_steps(model, cache, 1e-4)
    graph = cache.graph
    assert graph is not None
    for n in (1, 10, 30):
        ids = prompt(n)
        assert list(generate_tokens(model, ids, 40, temperature=0, cache=cache)) == recomputed_greedy(
            model, ids, 40
        )
    assert cache.graph is graph


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A 4-step run (which samples, through eval/sample.py, at its last step) and its export."""
    run_dir = tmp_path_factory.mktemp("generate") / "run"
    run_train(small_run(corpus, run_dir, "max_steps=4", "save_every=4", "eval_every=4", "sample_every=4"))
    out = run_dir.parent / "model.safetensors"
    proc = script("export.py", run_dir, out)
    assert proc.returncode == 0, proc.stderr
    return run_dir, out


def test_generate_script_streams_what_generate_gives(trained):
    run_dir, export = trained
    data = run_data(checkpoint(run_dir, 4))
    model = checkpoint_model(checkpoint(run_dir, 4))
    sampled = generate(model, data.tokenizer, data.bos_id, "ab", 16, top_k=10, seed=7)
    greedy = generate(model, data.tokenizer, data.bos_id, "ab", 16, temperature=0)
    assert sampled.startswith("ab") and len(sampled) > len("ab")
    proc = script("generate.py", export, "--prompt", "ab", "--max-new-tokens", 16, "--top-k", 10, "--seed", 7)
    assert proc.returncode == 0 and proc.stdout == sampled + "\n", proc.stderr
    proc = script("generate.py", run_dir, "--prompt", "ab", "--max-new-tokens", 16, "--temperature", 0)
    assert proc.returncode == 0 and proc.stdout == greedy + "\n", proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{tmp}/nowhere", "--prompt", "a"], "error: {tmp}/nowhere does not exist"),
        (["{tmp}", "--prompt", "a", "--temperature", "-0.5"], "must be at least 0"),
        (["{tmp}", "--prompt", "a"], "error: {tmp} is neither a checkpoint folder nor a run_dir"),
    ],
)
def test_generate_script_errors_are_one_line(tmp_path, args, message):
    proc = script("generate.py", *(a.format(tmp=tmp_path) for a in args))
    message = message.format(tmp=tmp_path)
    assert proc.returncode != 0 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_bench_generate_smoke_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--depths", 1, "--prompt-tokens", 6, "--new-tokens", 4, "--repeats", 1, "--device", "cpu"]
    proc = script("bench_generate.py", *args, "--out", out)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["env"]["device"] == "cpu" and result["env"]["vocab_size"] == 32768
    assert [(r["depth"], r["cache"], r["compiled"]) for r in result["rows"]] == [
        (1, True, False),
        (1, False, False),
    ]
    assert all(r["decode_tokens_per_s"] > 0 and r["agree"] == 4 for r in result["rows"])
    assert "d1: the cache decodes" in proc.stdout
