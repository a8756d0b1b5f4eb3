"""Continue a prompt with a trained model, streaming the text as the tokens come (eval/sample.py, on the KV
cache), as train.py samples during a run.

    python scripts/generate.py SOURCE --prompt "def " [--max-new-tokens 64 --temperature 0.8 --top-k 50]
        [--seed 0 --device auto]

SOURCE is an export (scripts/export.py), a checkpoint folder or a run_dir (its newest valid checkpoint).
Temperature 0 is greedy. The same model, prompt, settings and seed on the same device give the same text.
"""

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from configs.schema import ConfigError  # noqa: E402
from data import DataError  # noqa: E402
from data import tokenizer as tok  # noqa: E402
from eval.sample import generate_tokens, stream_text  # noqa: E402
from model.export import ExportInvalid, load_model  # noqa: E402
from model.gpt import KVCache  # noqa: E402
from run.checkpoint import CheckpointInvalid  # noqa: E402
from run.dist import resolve_device  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("source", type=Path, help="an export file, a checkpoint folder or a run_dir")
    parser.add_argument("--prompt", required=True, help="the text to continue (a document's beginning)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="at most this many new tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0: all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = parser.parse_args()
    if args.max_new_tokens < 0 or args.temperature < 0 or args.top_k < 0:
        sys.exit("error: --max-new-tokens, --temperature and --top-k must be at least 0")
    if not args.source.exists():
        sys.exit(f"error: {args.source} does not exist")
    try:
        device = resolve_device(args.device)
        model, enc, _ = load_model(args.source, device)
    except (ConfigError, ExportInvalid, CheckpointInvalid, DataError) as err:
        sys.exit(f"error: {err}")
    bos_id = enc.encode_single_token(tok.BOS)
    ids = [bos_id] + enc.encode_ordinary(args.prompt)
    # On a GPU the decode step is compiled and replayed as a CUDA graph (a few seconds to capture, then one
    # launch per token); on the CPU compiling costs more than the few tokens a user asks for.
    needed = min(model.max_seqlen, len(ids) + args.max_new_tokens)
    cache = KVCache(model.shape, needed, compile=device.type == "cuda")
    new = generate_tokens(
        model,
        ids,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        seed=args.seed,
        stop_id=bos_id,
        cache=cache,
    )

    def tokens():
        yield from ids[1:]
        yield from new

    # As train.py: bf16 autocast on the GPU, fp32 on the CPU.
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with autocast:
        for piece in stream_text(enc, tokens()):
            print(piece, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
