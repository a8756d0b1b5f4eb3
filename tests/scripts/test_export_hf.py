"""scripts/export_hf.py: the exported transformers model against our GPT (logits on packed documents, the
KV cache, greedy generate()), its tokenizer against our tiktoken encoding, and the script's refusals."""

import contextlib
import copy
import io
import subprocess
import sys
from unittest import mock

import pytest
import safetensors.torch
import torch
from omegaconf import OmegaConf

pytest.importorskip(
    "transformers", reason="the HuggingFace export needs transformers (pip install -e '.[hf]')"
)

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from configs.schema import ModelConfig  # noqa: E402
from data import tokenizer as tok  # noqa: E402
from model.export import save_export  # noqa: E402
from model.gpt import GPT  # noqa: E402
from scripts.export_hf import main as export_main  # noqa: E402
from tests.train_helpers import ROOT  # noqa: E402

MAX_SEQLEN = 64
TEXTS = [
    "def greet(name):\n    return f'Hello, {name}!'  # it's 2024\n",
    "The quick brown fox jumps over the lazy dog. 123456789 café naïve\n\n",
    "Привет мир, 你好世界, こんにちは 🙂 tabs\t\tand   spaces   \r\n",
] * 20
VARIED = [
    "",
    " ",
    "   leading and trailing   ",
    "x = [1, 2, 3]\nfor i in range(10):\n\tprint(i ** 2)\n\n\n",
    "It's, we'll, they've; I'M 'quoted' don't",
    "Ünïcödé: Привет, 你好，世界。 αβγ 🙂🚀 é\u0301",
    "numbers 1 12 123 1234 12345 3.14159e-10",
    "<|bos|> is text here, and so is <|endoftext|>",
    "\n\n\r\n \t \u00a0\u3000 mixed whitespace",
    "zzzzqqqq unseen bytes: \x00\x7f ~`!@#$%^&*()",
]


@pytest.fixture(scope="module")
def encoding():
    return tok.train_bpe(TEXTS, 320)


def export_file(path, enc, seed: int, **model) -> GPT:
    """Our GPT with every weight random (a fresh model's output projections are zero, which would hide
    the blocks), written as an export file; returned in eval mode."""
    cfg = OmegaConf.merge(OmegaConf.structured(ModelConfig), model)
    gpt = GPT(cfg, enc.n_vocab, "reference", MAX_SEQLEN)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in gpt.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        gpt.lm_head.weight.mul_(4)  # spread the logits so the greedy choices are clear
    save_export(
        path, gpt.state_dict(), OmegaConf.to_container(cfg), enc.n_vocab, MAX_SEQLEN, tok.to_json(enc), 7, {}
    )
    return gpt.eval()


def double(model):
    return copy.deepcopy(model).double()


def export_hf(*args) -> tuple[str, str]:
    """scripts/export_hf.py's main() in this process (a new interpreter would spend seconds importing
    torch and transformers): (its output, its error message, empty if it succeeded)."""
    out = io.StringIO()
    with mock.patch.object(sys, "argv", ["export_hf.py", *map(str, args)]), contextlib.redirect_stdout(out):
        try:
            export_main()
        except SystemExit as exit_:
            return out.getvalue(), str(exit_.code)
    return out.getvalue(), ""


# GQA with a 3-token window in the first layer (the last is always full), and plain heads without a cap.
MODELS = {
    "gqa_window": dict(
        depth=2, aspect_ratio=32, head_dim=16, n_kv_heads=2, window_pattern="SL", short_window=3
    ),
    "full_nocap": dict(depth=1, aspect_ratio=32, head_dim=32, logit_softcap=0.0),
}


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request, encoding, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"hf_{request.param}")
    ours = export_file(
        root / "model.safetensors", encoding, seed=list(MODELS).index(request.param), **MODELS[request.param]
    )
    stdout, error = export_hf(root / "model.safetensors", root / "hf")
    assert not error and f"wrote {root / 'hf'}: step 7 of" in stdout, error
    hf = AutoModelForCausalLM.from_pretrained(root / "hf", trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "hf", trust_remote_code=True)
    return ours, hf, tokenizer, root / "hf"


