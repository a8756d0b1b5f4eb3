"""Generation speed with and without the KV cache: greedy decode tokens/s per model depth.

    python scripts/bench_generate.py --depths 12 20 [--prompt-tokens 512 --new-tokens 256 --warmup 1
        --repeats 3 --device auto --out FILE.json]

For each depth, a randomly initialised GPT (the depth's default config, as configs/model/d<depth>.yaml; the
real vocabulary of 32,768 and max_seqlen 2048; the device's attention backend; bf16 autocast on CUDA)
continues a random prompt of P tokens by N greedy tokens through eval/sample.py's generate_tokens: on the
cache (prefill, then one decode step per token; on CUDA the compiled step replayed as a CUDA graph, the
cache of P + N positions made once and reused by every generation), and recomputing the whole context for
every token. Each token's time is taken as generate_tokens yields it (the pick waits for the device).
Decode tokens/s is (N - 1) / (time of the N-th token - time of the first), so the prompt's own pass is left
out; the times are medians of the repeats, after warmup generations (which compile). `agree` counts the
leading tokens both ways give alike (bf16 rounding may part them at a near tie). The table goes to
benchmarks/generate_<device>.json (h100, h200, ..., cpu) or to --out.
"""

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from configs.schema import ConfigError, ModelConfig  # noqa: E402
from eval.metrics import device_slug  # noqa: E402
from eval.sample import generate_tokens  # noqa: E402
from model.attention import default_backend  # noqa: E402
from model.gpt import GPT, KVCache  # noqa: E402
from run.dist import resolve_device  # noqa: E402

VOCAB_SIZE, MAX_SEQLEN = 32768, 2048


def timed(model, prompt: list[int], new_tokens: int, cache) -> tuple[list[float], list[int]]:
    """Seconds from the start to each token, and the tokens."""
    times, tokens = [], []
    t0 = time.perf_counter()
    for token in generate_tokens(model, prompt, new_tokens, temperature=0, cache=cache):
        times.append(time.perf_counter() - t0)
        tokens.append(token)
    return times, tokens


def bench_depth(depth: int, args, device) -> list[dict]:
    torch.manual_seed(0)
    model = GPT(ModelConfig(depth=depth), VOCAB_SIZE, default_backend(device), MAX_SEQLEN).to(device).eval()
    with torch.no_grad():  # zero output projections (the init) would make every block the identity
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(0, 0.02)
            block.mlp.c_proj.weight.normal_(0, 0.02)
    prompt = torch.randint(0, VOCAB_SIZE, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    kv = KVCache(model.shape, min(MAX_SEQLEN, args.prompt_tokens + args.new_tokens), compile=cuda)
    rows, outputs = [], {}
    with autocast:
        for cache in (kv, False):
            for _ in range(args.warmup):
                timed(model, prompt, args.new_tokens, cache)
            runs = [timed(model, prompt, args.new_tokens, cache) for _ in range(args.repeats)]
            first = statistics.median(times[0] for times, _ in runs)
            decode = statistics.median(times[-1] - times[0] for times, _ in runs)
            outputs[cache is kv] = runs[0][1]
            rows.append(
                {
                    "depth": depth,
                    "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
                    "cache": cache is kv,
                    "compiled": cache is kv and kv.compile,
                    "decode_tokens_per_s": (args.new_tokens - 1) / max(decode, 1e-9),
                    "first_token_s": first,
                    "total_s": statistics.median(times[-1] for times, _ in runs),
                }
            )
    agree = next(
        (i for i, (a, b) in enumerate(zip(outputs[True], outputs[False], strict=True)) if a != b),
        args.new_tokens,
    )
    for row in rows:
        row["agree"] = agree
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depths", type=int, nargs="+", default=[12, 20])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=1, help="untimed generations of each way first")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--out", type=Path, help="the JSON file (default benchmarks/generate_<device>.json)")
    args = parser.parse_args()
    if min(args.depths) < 1 or args.prompt_tokens < 1 or args.new_tokens < 2 or args.repeats < 1:
        parser.error("--depths and --prompt-tokens must be at least 1, --new-tokens at least 2, --repeats 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    try:
        device = resolve_device(args.device)
    except ConfigError as err:
        sys.exit(f"error: {err}")
    args.depths = list(dict.fromkeys(args.depths))
    rows = []
    for depth in args.depths:
        rows += bench_depth(depth, args, device)
        for row in rows[-2:]:
            print(json.dumps(row), flush=True)
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    env = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton,
        "attention": default_backend(device),
        "autocast": "bf16" if device.type == "cuda" else None,
        "vocab_size": VOCAB_SIZE,
        "max_seqlen": MAX_SEQLEN,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "warmup": args.warmup,
        "repeats": args.repeats,
    }
    print(f"\n{env}")
    print(
        f"{'depth':>5} {'params M':>9} {'cache':>6} {'compiled':>8} {'decode tok/s':>13} {'first s':>8} "
        f"{'total s':>8} {'agree':>6}"
    )
    for r in rows:
        print(
            f"{r['depth']:>5} {r['params_m']:>9.1f} {'yes' if r['cache'] else 'no':>6} "
            f"{'yes' if r['compiled'] else 'no':>8} "
            f"{r['decode_tokens_per_s']:>13,.1f} {r['first_token_s']:>8.3f} {r['total_s']:>8.3f} "
            f"{r['agree']:>6}"
        )
    for depth in args.depths:
        cached, recomputed = (r["decode_tokens_per_s"] for r in rows if r["depth"] == depth)
        print(f"d{depth}: the cache decodes {cached / recomputed:.1f}x as fast")
    default = (
        Path(__file__).resolve().parents[1] / "benchmarks" / f"generate_{device_slug(env['device'])}.json"
    )
    out = args.out or default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
