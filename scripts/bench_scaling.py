"""The scaling table: scripts/bench_train.py for each `parallel` mode on each number of GPUs of one node,
then tokens/s per GPU against one GPU, memory per rank and exposed communication, as a Markdown table.

    python scripts/bench_scaling.py --gpus 1 2 4 8 --modes ddp zero fsdp --out benchmarks/scaling_h200_x8 -- \
        data.source='corpus/*.parquet' data.vocab_size=32768 data.tokens_per_micro_batch=65536 \
        data.max_seqlen=2048 data.max_num_docs=384 total_batch_tokens=524288 +models=[d12,d20] \
        +backends=[triton] +warmup=2 +steps=4 +profile_step=true

Every run is `torchrun --standalone --nproc_per_node=N scripts/bench_train.py OVERRIDES parallel=MODE
+out=OUT/train_MODE_xN.json`, one after the other, so each has the node to itself; the overrides after `--`
are bench_train's (and train.py's). `--table-only` rebuilds the table from the JSON files already in OUT. The
table goes to the console and to OUT/table.md. Efficiency is the tokens/s per GPU on N GPUs over the tokens/s
on the fewest GPUs measured, of the same mode and of `ddp`; `total_batch_tokens` stays the same, so each GPU
runs fewer micro-batches per step as N grows.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODES = ("ddp", "zero", "fsdp")


def result_path(out: Path, mode: str, gpus: int) -> Path:
    return out / f"train_{mode}_x{gpus}.json"


def run(out: Path, mode: str, gpus: int, overrides: list[str]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
        str(ROOT / "scripts" / "bench_train.py"),
        *overrides,
        f"parallel={mode}",
        f"+out={result_path(out, mode, gpus)}",
    ]
    print(f"$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def load(out: Path, modes: list[str], gpus: list[int]) -> dict:
    """(model, mode, gpus) -> that benchmark row, from the files that exist; rows with an error left out."""
    rows = {}
    for mode in modes:
        for n in gpus:
            path = result_path(out, mode, n)
            if not path.exists():
                continue
            for row in json.loads(path.read_text())["rows"]:
                if "error" not in row:
                    rows[row["model"], mode, n] = row
    return rows


def baseline(rows: dict, model: str, mode: str) -> dict | None:
    """The row of `mode` on the fewest GPUs measured for `model`."""
    measured = sorted(n for m, mo, n in rows if m == model and mo == mode)
    return rows[model, mode, measured[0]] if measured else None


def ratio(per_gpu: float, base: dict | None) -> str:
    return f"{per_gpu / base['tokens_per_s_per_rank']:.1%}" if base else "-"


def communication(row: dict) -> str:
    """NCCL kernel time of rank 0's profiled step, and the part no other kernel overlapped, then the least
    and most exposed of all ranks where recorded (CUDA runs with +profile_step=true and several ranks)."""
    if not row.get("comm_s"):
        return "-"
    comm, exposed = row["comm_s"] * 1e3, row["exposed_comm_s"] * 1e3
    text = f"{comm:.0f} ms, {exposed:.1f} ms ({row['exposed_comm_share']:.1%})"
    by_rank = row.get("exposed_comm_s_by_rank")
    if by_rank:
        text += f"; ranks {min(by_rank) * 1e3:.1f}-{max(by_rank) * 1e3:.1f} ms"
    return text


def table(rows: dict, modes: list[str], gpus: list[int]) -> str:
    lines = [
        "| model | mode | GPUs | tokens/s | per GPU | efficiency, same mode / vs `ddp` | MFU nc / doc "
        "| peak GB | state GB per rank | communication, exposed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    models = list(dict.fromkeys(model for model, _, _ in rows))
    for model in models:
        for mode in modes:
            for n in gpus:
                row = rows.get((model, mode, n))
                if row is None:
                    continue
                per_gpu = row["tokens_per_s_per_rank"]
                same, ddp = (ratio(per_gpu, baseline(rows, model, m)) for m in (mode, "ddp"))
                lines.append(
                    f"| {model} | `{mode}` | {n} | {row['tokens_per_s']:,.0f} | {per_gpu:,.0f} "
                    f"| {same} / {ddp} | {row['mfu_nanochat']:.1%} / {row['mfu_in_document']:.1%} "
                    f"| {row['peak_mem_gb']:.1f} | {row['params_gb'] + row['optim_state_gb']:.2f} "
                    f"| {communication(row)} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON files and table.md")
    parser.add_argument("--table-only", action="store_true", help="only rebuild the table from OUT")
    parser.add_argument("overrides", nargs="*", help="bench_train.py's overrides (after --)")
    args = parser.parse_args()
    gpus = sorted(set(args.gpus))
    if min(gpus) < 1:
        parser.error(f"--gpus {min(gpus)}: every count must be at least 1")
    if not args.table_only:
        if not args.overrides:
            parser.error("give bench_train.py's overrides after --, or --table-only")
        on_cpu = "device=cpu" in args.overrides or not torch.cuda.is_available()
        if not on_cpu and max(gpus) > torch.cuda.device_count():
            parser.error(f"--gpus {max(gpus)}: this node has {torch.cuda.device_count()} GPUs")
        args.out.mkdir(parents=True, exist_ok=True)
        for n in gpus:
            for mode in args.modes:
                run(args.out, mode, n, args.overrides)
    rows = load(args.out, args.modes, gpus)
    if not rows:
        sys.exit(f"no results in {args.out} for modes {args.modes} on {gpus} GPUs")
    text = table(rows, args.modes, gpus)
    print(text)
    (args.out / "table.md").write_text(text)


if __name__ == "__main__":
    main()
