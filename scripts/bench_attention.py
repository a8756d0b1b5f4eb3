"""Benchmark varlen attention on a packed buffer: our kernel beside FlashAttention-4 (where flash-attn-4 is
installed, also in its deterministic mode), FlexAttention with a document mask,
torch.nn.attention.varlen.varlen_attn, and SDPA (flash and cuDNN backends) on a zero-padded batch.

    python scripts/bench_attention.py            # table on stdout and in benchmarks/attention_<device>.json
    python scripts/bench_attention.py --tune     # our kernels only, under each candidate block config
    python scripts/bench_attention.py --tune --kernels dkdv   # only the dK/dV pass's candidates
    python scripts/bench_attention.py --profile  # CUDA time of each of our kernels
    python scripts/bench_attention.py --window 512   # sliding windows: each query sees its 512 predecessors
    python scripts/bench_attention.py --methods ours fa4   # only these methods
    python scripts/bench_attention.py --rounds 3   # each method timed 3 times, interleaved; the medians

<device> is the GPU's model in lower case (h100, h200). `--tune` prints one JSON line per config and
writes a file only with `--out`; `--profile` writes nothing. With `--window W` the file is
attention_<device>_w<W>.json, and the methods without sliding windows (the SDPA ones) are left out.

TFLOP/s count only in-document causal work: 2 L^2 D H per document for the forward (half of the full
4 L^2 D H), 2.5 times that for the backward and 3.5 times for forward + backward; under a window, 4 D H per
(query, key) pair the window keeps. Times are medians of triton.testing.do_bench over at least 50 reps (and
200 ms), after 10 reps of warm-up, and each row's `_host_ms` the host time per call (the f+b one is the
table's "f+b host"); backward alone is torch.autograd.grad over a retained graph. With `--rounds N` each
(head dim, mix) times its methods N times over, each round starting one method later, and each figure is
the median of the N; `<part>_spread` is that part's largest minus smallest time over the median. Our
plan (the tile tables of the batch's documents), FlexAttention's block mask and SDPA's padded copies are
built once outside the timed region, as a model builds them once per batch for all its layers; the
plan's own time is the `plan_ms` of our rows (the table's "plan ms"), paid once per batch and window.
`sdpa_rows` is the no-mask reference: causal SDPA over whole 2,048-token rows, as nanochat computes.

The physical limit beside them: a bf16 matrix product's TFLOP/s on the same GPU (MATMUL_SIZE cubed, cuBLAS),
measured once per run, written as `matmul_tflops`; each row's `fwd_bwd_share_of_matmul` (the table's "of
mm") is its forward + backward TFLOP/s as a share of it.
"""

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.metrics import device_slug  # noqa: E402

# name -> (lognormal mean before clipping, longest length); sigma = 1, and the last document
# is cut so that the documents fill the buffer exactly.
MIXES = {
    "a_nanochat": (1600, 2048),  # 64 documents, mean 1024
    "b_short": (310, 2048),  # 222 documents, mean 295
    "c_long": (10000, 16384),  # 10 documents, mean 6554, longest 16384
}


# Square bf16 product of the physical-limit measurement: large enough that cuBLAS runs at its peak.
MATMUL_SIZE = 8192


def document_lengths(mix: str, total: int = 65536, seed: int = 0) -> list[int]:
    mean, longest = MIXES[mix]
    gen = torch.Generator().manual_seed(seed)
    sigma = 1.0
    mu = math.log(mean) - sigma**2 / 2
    lengths = []
    while sum(lengths) < total:
        n = int(torch.empty(1).log_normal_(mu, sigma, generator=gen).item())
        lengths.append(min(max(n, 1), longest, total - sum(lengths)))
    return lengths


def window_pairs(n: int, window: int) -> int:
    """(query, key) pairs of a causal document of n tokens where each query sees its `window` predecessors."""
    full = min(n, window + 1)  # the first queries see all of theirs
    return full * (full + 1) // 2 + (n - full) * (window + 1)


def causal_flops(lengths: list[int], heads: int, head_dim: int, window: int = -1) -> float:
    if window < 0:
        return sum(2.0 * n * n * head_dim * heads for n in lengths)
    return sum(4.0 * window_pairs(n, window) * head_dim * heads for n in lengths)


WORK = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}  # in units of the forward's causal_flops
KERNELS = ("fwd", "dq", "dkdv")  # the passes whose blocks --tune varies (block_sizes.block_config)


