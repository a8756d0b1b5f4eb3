"""Weight gradients in FP8 against the bf16 ones that the Hopper FP8 recipe runs, at a model's shapes.

    python scripts/bench_fp8_wgrad.py   # d12 and d20 at 65,536 tokens: benchmarks/fp8_wgrad_<device>.json
    python scripts/bench_fp8_wgrad.py --depths 20 --tokens 32768 --out FILE.json

The four weight gradients of a block, G^T X summed over the tokens: the MLP's two (dW1 = dh^T x, dW2 =
g^T a), q/k/v's ([dh | dv]^T x) and the output projection's (g^T y).
- `bf16`: what `model.fp8=tensorwise` runs on Hopper (kernels/fused/products.py's weight_grad:
  wgrad_hopper.py's stream-K product where it is preferred, else cuBLAS).
- `fp8`: the formats of nanochat's `--fp8` (and of model/fp8.py's `tensorwise`): G per tensor in e5m2 and X
  in e4m3, then torch._scaled_mm. Those recipes quantise G and X per tensor for their other products too and
  only copy the FP8 bytes transposed here; the Hopper recipe's operands have row scales, which vary along
  the tokens that this sum runs over, so it would quantise G and X for these products alone. Hopper's FP8
  products read both operands along the sum, so G and X are quantised straight into transposed copies, by
  torch.compile; `quantise` and `product` are its two parts, and `product` alone is what it would cost if
  the kernels that make G and X wrote those copies.
Times are medians of CUDA-event timings (CUDA). `rel_err_*` is ||C - C_ref|| / ||C_ref|| against float64 math
on the same operands (standard normal), for the format's rounding next to bf16's. On the CPU (no FP8
products) the FP8 product is float32 math on the quantised operands and the times are wall-clock."""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.schema import ModelConfig  # noqa: E402
from eval.metrics import device_slug  # noqa: E402
from kernels.fused.numerics import E4M3, E5M2, quantize  # noqa: E402
from kernels.fused.products import weight_grad  # noqa: E402
from model.gpt import GPTShape  # noqa: E402


def shapes(depth: int) -> dict[str, tuple[int, ...]]:
    """Each weight gradient's operand widths (G's, or G's and G2's, and X's) at this depth."""
    shape = GPTShape.from_config(ModelConfig(depth=depth), vocab_size=64)
    c, kv = shape.n_embd, shape.n_kv_head * shape.head_dim
    return {"mlp_w1": (4 * c, c), "mlp_w2": (c, 4 * c), "qkv": (c + kv, kv, c), "proj": (c, c)}


def quantise_transposed(g: torch.Tensor, x: torch.Tensor):
    """G^T in e5m2 and X^T in e4m3, row-major (the sum runs along their rows), with their tensor scales."""
    g8, g_inv = quantize(g.t(), E5M2)
    x8, x_inv = quantize(x.t(), E4M3)
    return g8.contiguous(), g_inv, x8.contiguous(), x_inv


def fp8_product(g8, g_inv, x8, x_inv) -> torch.Tensor:
    if g8.is_cuda:
        return torch._scaled_mm(g8, x8.t(), scale_a=g_inv, scale_b=x_inv, out_dtype=torch.bfloat16)
    return ((g8.float() @ x8.float().t()) * (g_inv * x_inv)).bfloat16()


def timed_us(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).norm() / ref.norm()).item()


def bench_product(gs: list[torch.Tensor], x: torch.Tensor, quant, repeats: int) -> dict:
    """One weight gradient's times and errors, G given in parts ([G | G2] for q/k/v)."""
    g = torch.cat(gs, dim=1)  # the FP8 recipe quantises one G (the bf16 product reads the parts in place)

    def bf16():
        return weight_grad(gs[0], x, *gs[1:])

    parts = quant(g, x)
    ref = g.double().t() @ x.double()
    return {
        "shape": [g.shape[1], x.shape[1]],
        "bf16_us": timed_us(bf16, repeats),
        "fp8_us": timed_us(lambda: fp8_product(*quant(g, x)), repeats),
        "fp8_quantise_us": timed_us(lambda: quant(g, x), repeats),
        "fp8_product_us": timed_us(lambda: fp8_product(*parts), repeats),
        "rel_err_bf16": rel_err(bf16(), ref),
        "rel_err_fp8": rel_err(fp8_product(*parts), ref),
    }


def bench(depth: int, tokens: int, repeats: int, device: torch.device) -> list[dict]:
    quant = torch.compile(quantise_transposed, fullgraph=True)
    rows = []
    for name, (*g_widths, n) in shapes(depth).items():
        gen = torch.Generator(device).manual_seed(0)
        gs = [torch.randn(tokens, w, device=device, dtype=torch.bfloat16, generator=gen) for w in g_widths]
        x = torch.randn(tokens, n, device=device, dtype=torch.bfloat16, generator=gen)
        rows.append(
            {"depth": depth, "product": name, "tokens": tokens, **bench_product(gs, x, quant, repeats)}
        )
    return rows


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[12, 20])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, help="the JSON file (default benchmarks/fp8_wgrad_<device>.json)")
    args = parser.parse_args()
    if min(args.depths) < 1 or args.tokens < 16 or args.repeats < 1:
        parser.error("--depths must be at least 1, --tokens at least 16, --repeats at least 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    rows = []
    for depth in dict.fromkeys(args.depths):
        rows += bench(depth, args.tokens, args.repeats, device)
    env = {"device": name, "torch": torch.__version__, "tokens": args.tokens, "repeats": args.repeats}
    print(env)
    print(
        f"{'depth':>5} {'product':>7} {'shape':>12} {'bf16 us':>8} {'fp8 us':>8} {'quantise':>9} "
        f"{'product':>8} {'fp8/bf16':>8} {'err bf16':>9} {'err fp8':>8}"
    )
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        print(
            f"{r['depth']:>5} {r['product']:>7} {shape:>12} {r['bf16_us']:>8.0f} {r['fp8_us']:>8.0f} "
            f"{r['fp8_quantise_us']:>9.0f} {r['fp8_product_us']:>8.0f} {r['fp8_us'] / r['bf16_us']:>8.2f} "
            f"{r['rel_err_bf16']:>9.5f} {r['rel_err_fp8']:>8.4f}"
        )
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    out = args.out or benchmarks / f"fp8_wgrad_{device_slug(name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
