"""Plot train and validation loss against tokens for several runs, and print and save their summary.

    python scripts/compare_runs.py runs/d12/triton runs/d12/flex runs/d12/sdpa_packed \
        --out benchmarks/loss_curves_d12_h200.png

writes the PNG and, beside it, the summary as JSON (benchmarks/loss_curves_d12_h200.json; `--json` puts it
elsewhere). Each run is named by its folder. Per run: the last step and tokens seen, the train loss averaged
over the last 5% of steps, the last validation loss and bits per byte, and the median tokens/s.

Each RUN may be a run directory (its metrics.jsonl is read) or a wandb offline run
(`run_dir/wandb/offline-run-*`, or its `.wandb` file), read from wandb's own log file.
"""

import argparse
import json
import struct
from pathlib import Path

_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc, length, type)-framed chunks


def _wandb_chunks(data: bytes):
    if data[:4] != b":W&B":
        raise ValueError("not a .wandb file (bad magic)")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # full record
            yield chunk
        elif kind == 2:  # first piece
            pending = chunk
        elif kind == 3:  # middle piece
            pending += chunk
        elif kind == 4:  # last piece
            yield pending + chunk


def read_wandb(path: Path) -> list[dict]:
    from wandb.proto import wandb_internal_pb2

    if path.is_dir():
        found = sorted(path.glob("run-*.wandb"))
        if not found:
            raise FileNotFoundError(f"{path}: no run-*.wandb file in this wandb run directory")
        path = found[0]
    records = []
    for chunk in _wandb_chunks(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            records.append({k: v for k, v in row.items() if not k.startswith("_")})
    return records


def read_run(path: Path) -> list[dict]:
    """Per-step records; a step logged twice (re-run after a resume in wandb) keeps its last value."""
    if (path / "metrics.jsonl").is_file():
        records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line]
    elif path.suffix == ".wandb" or list(path.glob("run-*.wandb")):
        records = read_wandb(path)
    else:
        raise FileNotFoundError(f"{path}: neither a run directory with metrics.jsonl nor a wandb offline run")
    by_step = {r["step"]: r for r in records if "step" in r}
    return [by_step[s] for s in sorted(by_step)]


def summary(records: list[dict]) -> dict:
    evals = [r for r in records if "val_loss" in r]
    tail = records[-max(1, len(records) // 20) :]  # the last 5% of steps smooths step-to-step noise
    return {
        "steps": records[-1]["step"],
        "tokens": records[-1].get("tokens_seen"),
        "train_loss": sum(r["loss"] for r in tail) / len(tail),
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "val_bpb": evals[-1]["val_bpb"] if evals else None,
        "tokens_per_s": sorted(r["tokens_per_s"] for r in records)[len(records) // 2]
        if all("tokens_per_s" in r for r in records)
        else None,
    }


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, records in runs.items():
        tokens = [r.get("tokens_seen", r["step"]) for r in records]
        train_ax.plot(tokens, [r["loss"] for r in records], label=name, linewidth=1)
        evals = [r for r in records if "val_loss" in r]
        val_ax.plot(
            [r.get("tokens_seen", r["step"]) for r in evals],
            [r["val_loss"] for r in evals],
            marker="o",
            label=name,
        )
    for ax, title in ((train_ax, "train loss"), (val_ax, "validation loss")):
        ax.set_xlabel("tokens")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or wandb offline runs")
    parser.add_argument("--out", type=Path, default=Path("loss_curves.png"), help="PNG to write")
    parser.add_argument("--json", type=Path, help="where the summary goes (default: the PNG's path, .json)")
    args = parser.parse_args()
    runs = {}
    for path in args.runs:
        name = path.name if path.name not in runs else str(path)
        runs[name] = read_run(path)
    table = {name: summary(records) for name, records in runs.items()}
    header = f"{'run':<24} {'steps':>6} {'tokens':>12} {'train':>8} {'val':>8} {'val bpb':>8} {'tok/s':>10}"
    print(header)
    for name, s in table.items():

        def fmt(v, spec):
            return format(v, spec) if v is not None else "-"

        print(
            f"{name:<24} {s['steps']:>6} {fmt(s['tokens'], '>12,')} {s['train_loss']:>8.4f} "
            f"{fmt(s['val_loss'], '>8.4f')} {fmt(s['val_bpb'], '>8.4f')} {fmt(s['tokens_per_s'], '>10,.0f')}"
        )
    plot(runs, args.out)
    print(f"wrote {args.out}")
    summary_path = args.json or args.out.with_suffix(".json")
    summary_path.write_text(json.dumps(table, indent=2) + "\n")
    print(f"wrote {summary_path}")


if __name__ == "__main__":
    main()
