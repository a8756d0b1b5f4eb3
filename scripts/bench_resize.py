"""Kill a run on N GPUs as a lost node would, resume it on M GPUs (and on N again), and compare the losses
with the uninterrupted run.

    python scripts/bench_resize.py --gpus 4 --then 2 4 --kill-after 10 --out benchmarks/resize_d20_h200 -- \
        model.depth=20 data.source='corpus/*.parquet' ... max_steps=16 save_every=4 parallel=fsdp

Every run is `torchrun --standalone --nproc_per_node=... train.py OVERRIDES run_dir=WORK/NAME`, one after
the other, its output in WORK/NAME.log. WORK (--work, a fresh temporary folder by default) holds the run
folders, checkpoints and all, so it is never under OUT:
- reference: N GPUs, to max_steps;
- killed: N GPUs, every rank and torchrun SIGKILLed at once when metrics.jsonl holds --kill-after steps
  and a checkpoint is in place;
- resumed_on_M, for each M of --then: a copy of the killed run's folder, which train.py continues from its
  newest checkpoint on M GPUs.

Each resumed run is compared with the reference step by step: the largest relative difference of the train
loss and of the validation loss after the step it resumed from, and whether every step's loss, grad norm and
validation loss holds the same bits, which M == N gives with deterministic=true (the default); on other M the
gradients are summed in another order, so the losses agree within float rounding. OUT/resize.json holds the
comparison, OUT/loss.png the loss curves (scripts/compare_runs.py's plot).
"""

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.compare_runs import plot, read_run  # noqa: E402

RESUMED = re.compile(r"resumed from (\S+) at step (\d+) \(written by (\d+) rank\(s\), parallel=(\w+)\)")
COMPARED = ("loss", "grad_norm", "val_loss")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}  # the logs keep up with the runs


def override(overrides: list[str], key: str) -> str | None:
    """The value the overrides give `key` (as key=, +key= or ++key=); the last one if given twice."""
    values = [o.split("=", 1)[1] for o in overrides if "=" in o and o.split("=", 1)[0].lstrip("+") == key]
    return values[-1] if values else None


def step_count(parser, overrides: list[str], key: str) -> int:
    value = override(overrides, key)
    if value is None:
        parser.error(f"give {key}=... in train.py's overrides after --: --kill-after is checked against it")
    try:
        return int(value)
    except ValueError:
        parser.error(f"{key}={value}: not a whole number")


def torchrun(gpus: int, overrides: list[str], run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
        str(ROOT / "train.py"),
        *overrides,
        f"run_dir={run_dir}",
    ]


def fail(what: str, log: Path) -> None:
    sys.exit(f"{what}; the end of {log}:\n{log.read_text(errors='replace')[-5000:]}")


def run_to_end(cmd: list[str], log: Path) -> str:
    """Run `cmd` to completion, its output into `log`; that output."""
    print(f"$ {shlex.join(cmd)} > {log}", flush=True)
    with open(log, "w") as out:
        try:
            subprocess.run(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, check=True)
        except subprocess.CalledProcessError as err:
            fail(f"exit {err.returncode}", log)
    return log.read_text(errors="replace")


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def checkpoints(run_dir: Path) -> list[int]:
    """The steps of the checkpoints in place (a save writes a temporary folder, then renames it)."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name[5:]) for p in folder.glob("step_*") if p.name[5:].isdigit())


def children(pid: int) -> list[int]:
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:  # already gone
        return []
    for task in tasks:
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return found


def gone(pid: int) -> bool:
    """Exited (a zombie has given back its memory, GPU memory included)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def kill_everything(proc: subprocess.Popen) -> None:
    """SIGKILL every rank and torchrun at once, as a lost node. torchrun makes each rank the leader of a
    process group of its own, so each group is killed, and torchrun's (a session of its own)."""
    ranks = children(proc.pid) if proc.poll() is None else []
    for group in [*ranks, proc.pid]:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.time() + 60  # the next run starts once the GPUs are free
    while not all(gone(pid) for pid in ranks) and time.time() < deadline:
        time.sleep(0.01)


def kill_midway(cmd: list[str], run_dir: Path, log: Path, kill_after: int, max_steps: int) -> int:
    """Start the run and kill it once kill_after steps are logged and a checkpoint is in place (a background
    save seals later than its step is logged); the steps logged by then."""
    print(f"$ {shlex.join(cmd)} > {log}  (killed after step {kill_after})", flush=True)
    with open(log, "w") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while logged_steps(run_dir) < kill_after or not checkpoints(run_dir):
            if proc.poll() is not None:
                fail(f"the run exited ({proc.returncode}) before step {kill_after} and a checkpoint", log)
            time.sleep(0.001)
    finally:
        kill_everything(proc)
    logged = logged_steps(run_dir)
    if logged >= max_steps:
        fail(f"the run reached max_steps={max_steps} before it was killed; raise max_steps", log)
    return logged


def compare(got: list[dict], want: list[dict], resumed_step: int) -> dict:
    after = [(a, b) for a, b in zip(got, want, strict=True) if a["step"] > resumed_step]

    def worst(key: str) -> float | None:
        diffs = [abs(a[key] - b[key]) / abs(b[key]) for a, b in after if key in a and key in b]
        return max(diffs) if diffs else None

    return {
        "steps_compared": len(after),
        "max_rel_diff_loss": worst("loss"),
        "max_rel_diff_val_loss": worst("val_loss"),
        "val_steps": [a["step"] for a, _ in after if "val_loss" in a],
        "bitwise": all(a.get(k) == b.get(k) for a, b in zip(got, want, strict=True) for k in COMPARED),
        "last_loss": got[-1]["loss"],
        "reference_last_loss": want[-1]["loss"],
    }