def documents(bos_id: int, lengths, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.cat([torch.tensor([bos_id]), torch.randint(0, bos_id, (n - 1,), generator=gen)])
        for n in lengths
    ]


def packed_logits(model: GPT, docs) -> list[torch.Tensor]:
    """Our logits of the documents packed in one buffer (the batch contract), split back per document."""
    lengths = [len(d) for d in docs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        logits = model(torch.cat(docs), positions, cu, max(lengths))
    return list(logits.split(lengths))


def padded(docs, pad_id: int, side: str):
    width = max(len(d) for d in docs)
    ids = torch.full((len(docs), width), pad_id)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    spans = []
    for row, d in enumerate(docs):
        span = slice(0, len(d)) if side == "right" else slice(width - len(d), width)
        ids[row, span], mask[row, span] = d, 1
        spans.append(span)
    return ids, mask, spans


def test_export_folder_holds_our_weights_and_config(exported, encoding):
    ours, hf, _, out = exported
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert {"modeling_varlen_gpt.py", "configuration_varlen_gpt.py"} <= names
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".hf")]  # the staging folder is gone
    fresh = out.parent / "fresh"
    fresh.touch()  # every file gets a new file's mode (safetensors alone would write 0600)
    assert {p.stat().st_mode for p in out.iterdir()} == {fresh.stat().st_mode}
    # The code runs from the folder alone: it imports nothing of ours.
    for name in ("modeling_varlen_gpt.py", "configuration_varlen_gpt.py"):
        imports = [
            line for line in (out / name).read_text().splitlines() if line.startswith(("import", "from"))
        ]
        assert all(line.split()[1].split(".")[0] in ("torch", "transformers", "") for line in imports), (
            imports
        )
    weights = safetensors.torch.load_file(out / "model.safetensors")
    want = ours.state_dict()
    assert weights.keys() == want.keys()
    v = encoding.n_vocab
    for name, t in weights.items():
        expected = want[name][:v] if name in ("wte.weight", "lm_head.weight") else want[name]
        assert torch.equal(t, expected), name
    assert hf.config.vocab_size == v and hf.config.max_position_embeddings == MAX_SEQLEN
    assert hf.config.layer_windows == [b.attn.window for b in ours.blocks]
    assert hf.config.bos_token_id == hf.config.eos_token_id == encoding.encode_single_token(tok.BOS)


@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_equal_ours_on_packed_documents(exported, side):
    ours, hf, _, _ = exported
    bos = hf.config.bos_token_id
    docs = documents(bos, [5, 17, 33, MAX_SEQLEN, 1])
    want = packed_logits(ours, docs)
    ids, mask, spans = padded(docs, bos, side)
    with torch.no_grad():
        got = hf(input_ids=ids, attention_mask=mask).logits
    assert got.dtype == torch.float32 and got.shape[-1] == ours.shape.vocab_size
    for row, span in enumerate(spans):
        torch.testing.assert_close(got[row, span], want[row], rtol=1e-5, atol=1e-5)


def test_logits_equal_ours_in_float64(exported):
    """In float64 the two differ only by rounding: the same math, step for step."""
    ours, hf, _, _ = exported
    bos = hf.config.bos_token_id
    docs = documents(bos, [9, 40, 2], seed=1)
    ours64, hf64 = double(ours), double(hf)
    want = packed_logits(ours64, docs)
    ids, mask, spans = padded(docs, bos, "left")
    with torch.no_grad():
        got = hf64(input_ids=ids, attention_mask=mask).logits
    for row, span in enumerate(spans):
        torch.testing.assert_close(got[row, span], want[row], rtol=1e-10, atol=1e-10)


