"""Sample a continuation of a prompt from an export (scripts/export.py), as train.py samples during a run.

    python scripts/sample.py model.safetensors --prompt "def " --tokens 64 --seed 0 [--temperature 0.8]

The same export, prompt, settings and seed on the same device give the same text.
"""

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from configs.schema import ConfigError  # noqa: E402
from data import tokenizer as tok  # noqa: E402
from eval.sample import generate  # noqa: E402
from model.export import ExportInvalid, load_export  # noqa: E402
from run.dist import resolve_device  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("export", type=Path, help="a .safetensors file written by scripts/export.py")
    parser.add_argument("--prompt", required=True, help="the text to continue (a document's beginning)")
    parser.add_argument("--tokens", type=int, default=48, help="at most this many new tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens; 0: all")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    args = parser.parse_args()
    if args.tokens < 0 or args.temperature <= 0 or args.top_k < 0:
        parser.error("--tokens and --top-k must be at least 0 and --temperature above 0")
    try:
        device = resolve_device(args.device)
        model, enc, _ = load_export(args.export, device)
    except (ConfigError, ExportInvalid) as err:
        sys.exit(f"error: {err}")
    # As train.py: bf16 autocast on the GPU, fp32 on the CPU.
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    with autocast:
        text = generate(
            model,
            enc,
            enc.encode_single_token(tok.BOS),
            args.prompt,
            args.tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            seed=args.seed,
        )
    print(text)


if __name__ == "__main__":
    main()