def resume_leg(gpus: int, killed: Path, work: Path, overrides: list[str], reference: list[dict]) -> dict:
    run_dir = work / f"resumed_on_{gpus}"
    shutil.copytree(killed, run_dir)
    log = work / f"resumed_on_{gpus}.log"
    found = RESUMED.search(run_to_end(torchrun(gpus, overrides, run_dir), log))
    if found is None:
        fail("no 'resumed from ... at step' line: the run did not continue from a checkpoint", log)
    print(found[0], flush=True)
    records = read_run(run_dir)
    steps = [r["step"] for r in records]
    if steps != [r["step"] for r in reference]:
        fail(f"{run_dir / 'metrics.jsonl'} holds steps {steps}, the reference's differ", log)
    return {
        "gpus": gpus,
        "resumed_from": Path(found[1]).name,
        "resumed_from_step": int(found[2]),
        "written_by_ranks": int(found[3]),
        "written_by_parallel": found[4],
        **compare(records, reference, int(found[2])),
    }


def environment(on_cpu: bool) -> dict:
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return {
        "device": "cpu" if on_cpu else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton,
        "gpu_count": torch.cuda.device_count(),
    }


def show(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def table(result: dict) -> str:
    lines = [
        f"{'GPUs':>9} {'resumed at':>10} {'loss rel diff':>13} {'val rel diff':>12} {'bitwise':>7} "
        f"{'last loss':>9} {'reference':>9}"
    ]
    for leg in result["legs"]:
        lines.append(
            f"{result['gpus']:>4} -> {leg['gpus']:<2} {leg['resumed_from_step']:>10} "
            f"{show(leg['max_rel_diff_loss']):>13} {show(leg['max_rel_diff_val_loss']):>12} "
            f"{'yes' if leg['bitwise'] else 'no':>7} {leg['last_loss']:>9.4f} "
            f"{leg['reference_last_loss']:>9.4f}"
        )
    return "\n".join(lines)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the reference and the killed run")
    parser.add_argument("--then", type=int, nargs="+", required=True, help="GPUs of each resumed run")
    parser.add_argument("--kill-after", type=int, required=True, help="steps logged before the kill")
    parser.add_argument("--out", type=Path, required=True, help="folder for resize.json and loss.png")
    parser.add_argument("--work", type=Path, help="folder for the run folders (default: a new temporary one)")
    parser.add_argument("overrides", nargs="*", help="train.py's overrides (after --)")
    args = parser.parse_args()

    counts = [args.gpus, *args.then]
    if min(counts) < 1:
        parser.error(f"--gpus/--then {min(counts)}: every count must be at least 1")
    if len(set(args.then)) < len(args.then):
        parser.error(f"--then {' '.join(map(str, args.then))}: each count once")
    if override(args.overrides, "run_dir") is not None:
        parser.error("run_dir: set by this script (under --work); leave it out of the overrides")
    max_steps = step_count(parser, args.overrides, "max_steps")
    save_every = step_count(parser, args.overrides, "save_every")
    if args.kill_after >= max_steps:
        parser.error(f"--kill-after {args.kill_after}: must be less than max_steps={max_steps}")
    if args.kill_after < save_every:
        parser.error(
            f"--kill-after {args.kill_after}: must be at least save_every={save_every}, "
            "so that a checkpoint exists to resume from"
        )
    on_cpu = "device=cpu" in args.overrides or not torch.cuda.is_available()
    if not on_cpu and max(counts) > torch.cuda.device_count():
        parser.error(f"--gpus/--then {max(counts)}: this node has {torch.cuda.device_count()} GPUs")
    if args.work is not None:
        work = args.work.resolve()
        if work.is_relative_to(args.out.resolve()):
            parser.error(f"--work {args.work}: the run folders are big; keep them out of --out {args.out}")
        names = ["reference", "killed", *(f"resumed_on_{m}" for m in args.then)]
        taken = [n for n in names if (work / n).exists() or (work / f"{n}.log").exists()]
        if taken:
            parser.error(f"--work {args.work} already holds {', '.join(taken)}: give an empty folder")
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="bench_resize_"))
    args.out.mkdir(parents=True, exist_ok=True)

    n = args.gpus
    run_to_end(torchrun(n, args.overrides, work / "reference"), work / "reference.log")
    reference = read_run(work / "reference")
    killed = work / "killed"
    killed_at = kill_midway(
        torchrun(n, args.overrides, killed), killed, work / "killed.log", args.kill_after, max_steps
    )
    print(f"killed after step {killed_at}; checkpoints in place: {checkpoints(killed)}", flush=True)
    legs = [resume_leg(m, killed, work, args.overrides, reference) for m in args.then]

    result = {
        "env": environment(on_cpu),
        # How the runs were made; where their files went (--out, --work) is no part of it.
        "command": shlex.join(
            ["scripts/bench_resize.py", "--gpus", str(n), "--then", *map(str, args.then)]
            + ["--kill-after", str(args.kill_after), "--", *args.overrides]
        ),
        "gpus": n,
        "kill_after": args.kill_after,
        "killed_at_step": killed_at,
        "max_steps": max_steps,
        "save_every": save_every,
        "legs": legs,
    }
    temporary = args.out / "resize.json.tmp"
    temporary.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(temporary, args.out / "resize.json")
    curves = {f"reference, {n} GPUs": reference}
    for leg in legs:
        name = f"killed at step {killed_at} on {n}, resumed at {leg['resumed_from_step']} on {leg['gpus']}"
        curves[name] = read_run(work / f"resumed_on_{leg['gpus']}")
    plot(curves, args.out / "loss.png")
    print(table(result))
    print(f"wrote {args.out / 'resize.json'} and {args.out / 'loss.png'}; run folders in {work}")


if __name__ == "__main__":
    main()
