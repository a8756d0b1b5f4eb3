"""Training-speed benchmark: timed optimiser steps per model size and attention backend, in one process or
under torchrun.

    python scripts/bench_train.py data.source='corpus/*.parquet' data.vocab_size=32768 \
        data.tokens_per_micro_batch=65536 data.max_seqlen=2048 data.max_num_docs=256 \
        total_batch_tokens=524288 +models=[d12,d20] +backends=[triton,flex,torch_varlen,sdpa_packed] \
        +warmup=3 +steps=10 [+out=FILE.json] [+profile_step=true] [+memory_snapshot=DIR]

`fa4` in `+backends` (FlashAttention-4, model/fa4.py) is skipped with a printed note where flash-attn-4 does
not import or the GPU is older than sm90, so one command compares it with ours where it runs.

Takes the same overrides as train.py (the data pipeline and loader are the real ones). Each entry of
`+models` names a preset of configs/model, composed as `train.py model=<name>` would. For each model
and backend it reports tokens/s; MFU by nanochat's formula (6 x matmul params + 12 * layers * heads *
head_dim * max_seqlen FLOPs per token, i.e. full attention over every row, whether computed or not) and
with only the in-document attention work counted; peak memory over every step (`peak_mem_gb`: the first,
compiling and autotuning, included) and over the timed steps alone (`steady_peak_mem_gb`; None on the CPU,
whose peak RSS cannot be reset); compile time (the first step's time beyond a steady step); recompiles
after the first step; and the share of step time spent waiting for data.
The table goes to benchmarks/train_<device>.json (h100, h200, cpu, ...), with `model.fp8=<mode>` to
benchmarks/train_fp8_<mode>_<device>.json, with `parallel=zero` or `fsdp` to
benchmarks/train_<parallel>_<device>.json, and with N > 1 ranks to ..._<device>_x<N>.json; or to `+out=`.
One process: with `parallel=zero`, the ZeroRedundancyOptimizer over a group of one; with `parallel=fsdp`,
FSDP2 over a group of one (its per-block compile and hooks, no communication).

Under torchrun (`torchrun --nproc_per_node=N scripts/bench_train.py ...`) every rank trains its share of
`total_batch_tokens` as train.py does; tokens/s is the whole job's, `tokens_per_s_per_rank` and the MFUs are
per rank, and memory is the largest rank's: peak memory (on CPU the process's peak RSS), and the bytes of
this rank's parameters and optimiser states (what the `parallel` mode shards).

`+profile_step=true` profiles one more step and prints its per-kernel table; on CUDA the row then also has
that step's communication on rank 0: `comm_s` (seconds of NCCL kernels), `exposed_comm_s` (the part no other
kernel overlapped, which the step waited for) and `exposed_comm_share` (of the step's wall time); and
`exposed_comm_s_by_rank`, every rank's exposed time. A collective's kernel starts when its rank arrives, so a
rank that arrives first also waits in it for the others: the smallest of them is the communication's own
cost, and the spread is the time ranks waited for one another (their micro-batches' work differs).

`+memory_snapshot=DIR` (CUDA only) records the caching allocator's history over one more step, after the
timed (and profiled) ones, writes it to DIR/<model>_<backend>_rank<r>.pickle (pytorch.org/memory_viz opens
it) and prints, per rank, scripts/memory_peak.py's account of its peak: the moment the most bytes were
allocated, and the code that allocated the blocks alive then.
"""

import gc
import importlib.metadata
import json
import pickle
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch.autograd import DeviceType
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.schema import ConfigError, register_configs  # noqa: E402
from data import PackedLoader, prepare  # noqa: E402
from eval.metrics import device_slug, exposed_time, peak_flops  # noqa: E402
from model.attention import check_backend  # noqa: E402
from model.gpt import GPT  # noqa: E402
from model.optim import build_optimizers  # noqa: E402
from run.determinism import configure_determinism  # noqa: E402
from run.dist import gather_objects, init_distributed, shutdown, wait_for_rank0  # noqa: E402
from run.parallel import needs_group_of_one, parallelize, shards_optimizers  # noqa: E402
from run.preflight import check_config  # noqa: E402
from run.profiling import dump_memory_history, start_memory_history, stop_memory_history  # noqa: E402
from scripts.memory_peak import find_peak, summary  # noqa: E402
from train import peak_memory_gb, train_step  # noqa: E402

