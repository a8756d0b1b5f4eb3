"""train.py end to end, in subprocesses: the default run, exact resume after SIGKILL, torchrun with two
ranks, wandb offline, and bad configs. Models and data are tiny; compile is off except where tested."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


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


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return write_corpus(root / "docs.jsonl"), root / "cache"


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


def run_train(args, *, torchrun_procs: int = 0, env_extra=None, check=True, timeout=600):
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "WANDB_SILENT": "true",
        **(env_extra or {}),
    }
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
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
        )
    return proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_default_run_learns_evaluates_samples_and_saves(tmp_path):
    """`python train.py` as a user runs it, shortened: stdlib data, compiled model, CPU."""
    run_dir = tmp_path / "run"
    proc = run_train(
        [
            f"run_dir={run_dir}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "max_steps=60",
            "eval_every=30",
            "sample_every=30",
            "save_every=30",
        ],
        env_extra={"TORCH_LOGS": "recompiles"},
    )
    records = metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 61))
    first, last = records[0]["loss"], sum(r["loss"] for r in records[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [30, 60]
    # Far below the start (ln 4096 = 8.3 nats, uniform guessing) on held-out files, and a sane bpb.
    assert evals[-1]["val_loss"] < first - 1.5 and 0 < evals[-1]["val_bpb"] < 4
    assert all(isinstance(r["sample"], str) for r in evals)
    for key in ("lr", "grad_norm", "tokens_per_s", "peak_mem_gb", "packing_efficiency"):
        assert all(key in r for r in records), key
    assert (run_dir / "checkpoints" / "step_000060.pt").is_file()
    assert "Recompiling" not in proc.stderr


def test_sigkill_after_checkpoint_then_resume_reproduces_losses(tmp_path, corpus):
    reference = tmp_path / "reference"
    run_train(small_run(corpus, reference))
    expected = metrics(reference)

    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "train.py", *small_run(corpus, killed)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    checkpoint = killed / "checkpoints" / "step_000008.pt"
    deadline = time.time() + 300
    while not checkpoint.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert checkpoint.exists()
    assert not (killed / "checkpoints" / "step_000012.pt").exists(), "the run finished before the kill"

    run_train(small_run(corpus, killed))
    resumed = metrics(killed)
    assert [r["step"] for r in resumed] == list(range(1, 13))
    for a, b in zip(resumed, expected, strict=True):
        assert (a["loss"], a["grad_norm"], a.get("val_loss")) == (
            b["loss"],
            b["grad_norm"],
            b.get("val_loss"),
        )


def test_torchrun_two_ranks_match_single_process(tmp_path, corpus):
    single = tmp_path / "single"
    run_train(small_run(corpus, single, "max_steps=6", "save_every=6"))
    ddp = tmp_path / "ddp"
    logs = tmp_path / "logs"
    proc = run_train(
        ([f"--log-dir={logs}", "--redirects=3"], small_run(corpus, ddp, "max_steps=6", "save_every=6")),
        torchrun_procs=2,
    )
    a, b = metrics(single), metrics(ddp)
    assert [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
        assert (
            y["val_loss"] == pytest.approx(x["val_loss"], rel=1e-4)
            if "val_loss" in x
            else "val_loss" not in y
        )
    rank_logs = {p.parent.name: p.read_text() for p in logs.rglob("std*.log") if p.stat().st_size}
    assert any(name == "0" for name in rank_logs), proc.stdout
    assert not [name for name in rank_logs if name != "0"], rank_logs  # only rank 0 prints


def test_wandb_offline_run_is_written_for_later_sync(tmp_path, corpus):
    run_dir = tmp_path / "run"
    run_train(
        small_run(
            corpus, run_dir, "max_steps=4", "wandb.mode=offline", "wandb.name=offline-test", "wandb.tags=[ci]"
        ),
        env_extra={"WANDB_API_KEY": ""},
    )
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    sync = subprocess.run(
        [sys.executable, "-m", "wandb", "sync", "--dry-run", str(runs[0])],
        capture_output=True,
        text=True,
        env={**os.environ, "WANDB_API_KEY": ""},
    )
    assert sync.returncode == 0 and "Would sync 1 run" in sync.stdout + sync.stderr
    # A resumed run continues the same wandb run id.
    run_train(
        small_run(corpus, run_dir, "max_steps=6", "wandb.mode=offline"), env_extra={"WANDB_API_KEY": ""}
    )
    ids = {p.name.rsplit("-", 1)[1] for p in (run_dir / "wandb").glob("offline-run-*")}
    assert len(ids) == 1, ids
    # A checkpoint of another model shape is refused, naming the difference.
    proc = run_train(small_run(corpus, run_dir, "max_steps=8", "model.depth=2"), check=False)
    assert proc.returncode != 0 and "n_layer: checkpoint 1 vs config 2" in proc.stderr
    disabled = tmp_path / "disabled"
    run_train(small_run(corpus, disabled, "max_steps=2"))
    assert not (disabled / "wandb").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.bogus=1", "bogus"),
        ("max_steps=ten", "max_steps"),
        ("model.n_kv_heads=3", "model.n_kv_heads"),
        ("total_batch_tokens=300", "total_batch_tokens"),
        ("wandb.mode=sometimes", "wandb.mode"),
        ("attention=magic", "attention"),
        ("data.max_num_docs=1", "max_num_docs"),
    ],
)
def test_bad_config_exits_nonzero_naming_the_key(tmp_path, corpus, override, message):
    proc = run_train(small_run(corpus, tmp_path / "run", override), check=False, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
