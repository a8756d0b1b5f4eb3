"""Helpers for the tests that run train.py in subprocesses: a tiny corpus, a tiny run's overrides, and
ways to start, watch, signal and compare runs."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from run.checkpoint import read_model_state

ROOT = Path(__file__).resolve().parents[1]


def write_corpus(path: Path, n_docs: int = 400, seed: int = 0) -> Path:
    """Documents of a small made-up language (a fixed word graph) that a tiny model learns quickly."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 6))) for _ in range(60)]
    follow = {w: rng.sample(words, 3) for w in words}
    with open(path, "w") as f:
        for i in range(n_docs):
            w, out = rng.choice(words), []
            for _ in range(rng.choice([5, 20, 60, 200])):
                out.append(w)
                w = rng.choice(follow[w])
            f.write(json.dumps({"id": f"doc{i}", "text": " ".join(out)}) + "\n")
    return path


def small_run(corpus, run_dir, *extra) -> list[str]:
    source, cache = corpus
    return [
        f"run_dir={run_dir}",
        f"data.source={source}",
        f"data.cache_dir={cache}",
        "data.vocab_size=320",
        "data.tokens_per_micro_batch=256",
        "data.max_seqlen=128",
        "data.max_num_docs=16",
        "model.depth=1",
        "model.head_dim=32",
        "compile=false",
        "max_steps=12",
        "total_batch_tokens=512",
        "save_every=4",
        "eval_every=6",
        "eval_tokens=512",
        "sample_every=6",
        "sample_tokens=8",
        *extra,
    ]


def train_env(env_extra=None) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true", **(env_extra or {})}


def run_train(args, *, torchrun_procs: int = 0, env_extra=None, check=True, timeout=600):
    if torchrun_procs:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={torchrun_procs}",
            *args[0],
            "train.py",
            *args[1],
        ]
    else:
        cmd = [sys.executable, "train.py", *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=train_env(env_extra), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
        )
    return proc


def start_train(args, log: Path, env_extra=None) -> subprocess.Popen:
    """train.py in the background, stdout and stderr into `log`."""
    out = open(log, "w")
    return subprocess.Popen(
        [sys.executable, "train.py", *args], cwd=ROOT, env=train_env(env_extra), stdout=out, stderr=out
    )


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    """Poll `condition` as fast as the filesystem answers until it holds; fail if the run ends first."""
    deadline = time.time() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}")
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.0002)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def final_weights(run_dir: Path, step: int) -> dict:
    return read_model_state(run_dir / "checkpoints" / f"step_{step:06d}")


def assert_same_run(run_dir: Path, reference: Path, step: int) -> None:
    """Bitwise: every step's loss, grad norm and evaluation, and the final weights."""
    got, want = metrics(run_dir), metrics(reference)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, step + 1))
    keys = ("loss", "grad_norm", "val_loss", "val_bpb", "sample")
    for a, b in zip(got, want, strict=True):
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}, (a["step"], a, b)
    mine, theirs = final_weights(run_dir, step), final_weights(reference, step)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


def mount_tmpfs(path: Path, options: str) -> bool:
    """Mount a tmpfs (a real filesystem that fills up) at `path`; False where that is not allowed."""
    path.mkdir()
    if sys.platform != "linux":
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    return proc.returncode == 0


def start_torchrun(
    procs: int, args: list[str], log: Path, torchrun_args=(), env_extra=None
) -> subprocess.Popen:
    """torchrun in the background, in a process group of its own, its ranks' output and its own into `log`."""
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={procs}",
                *torchrun_args,
                "train.py",
                *args,
            ],
            cwd=ROOT,
            env=train_env(env_extra),
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
        )


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return found


def rank_pids(proc: subprocess.Popen) -> dict[int, int]:
    """torchrun's workers by global rank (from their environment)."""
    ranks = {}
    for pid in children(proc.pid):
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        ranks[int(next(v for v in env if v.startswith(b"RANK="))[5:])] = pid
    return ranks


def kill_everything(proc: subprocess.Popen) -> None:
    """SIGKILL every rank (torchrun makes each the leader of a process group) and torchrun itself, at once:
    what a lost node does."""
    ranks = children(proc.pid) if proc.poll() is None else []
    for pid in ranks:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for pid in ranks:  # reaped by init: wait until gone, so the next run starts on a quiet machine
        for _ in range(2000):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            status = Path(f"/proc/{pid}/stat")
            if status.exists() and status.read_text().split(") ")[-1].startswith("Z"):
                break
            time.sleep(0.005)