register_configs()

# H100 and H200 dense bf16: the denominator nanochat uses, so MFUs compare across projects.
NANOCHAT_PEAK = 989e12


def model_config(preset: str) -> DictConfig:
    """The run's config with configs/model/<preset>.yaml selected, as `train.py model=<preset>` with the
    same command line would compose it: a preset sets more than the depth (d12 is 6 heads of 128, as in
    nanochat), so setting `model.depth` alone would keep the default preset's other knobs."""
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("model=")]
    return hydra.compose(config_name="config", overrides=[*overrides, f"model={preset}"])


def bench_one(
    cfg,
    data,
    info,
    name: str,
    backend: str,
    warmup: int,
    steps: int,
    profile: bool,
    snapshot_dir: str | None = None,
) -> dict:
    device = info.device
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model, data.vocab_size, backend, cfg.data.max_seqlen).to(device)
    parallel = parallelize(
        model, cfg.parallel, info, cfg.compile, cfg.reshard_after_forward, cfg.ddp_bucket_mb
    )
    optimizers = build_optimizers(model, cfg.optim, shard=shards_optimizers(cfg.parallel, info))
    loader = PackedLoader(
        data, cfg.data, "train", rank=info.rank, world_size=info.world_size, seed=cfg.seed, device=device
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    accum = cfg.total_batch_tokens // (cfg.data.tokens_per_micro_batch * info.world_size)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    from torch._dynamo.utils import counters

    counters.clear()

    def timed_step():
        t0 = time.perf_counter()
        result = train_step(parallel, loader, optimizers, accum, autocast, info, cfg.optim.grad_clip)
        loss = result.loss.item()  # waits for the GPU
        return time.perf_counter() - t0, result, loss

    first_time, _, _ = timed_step()
    graphs_after_first = counters["stats"]["unique_graphs"]
    for _ in range(warmup - 1):
        timed_step()
    warm_peak = peak_memory_gb(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, waits, attn_flops, losses = [], [], [], []
    for _ in range(steps):
        dt, result, loss = timed_step()
        times.append(dt)
        waits.append(result.data_wait_s)
        attn_flops.append(result.attention_flops.item())
        losses.append(loss)
    steady_peak = peak_memory_gb(device) if device.type == "cuda" else None
    comm = {}
    if profile:
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            wall = timed_step()[0]
        if device.type == "cuda":
            comm = communication(prof, wall)
            comm["exposed_comm_s_by_rank"] = gather_objects(comm["exposed_comm_s"], info)
        if info.is_main:
            print(f"profile of one step, {name} {backend}: {wall:.3f} s wall, {comm}")
            print(
                prof.key_averages().table(
                    sort_by="self_device_time_total", row_limit=40, max_name_column_width=70
                )
            )
    # Every step's peak: the first and the profiled one's included, the snapshot step's not.
    peak_mem = max(warm_peak, peak_memory_gb(device))
    if snapshot_dir:
        path = Path(snapshot_dir) / f"{name}_{backend}_rank{info.rank}.pickle"
        texts = gather_objects(record_memory(timed_step, device, path), info)
        if info.is_main:
            for rank, text in enumerate(texts):
                print(f"memory snapshot of one step, {name} {backend} rank {rank}: {text}", flush=True)
    loader.close()
    step_time = sorted(times)[len(times) // 2]
    s = model.shape
    tokens = cfg.total_batch_tokens
    nanochat_flops = (
        6 * model.matmul_params() + 12 * s.n_layer * s.n_head * s.head_dim * cfg.data.max_seqlen
    ) * tokens
    # attn_flops are this rank's: every rank packs alike, so the job's are about ranks times as many.
    in_doc_flops = 6 * model.matmul_params() * tokens + info.world_size * sum(attn_flops) / len(attn_flops)
    peak = peak_flops(device) or NANOCHAT_PEAK
    ranks = info.world_size
    # The largest rank's memory: the one that runs out first.
    memory = rank_memory(model, optimizers, peak_mem, steady_peak)
    memory = max(gather_objects(memory, info), key=lambda m: m["peak_mem_gb"])
    row = {
        "model": name,
        "heads": f"{s.n_head} x {s.head_dim}",
        "attention": backend,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "tokens_per_s": tokens / step_time,
        "tokens_per_s_per_rank": tokens / step_time / ranks,
        "step_time_s": step_time,
        "mfu_nanochat": nanochat_flops / step_time / ranks / NANOCHAT_PEAK,
        "mfu_in_document": in_doc_flops / step_time / ranks / peak,
        **memory,
        "compile_s": max(first_time - step_time, 0.0),
        "recompiles": counters["stats"]["unique_graphs"] - graphs_after_first,
        "data_share": sum(waits) / sum(times),
        "final_loss": losses[-1],
        **comm,
    }
    return row


def communication(prof, wall: float) -> dict:
    """Of the profiled step on this rank: the seconds its GPU ran collectives (NCCL kernels), the part of
    them that no other kernel overlapped (exposed_time), and that part's share of the step's wall time."""
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = {True: [], False: []}
    for e in kernels:
        spans["nccl" in e.name.lower()].append((e.time_range.start / 1e6, e.time_range.end / 1e6))
    total, exposed = exposed_time(spans[True], spans[False])
    return {"comm_s": total, "exposed_comm_s": exposed, "exposed_comm_share": exposed / wall}


def record_memory(step, device, path: Path) -> str:
    """Run `step` with the CUDA caching allocator's history recorded, dump the snapshot to `path`, and return
    scripts/memory_peak.py's summary of it."""
    start_memory_history()
    try:
        step()
        dump_memory_history(path)
    finally:
        stop_memory_history()
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    return f"{path}\n{summary(find_peak(snapshot, device.index))}"


def rank_memory(model, optimizers, peak_mem_gb: float, steady_peak_mem_gb: float | None) -> dict:
    """This rank's peak memory, and the bytes of the parameters and optimiser states it holds (local shards
    under fsdp, its own parameters' states under zero)."""

    def nbytes(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    states = [v for opt in optimizers for s in _local(opt).state.values() for v in s.values()]
    return {
        "peak_mem_gb": peak_mem_gb,
        "steady_peak_mem_gb": steady_peak_mem_gb,
        "params_gb": sum(nbytes(p) for p in model.parameters()) / 1e9,
        "optim_state_gb": sum(nbytes(v) for v in states if isinstance(v, torch.Tensor)) / 1e9,
    }


def _local(opt):
    return opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt


def can_run(backend: str, info) -> bool:
    """False, with a note, for fa4 where it cannot run: an optional dependency, skipped rather than fatal."""
    if backend != "fa4":
        return True
    try:
        check_backend(backend, info.device)
    except ConfigError as err:
        if info.is_main:
            print(f"skipping {err}", flush=True)
        return False
    return True


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:  # importable from a folder without its metadata
        return None


def release_memory() -> None:
    """Drop the last configuration's compiled graphs and cached GPU blocks before the next one."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg) -> None:
    configure_determinism(cfg.deterministic)
    info = init_distributed(
        cfg.device, group_of_one=needs_group_of_one(cfg.parallel), timeout_s=cfg.dist_timeout_s
    )
    try:
        bench(cfg, info)
    finally:
        shutdown(info)


def bench(cfg, info) -> None:
    check_config(cfg, info)
    models = [str(m) for m in cfg.get("models", ["d12", "d20"])]
    backends = [
        b for b in cfg.get("backends", ["triton", "flex", "torch_varlen", "sdpa_packed"]) if can_run(b, info)
    ]
    warmup, steps = int(cfg.get("warmup", 3)), int(cfg.get("steps", 10))
    # +profile_step=true: per-kernel table of one extra step (`profile` is train.py's profiling group)
    profile = bool(cfg.get("profile_step", False))
    snapshot_dir = cfg.get("memory_snapshot")  # +memory_snapshot=DIR: allocator history of one more step
    if snapshot_dir and info.device.type != "cuda":
        if info.is_main:
            print(f"+memory_snapshot skipped: it records the CUDA allocator, this run is on {info.device}")
        snapshot_dir = None
    if info.is_main:
        prepare(cfg.data, build=True)
    wait_for_rank0(info)
    data = prepare(cfg.data, build=False)
    rows = []
    for name in models:
        for backend in backends:
            try:
                row = bench_one(
                    model_config(name), data, info, name, backend, warmup, steps, profile, snapshot_dir
                )
            except torch.OutOfMemoryError:
                row = {"model": name, "attention": backend, "error": "out of memory"}
            release_memory()
            rows.append(row)
            if info.is_main:
                print(json.dumps(row), flush=True)
    if not info.is_main:
        return
    env = {
        "device": torch.cuda.get_device_name() if info.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": importlib.metadata.version("triton"),
        "deterministic": cfg.deterministic,
        "flash_attn_4": installed_version("flash-attn-4") if "fa4" in backends else None,
        "parallel": cfg.parallel,
        "ddp_bucket_mb": cfg.ddp_bucket_mb,
        "world_size": info.world_size,
        "fp8": cfg.model.fp8,
        "fused": [key for key in ("fused_mlp", "fused_rope_norm", "fused_residual") if cfg.model[key]],
        "tokens_per_micro_batch": cfg.data.tokens_per_micro_batch,
        "total_batch_tokens": cfg.total_batch_tokens,
        "max_seqlen": cfg.data.max_seqlen,
        "vocab_size": data.vocab_size,
        "source": cfg.data.source,
        "warmup": warmup,
        "steps": steps,
    }
    print(f"\n{env}")
    print(
        f"{'model':<6} {'heads':<8} {'attention':<13} {'tok/s':>10} {'MFU nc':>7} {'MFU doc':>8} "
        f"{'mem GB':>7} {'steady GB':>9} {'state GB':>8} {'compile s':>9} {'recomp':>6} {'data %':>7}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<6} {'':<8} {r['attention']:<13} {r['error']}")
            continue
        mem, state = f"{r['peak_mem_gb']:.1f}", f"{r['params_gb'] + r['optim_state_gb']:.2f}"
        steady = "-" if r["steady_peak_mem_gb"] is None else f"{r['steady_peak_mem_gb']:.1f}"
        print(
            f"{r['model']:<6} {r['heads']:<8} {r['attention']:<13} {r['tokens_per_s']:>10,.0f} "
            f"{r['mfu_nanochat']:>7.1%} {r['mfu_in_document']:>8.1%} {mem:>7} {steady:>9} {state:>8} "
            f"{r['compile_s']:>9.1f} {r['recompiles']:>6} {r['data_share']:>7.2%}"
        )
    fp8 = "" if cfg.model.fp8 == "none" else f"fp8_{cfg.model.fp8}_"
    parallel = "" if cfg.parallel == "ddp" else f"{cfg.parallel}_"
    ranks = f"_x{info.world_size}" if info.world_size > 1 else ""
    name = f"train_{fp8}{parallel}{device_slug(env['device'])}{ranks}.json"
    default = Path(__file__).resolve().parents[1] / "benchmarks" / name
    out = Path(cfg.get("out") or default)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
