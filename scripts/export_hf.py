"""Export a model as a transformers folder: it loads with AutoModelForCausalLM and AutoTokenizer
(trust_remote_code=True) and runs lm-evaluation-harness's `hf` model. Needs `pip install -e '.[hf]'`.

    python scripts/export_hf.py runs/default hf_model                 # a run_dir's newest valid checkpoint
    python scripts/export_hf.py model.safetensors hf_model            # or an export, or a checkpoint folder

OUT_DIR gets model.safetensors (the real vocabulary's rows of the embedding and head), config.json and
generation_config.json, the model's code (model/hf/: configuration_varlen_gpt.py, modeling_varlen_gpt.py)
and the tokenizer (tokenizer.json, tokenizer_config.json): our BPE as a `tokenizers` byte-level BPE with the
same split pattern, ranks and ids, which starts every text with <|bos|> as our documents start. <|bos|> is
also the end-of-text token, as a document ends where the next one's <|bos|> would be. The folder is built
next to OUT_DIR and renamed into place; OUT_DIR must not exist or be empty.
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tiktoken  # noqa: E402
import torch  # noqa: E402

from data import DataError  # noqa: E402
from data import tokenizer as tok  # noqa: E402
from kernels.fused import RMS_EPS  # noqa: E402
from model.export import ExportInvalid, load_model  # noqa: E402
from model.gpt import GPT  # noqa: E402
from run.checkpoint import CheckpointInvalid  # noqa: E402

# Checked after conversion: the transformers tokenizer must give our ids on it (letters of several
# scripts, digit runs, contractions, whitespace runs and newlines, code, a special token's text).
PROBE = (
    "Hello world! It's 2024: we'll see 1234567 items.\n\n\tdef f(x):\n        return x**2  # café, naïve\r\n"
    "Привет, мир. 你好，世界。 こんにちは 🙂🚀  <|bos|> tabs\t\tand   spaces   \n"
)


def check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportInvalid(f"{out} already exists and is not an empty folder: give a new OUT_DIR")
    if not out.parent.is_dir():
        raise ExportInvalid(f"{out}'s parent folder {out.parent} does not exist")


def hf_config(model: GPT, bos_id: int, max_seqlen: int):
    from model.hf.configuration_varlen_gpt import VarlenGPTConfig

    s = model.shape
    return VarlenGPTConfig(
        vocab_size=s.vocab_size,
        hidden_size=s.n_embd,
        num_hidden_layers=s.n_layer,
        num_attention_heads=s.n_head,
        num_key_value_heads=s.n_kv_head,
        head_dim=s.head_dim,
        layer_windows=[block.attn.window for block in model.blocks],
        rope_base=model.rope_base,
        logit_softcap=model.logit_softcap,
        rms_norm_eps=RMS_EPS,
        max_position_embeddings=max_seqlen,
        bos_token_id=bos_id,
        eos_token_id=bos_id,
        pad_token_id=bos_id,
        architectures=["VarlenGPTForCausalLM"],
    )


def hf_state(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under the same names; the embedding and head keep only the real vocabulary's rows (the
    padded rows' logits are dropped by our model too)."""
    v = model.shape.vocab_size
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    state["wte.weight"], state["lm_head.weight"] = (
        state["wte.weight"][:v].clone(),
        state["lm_head.weight"][:v].clone(),
    )
    return state


def hf_tokenizer(enc: tiktoken.Encoding, max_seqlen: int):
    """Our tiktoken BPE as a transformers fast tokenizer with the same ids. Merges are listed in the order
    of the ranks of the tokens they make, which is the order tiktoken merges in; `ignore_merges` takes a
    whole split piece that is in the vocabulary as one token, as tiktoken does. Special tokens' text is
    split as ordinary text (tiktoken's encode_ordinary, which our data and sampling use)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_char = bytes_to_unicode()  # byte-level BPE spells each byte as one printable character

    def spell(piece: bytes) -> str:
        return "".join(to_char[b] for b in piece)

    ranks = enc._mergeable_ranks
    vocab = {spell(piece): rank for piece, rank in ranks.items()}
    merges = sorted(
        (rank, ranks[piece[:i]], spell(piece[:i]), spell(piece[i:]))
        for piece, rank in ranks.items()
        for i in range(1, len(piece))
        if piece[:i] in ranks and piece[i:] in ranks
    )
    specials = sorted(enc._special_tokens.items(), key=lambda item: item[1])
    vocab.update(specials)  # at their own ids: a named encoding's special ids may leave gaps
    backend = Tokenizer(models.BPE(vocab, [(a, b) for *_, a, b in merges], ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(enc._pat_str), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    bos_id = enc.encode_single_token(tok.BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{tok.BOS} $A", pair=f"{tok.BOS} $A {tok.BOS} $B", special_tokens=[(tok.BOS, bos_id)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tok.BOS,
        eos_token=tok.BOS,
        pad_token=tok.BOS,
        add_bos_token=True,
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids, which generate() refuses
    )
    got, want = hf.encode(PROBE, add_special_tokens=False), enc.encode_ordinary(PROBE)
    if got != want:
        raise ExportInvalid(f"the converted tokenizer gives other ids than ours: {got} against {want}")
    return hf


def write(model: GPT, enc: tiktoken.Encoding, max_seqlen: int, out: Path) -> None:
    """Build the folder next to `out`, then rename it into place: `out` is whole or absent."""
    from model.hf.configuration_varlen_gpt import VarlenGPTConfig
    from model.hf.modeling_varlen_gpt import VarlenGPTForCausalLM

    config = hf_config(model, enc.encode_single_token(tok.BOS), max_seqlen)
    with torch.device("meta"):  # no memory and no init: every weight is assigned below
        hf_model = VarlenGPTForCausalLM(config)
    hf_model.load_state_dict(hf_state(model), strict=True, assign=True)
    # Registered, save_pretrained copies the two files of model/hf/ and writes config.json's auto_map.
    VarlenGPTConfig.register_for_auto_class()
    VarlenGPTForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    tokenizer = hf_tokenizer(enc, max_seqlen)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        # save_pretrained writes the weights 0600 (safetensors); the folder is for sharing, so every file
        # gets the mode a new file here gets (0666 less the umask), read off an empty file made first.
        probe = tmp / "probe"
        probe.touch()
        mode = probe.stat().st_mode
        probe.unlink()
        hf_model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for path in tmp.iterdir():
            path.chmod(mode)
        os.replace(tmp, out)  # replaces an empty folder too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path, help="an export file, a checkpoint folder or a run_dir")
    parser.add_argument("out", type=Path, help="the folder to write (absent or empty)")
    args = parser.parse_args()
    try:
        if not args.source.exists():
            raise ExportInvalid(
                f"{args.source} does not exist (an export file, checkpoint folder or run_dir)"
            )
        check_out_dir(args.out)
        try:
            import tokenizers  # noqa: F401
            import transformers  # noqa: F401
        except ImportError as err:
            raise ExportInvalid(f"{err.name} is not installed: pip install -e '.[hf]'") from None
        model, enc, meta = load_model(args.source)
        write(model, enc, meta["max_seqlen"], args.out)
    except (CheckpointInvalid, DataError, ExportInvalid) as err:
        sys.exit(f"error: {err}")
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: step {meta['step']} of {args.source}, {params:,} parameters")


if __name__ == "__main__":
    main()