def test_loss_with_labels_is_ours(exported):
    ours, hf, _, _ = exported
    (doc,) = documents(hf.config.bos_token_id, [30], seed=2)
    targets = torch.cat([doc[1:], torch.tensor([-1])])
    with torch.no_grad():
        want = ours(doc, torch.arange(30), torch.tensor([0, 30], dtype=torch.int32), 30, targets=targets)
        got = hf(input_ids=doc[None], labels=doc[None]).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_cache_gives_the_logits_of_one_pass(exported):
    """Prefill, then one token at a time through the cache (past the 3-token window), as generate() runs."""
    _, hf, _, _ = exported
    hf64 = double(hf)
    bos = hf.config.bos_token_id
    docs = documents(bos, [12, 7], seed=3)
    ids, mask, _ = padded(docs, bos, "left")
    with torch.no_grad():
        full = hf64(input_ids=ids, attention_mask=mask).logits
        out = hf64(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
        steps = [out.logits]
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        for t in range(4, ids.shape[1]):
            out = hf64(
                input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache, use_cache=True
            )
            steps.append(out.logits)
        assert cache.get_seq_length() == ids.shape[1]
    stepped = torch.cat(steps, dim=1)
    torch.testing.assert_close(stepped[mask.bool()], full[mask.bool()], rtol=1e-10, atol=1e-10)


def greedy_ours(model: GPT, prompt: list[int], new_tokens: int, stop_id: int) -> list[int]:
    """Greedy decoding with our model, re-reading the whole document each step (no cache)."""
    ids = list(prompt)
    for _ in range(new_tokens):
        n = len(ids)
        with torch.no_grad():
            logits = model(torch.tensor(ids), torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n)
        ids.append(int(logits[-1].argmax()))
        if ids[-1] == stop_id:
            break
    return ids[len(prompt) :]


def test_generate_gives_our_greedy_tokens(exported, encoding):
    ours, hf, tokenizer, _ = exported
    prompts = ["def greet(name):", "The quick", "x"]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    new_tokens = 24
    with torch.no_grad():
        generated = hf.generate(**batch, do_sample=False, max_new_tokens=new_tokens, use_cache=True)
    bos = hf.config.bos_token_id
    for row, prompt in enumerate(prompts):
        want = greedy_ours(ours, [bos, *encoding.encode_ordinary(prompt)], new_tokens, stop_id=bos)
        got = generated[row, batch.input_ids.shape[1] :].tolist()
        # generate() stops a row at <|bos|> (the end of a document) and pads the rest with it.
        assert got[: len(want)] == want and all(t == bos for t in got[len(want) :]), (prompt, got, want)


def test_tokenizer_gives_our_ids(exported, encoding):
    tokenizer = exported[2]
    bos = encoding.encode_single_token(tok.BOS)
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == bos and len(tokenizer) == encoding.n_vocab
    for text in VARIED + TEXTS[:3]:
        want = encoding.encode_ordinary(text)
        assert tokenizer.encode(text, add_special_tokens=False) == want, text
        assert tokenizer(text).input_ids == [bos, *want], text  # starts with <|bos|>, as our documents
        assert tokenizer.decode(want) == encoding.decode(want) == text


def test_export_refuses_a_non_empty_out_dir(encoding, tmp_path):
    source = tmp_path / "model.safetensors"
    export_file(source, encoding, seed=0, **MODELS["full_nocap"])
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert (
        export_hf(source, taken)[1]
        == f"error: {taken} already exists and is not an empty folder: give a new OUT_DIR"
    )
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_hf(source, empty)[1] == ""
    assert (empty / "model.safetensors").is_file() and (empty / "tokenizer.json").is_file()


def test_export_names_a_bad_source(tmp_path):
    foreign = tmp_path / "foreign.safetensors"
    safetensors.torch.save_file({"weight": torch.zeros(4)}, foreign)
    assert export_hf(foreign, tmp_path / "out")[1].startswith(
        f"error: {foreign} is a safetensors file but not a varlen-gpt"
    )
    folder = tmp_path / "not_a_run"
    folder.mkdir()
    assert "neither a checkpoint folder nor a run_dir" in export_hf(folder, tmp_path / "out")[1]
    assert not (tmp_path / "out").exists()
    # As a user runs it: a clear message, no traceback.
    missing = tmp_path / "missing"
    proc = subprocess.run(
        [sys.executable, "scripts/export_hf.py", missing, tmp_path / "out"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        == f"error: {missing} does not exist (an export file, checkpoint folder or run_dir)"
    )