def make_batch(lengths, heads, head_dim, device="cuda", dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(T, heads, head_dim, device=device, dtype=dtype, generator=gen) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


# Each method maps (q, k, v, cu_seqlens, lengths, window) to (forward function of q, k, v, the tensors it
# takes); window -1 is unbounded causal attention, else each query sees its `window` predecessors.


def ours_plan(q, cu, lengths, window=-1):
    """The plan (tile tables) of the batch's documents, bounded by the longest (max_seqlen), as the model
    makes it: once per batch and window, for all its layers' forward and backward calls."""
    from kernels.attention import flash_attn_plan

    window_size = (window, 0)
    return flash_attn_plan(
        cu, q.shape[0], q.shape[2], causal=True, window_size=window_size, max_seqlen=max(lengths)
    )


def ours(q, k, v, cu, lengths, window=-1):
    from kernels.attention import flash_attn_varlen

    plan = ours_plan(q, cu, lengths, window)

    def fwd(q, k, v):
        return flash_attn_varlen(q, k, v, cu, max(lengths), causal=True, window_size=(window, 0), plan=plan)

    return fwd, (q, k, v)


def plan_ms(q, cu, lengths, window=-1) -> float:
    """Median milliseconds of making our plan, which the model pays once per batch and window (timed apart
    from the calls, which take it made, as FlexAttention's rows take their block mask)."""
    return median_ms(lambda: ours_plan(q, cu, lengths, window), 100)


def flex(q, k, v, cu, lengths, window=-1):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    T = q.shape[0]
    doc = torch.searchsorted(cu[1:].contiguous(), torch.arange(T, device=q.device), right=True)

    def document_causal(b, h, q_idx, kv_idx):
        visible = (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        return visible & (q_idx - kv_idx <= window) if window >= 0 else visible

    mask = create_block_mask(document_causal, None, None, T, T, device=q.device)
    compiled = torch.compile(flex_attention, dynamic=False)

    def fwd(q, k, v):
        return compiled(q, k, v, block_mask=mask)

    return fwd, tuple(x.transpose(0, 1)[None].contiguous() for x in (q, k, v))


def varlen_attn(q, k, v, cu, lengths, window=-1):
    from torch.nn.attention.varlen import varlen_attn as attn

    def fwd(q, k, v):
        return attn(q, k, v, cu, cu, max(lengths), max(lengths), window_size=(window, 0))

    return fwd, (q, k, v)


def _sdpa(backend):
    def method(q, k, v, cu, lengths, window=-1):
        from torch.nn.attention import sdpa_kernel

        longest = max(lengths)
        starts = cu[:-1].tolist()

        def pad(x):  # [T, H, D] -> [N, H, longest, D], zeros after each document
            out = x.new_zeros(len(lengths), x.shape[1], longest, x.shape[2])
            for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
                out[i, :, :n] = x[s : s + n].transpose(0, 1)
            return out

        def fwd(q, k, v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        return fwd, tuple(pad(x) for x in (q, k, v))

    return method


ROW = 2048  # nanochat's sequence length


def sdpa_rows(q, k, v, cu, lengths, window=-1):
    """Causal SDPA over rows of ROW tokens of the packed buffer with no document mask, under torch's own
    backend choice: what nanochat and our `sdpa_packed` backend compute. It attends across documents, so
    it is a speed reference for the same buffer, not the same function; its TFLOP/s count the same
    in-document work as every other row, so they compare times."""
    T, H, D = q.shape
    if max(lengths) > ROW or T % ROW:
        raise ValueError(f"needs documents of at most {ROW} tokens in whole rows of {ROW}")

    def fwd(q, k, v):
        rows = (x.view(T // ROW, ROW, H, D).transpose(1, 2) for x in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(*rows, is_causal=True)

    return fwd, (q, k, v)


def _fa4(deterministic: bool):
    """FlashAttention-4 (flash_attn.cute), the state of the art on Hopper; deterministic=True is the mode
    comparable with our backward, which is deterministic."""

    def method(q, k, v, cu, lengths, window=-1):
        from flash_attn.cute import flash_attn_varlen_func

        longest = max(lengths)
        window_size = (None, None) if window < 0 else (window, 0)

        def fwd(q, k, v):
            out, _ = flash_attn_varlen_func(
                q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
                causal=True, window_size=window_size, deterministic=deterministic,
            )  # fmt: skip
            return out

        return fwd, (q, k, v)

    return method


def fa4_installed() -> bool:
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        return False
    return True


METHODS = {"ours": ours, "flex": flex, "varlen_attn": varlen_attn, "sdpa_rows": sdpa_rows}
# The methods that take a sliding window.
WINDOWED = {"ours", "flex", "varlen_attn", "fa4", "fa4_deterministic"}


# Each time is the median of at least MIN_REPS reps after at least WARMUP_REPS, however long a rep takes:
# at the 200 ms default a 19 ms loop would get only ten reps, a median that moved by 5-10% between runs
# of one loop on one GPU held at its power cap.
MIN_REPS = 50
WARMUP_REPS = 10


def median_ms(fn, rep_ms: float = 200) -> float:
    """Median milliseconds of fn over max(rep_ms, MIN_REPS reps), L2 flushed per rep (do_bench)."""
    from triton.testing import do_bench

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    rep = start.elapsed_time(end) / 3
    return do_bench(
        fn, warmup=max(50, WARMUP_REPS * rep), rep=max(rep_ms, MIN_REPS * rep), return_mode="median"
    )


def host_ms(fn, calls: int = 20) -> float:
    """Milliseconds of host time per call of fn: calls queued back to back from an idle GPU, timed until
    the last returns (not until the GPU ends it). Where this exceeds the GPU's time per call, a loop of fn
    is host-bound."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return host


def time_method(
    method, q, k, v, cu, lengths, parts=("fwd", "bwd", "fwd_bwd"), rep_ms=200, window: int = -1, host=False
) -> dict:
    """Median milliseconds of the forward, the backward and both, for the parts asked for, and with
    host=True each part's host milliseconds per call as `<part>_host`."""
    fwd, inputs = method(q, k, v, cu, lengths, window)
    calls = {}
    if "fwd" in parts:
        calls["fwd"] = lambda: fwd(*inputs)  # timed in no_grad, below
    inputs = [x.detach().requires_grad_() for x in inputs]
    out = fwd(*inputs)
    dout = torch.randn_like(out)
    if "bwd" in parts:
        calls["bwd"] = lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True)
    if "fwd_bwd" in parts:
        calls["fwd_bwd"] = lambda: torch.autograd.grad(fwd(*inputs), inputs, dout)
    times = {}
    for part, call in calls.items():
        with torch.set_grad_enabled(part != "fwd"):
            times[part] = median_ms(call, rep_ms)
            if host:
                times[f"{part}_host"] = host_ms(call)
    return times


def matmul_tflops(n: int = MATMUL_SIZE) -> float:
    """TFLOP/s of a bf16 [n, n] x [n, n] product on the current GPU."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = median_ms(lambda: a @ b)
    return round(2 * n**3 / ms / 1e9, 1)


def environment() -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }


def interleaved(names, rounds: int, run) -> dict:
    """run(name) for each name, `rounds` times over, each round starting one name later than the last, so
    that drift of the GPU's clocks over the run is shared among the methods rather than charged to the
    ones timed last. Returns each name's results in its rounds' order; a name whose run raises is not run
    again, and its entry is the exception."""
    results = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if not isinstance(results[name], Exception):
                try:
                    results[name].append(run(name))
                except Exception as e:
                    results[name] = e
    return results


def across_rounds(runs: list[dict]) -> dict:
    """Per key, the median over the rounds' values; with more than one round, also each part's spread
    (largest minus smallest over the median) as `<part>_spread`, for the time parts (not the host times)."""
    merged = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    if len(runs) > 1:
        for key in WORK:
            if key in merged:
                values = [run[key] for run in runs]
                merged[f"{key}_spread"] = (max(values) - min(values)) / merged[key]
    return merged


def _time_and_free(methods, batch, lengths, window, name) -> dict:
    """time_method of one method, with host times; its cached memory is freed for the next one."""
    try:
        return time_method(methods[name], *batch, lengths, window=window, host=True)
    finally:
        torch.cuda.empty_cache()


def benchmark(
    head_dims, mixes, heads, tokens, window: int = -1, matmul: float | None = None, only=None, rounds: int = 1
) -> list[dict]:
    from torch.nn.attention import SDPBackend

    methods = dict(
        METHODS, sdpa_flash=_sdpa(SDPBackend.FLASH_ATTENTION), sdpa_cudnn=_sdpa(SDPBackend.CUDNN_ATTENTION)
    )
    if fa4_installed():  # the anchor, where flash-attn-4 is installed
        methods.update(fa4=_fa4(False), fa4_deterministic=_fa4(True))
    if window >= 0:
        methods = {name: method for name, method in methods.items() if name in WINDOWED}
    if only:
        methods = {name: method for name, method in methods.items() if name in only}
    rows = []
    for head_dim in head_dims:
        for mix in mixes:
            lengths = document_lengths(mix, tokens)
            q, k, v, cu = make_batch(lengths, heads, head_dim)
            flops = causal_flops(lengths, heads, head_dim, window)
            run = functools.partial(_time_and_free, methods, (q, k, v, cu), lengths, window)
            results = interleaved(list(methods), rounds, run)
            for name, runs in results.items():
                row = {
                    "mix": mix,
                    "head_dim": head_dim,
                    "method": name,
                    "docs": len(lengths),
                    "longest": max(lengths),
                }
                if isinstance(runs, Exception):  # a baseline that does not run here is reported, not fatal
                    row["error"] = f"{type(runs).__name__}: {str(runs).splitlines()[0][:200]}"
                else:
                    row["rounds"] = len(runs)
                    for part, t in across_rounds(runs).items():
                        if part.endswith("_spread"):
                            row[part] = round(t, 4)
                            continue
                        row[f"{part}_ms"] = round(t, 4)
                        if part in WORK:
                            row[f"{part}_tflops"] = round(WORK[part] * flops / t / 1e9, 1)
                    if matmul:
                        row["fwd_bwd_share_of_matmul"] = round(row["fwd_bwd_tflops"] / matmul, 3)
                    if name == "ours":
                        row["plan_ms"] = round(plan_ms(q, cu, lengths, window), 4)
                print(format_row(row), flush=True)
                rows.append(row)
    return rows


def tune(head_dims, mixes, heads, tokens, kernels=KERNELS, window: int = -1) -> list[dict]:
    """Time our forward or backward under candidate block configs, one kernel of `kernels` varied at a
    time. The mix of long documents varies the last length class of block_config, the others the first.
    A dK/dV candidate for the class whose dS the dQ pass reads (dq_stored) gets a dq_stored that fits its
    dS tiles: its key blocks, and 64 query rows where that is a multiple of its own, else its own."""
    from kernels.attention import block_sizes
    from kernels.attention.block_sizes import Blocks
    from kernels.common import is_hopper

    default_config = block_sizes.block_config
    on_hopper = is_hopper(torch.device("cuda"))
    tma = True
    candidates = {
        "fwd": [
            Blocks(64, 32, 4, 3),
            Blocks(64, 64, 4, 3),
            Blocks(64, 64, 4, 3, tma),
            Blocks(128, 64, 4, 3, tma),
            Blocks(64, 128, 4, 3, tma),
            Blocks(128, 64, 8, 3, tma),
            Blocks(128, 128, 8, 3),
            Blocks(128, 128, 8, 3, tma),
        ],
        "dq": [
            Blocks(64, 32, 4, 3),
            Blocks(64, 64, 4, 3),
            Blocks(64, 64, 4, 3, tma),
            Blocks(128, 64, 8, 3),
            Blocks(128, 64, 8, 3, tma),
        ],
        "dkdv": [
            Blocks(32, 64, 4, 3),
            Blocks(32, 64, 4, 3, tma),
            Blocks(32, 64, 8, 3, tma),
            Blocks(32, 128, 4, 3),
            Blocks(32, 128, 4, 3, tma),
            Blocks(32, 128, 8, 3, tma),
            Blocks(64, 64, 4, 3, tma),
            Blocks(64, 128, 8, 2),
            Blocks(64, 128, 8, 2, tma),
        ],
    }
    rows = []

    def gluon_candidates(kernel, head_dim):
        """On Hopper, the config's Gluon blocks of the pass (their shapes are the Gluon kernels' own), with
        the forward's ring depths varied."""
        if not on_hopper:
            return []
        gluon = [b for _, b in default_config(head_dim, True)[kernel] if b.gluon]
        if kernel == "fwd":
            return [b._replace(stages=stages) for b in gluon for stages in (2, 3, 4, 5, 6)]
        return gluon

    def run(row, part, q, k, v, cu, lengths, flops):
        try:
            t = time_method(ours, q, k, v, cu, lengths, parts=(part,), rep_ms=100, window=window)[part]
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        else:
            row["ms"] = round(t, 4)
            row["tflops"] = round(WORK[part] * flops / t / 1e9, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)

    for head_dim in head_dims:
        for mix in mixes:
            lengths = document_lengths(mix, tokens)
            batch = make_batch(lengths, heads, head_dim)
            flops = causal_flops(lengths, heads, head_dim, window)
            which = -1 if mix == "c_long" else 0
            for kernel in kernels:
                for blocks in candidates[kernel] + gluon_candidates(kernel, head_dim):
                    config = default_config(head_dim, on_hopper)
                    entries = list(config[kernel])
                    entries[which] = (entries[which][0], blocks)
                    changed = {kernel: entries}
                    row = {"mix": mix, "head_dim": head_dim, "kernel": kernel, "blocks": list(blocks)}
                    if kernel == "dkdv" and which == 0 and "dq_stored" in config:
                        m = 64 if 64 % blocks.m == 0 and 64 <= blocks.n else blocks.m
                        changed["dq_stored"] = config["dq_stored"]._replace(m=m, n=blocks.n)
                        row["dq_stored"] = list(changed["dq_stored"])
                    block_sizes.block_config = lambda d, hopper=False, changed=changed: {
                        **default_config(d, hopper),
                        **changed,
                    }
                    run(row, "fwd" if kernel == "fwd" else "bwd", *batch, lengths, flops)
                    block_sizes.block_config = default_config
    return rows


def profile(head_dims, mixes, heads, tokens, window: int = -1) -> None:
    """CUDA time of each kernel in our forward + backward (torch.profiler), to see where the time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for head_dim in head_dims:
        for mix in mixes:
            lengths = document_lengths(mix, tokens)
            fwd, inputs = ours(*make_batch(lengths, heads, head_dim), lengths, window)
            inputs = [x.requires_grad_() for x in inputs]
            dout = torch.randn_like(inputs[0])
            for _ in range(3):
                torch.autograd.grad(fwd(*inputs), inputs, dout)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    torch.autograd.grad(fwd(*inputs), inputs, dout)
                torch.cuda.synchronize()
            print(f"{mix}, D={head_dim}, window {window}, 10 steps")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))


def format_row(row: dict) -> str:
    head = f"| {row['mix']:<10} | {row['head_dim']:>3} | {row['method']:<17} |"
    if "error" in row:
        return f"{head} {row['error'][:80]} |"
    cells = (f" {row[f'{k}_ms']:8.3f} | {row[f'{k}_tflops']:6.1f} |" for k in ("fwd", "bwd", "fwd_bwd"))
    share = row.get("fwd_bwd_share_of_matmul")
    plan = row.get("plan_ms")
    host = row.get("fwd_bwd_host_ms")
    return (
        head
        + "".join(cells)
        + (f" {share:7.1%} |" if share is not None else "       - |")
        + (f" {plan:7.3f} |" if plan is not None else "       - |")
        + (f" {host:8.3f} |" if host is not None else "        - |")
    )


TABLE_HEAD = (
    "| mix        |   D | method            |   fwd ms | TFLOPS |   bwd ms | TFLOPS |   f+b ms | TFLOPS |"
    "  of mm | plan ms | f+b host |\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=[*METHODS, "sdpa_flash", "sdpa_cudnn", "fa4", "fa4_deterministic"],
        help="only these methods (default: every one that runs here)",
    )
    parser.add_argument("--tune", action="store_true", help="sweep our block configs instead")
    parser.add_argument(
        "--kernels", nargs="+", default=list(KERNELS), choices=KERNELS, help="with --tune: the passes to vary"
    )
    parser.add_argument("--profile", action="store_true", help="time each of our kernels instead")
    parser.add_argument(
        "--window",
        type=int,
        default=-1,
        help="sliding window: each query sees this many predecessors (in the table, --tune or --profile)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time each method this many times, interleaved with the others; report the medians",
    )
    parser.add_argument(
        "--out", type=Path, help="JSON path (default benchmarks/attention_<device>.json; --tune: none)"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.rounds > 1 and (args.tune or args.profile):
        parser.error("--rounds applies to the table, not to --tune or --profile")

    env = environment()
    print(json.dumps(env))
    if args.profile:
        return profile(args.head_dims, args.mixes, args.heads, args.tokens, args.window)
    if args.tune:
        rows = tune(args.head_dims, args.mixes, args.heads, args.tokens, args.kernels, args.window)
        out = args.out
    else:
        env["matmul_tflops"] = matmul_tflops()
        print(f"bf16 matmul, {MATMUL_SIZE}^3: {env['matmul_tflops']} TFLOP/s (the last column's reference)")
        print(TABLE_HEAD)
        rows = benchmark(
            args.head_dims,
            args.mixes,
            args.heads,
            args.tokens,
            args.window,
            env["matmul_tflops"],
            args.methods,
            args.rounds,
        )
        print("\n" + "\n".join([TABLE_HEAD, *map(format_row, rows)]))
        benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
        suffix = f"_w{args.window}" if args.window >= 0 else ""
        out = args.out or benchmarks / f"attention_{device_slug(env['device'])}{suffix}.json"
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {**env, "tokens": args.tokens, "heads": args.heads, "window": args.window}
    if not args.tune:
        record["rounds"] = args.rounds
    record["rows"] = rows
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
