"""`parallel=ddp`, `zero` and `fsdp` end to end: train.py under torchrun with gloo ranks on the CPU, against
the uninterrupted single-process run of the same global batch. Every mode trains what one process trains;
their checkpoints (torch.distributed.checkpoint folders) resume bit for bit with the same ranks and mode,
and within float rounding on another number of ranks or in the other mode; a SIGKILL of every rank in the
middle of a save leaves the previous checkpoint to resume from, and a full disk in a save only fails that
save; a second launch on a run in use is refused. fsdp leaves the last block's weights gathered for the
backward.

Every run here is 8 steps of the tiny `small_run` model with a constant learning rate
(optim.warmdown_ratio=0), so that a run cut in two by max_steps=4 then max_steps=8 takes the same steps as
the uninterrupted one. The reference runs are made once per module (`Runs`)."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from configs.schema import ModelConfig
from model.gpt import GPT
from run.checkpoint import read_model_state, verify
from run.dist import DistInfo, init_distributed, shutdown
from run.parallel import parallelize
from tests.train_helpers import (
    assert_same_run,
    children,
    final_weights,
    kill_everything,
    logged_steps,
    metrics,
    mount_tmpfs,
    rank_pids,
    run_train,
    small_run,
    start_torchrun,
    wait_for,
)

STEPS = 8
HALF = 4
FIXED_LR = ("optim.warmdown_ratio=0",)
TIMEOUT = 300  # a run that hangs (a collective no rank answers) fails instead of eating the CI's budget
REL = 1e-4
# Final weights, per tensor: |a - b| / |b|. Losses agree to 1e-5 but weights less: the output projections
# start at zero and Muon orthogonalises their first updates, whose small singular directions are rounding
# (FSDP's reduce-scatter sums in another order than one process), so they drift by a few percent.
WEIGHTS_REL = 0.1


# ---- running train.py ------------------------------------------------------------------------------


def overrides(corpus, run_dir: Path, mode: str, steps: int, batch: int, *extra) -> list[str]:
    return small_run(
        corpus,
        run_dir,
        f"max_steps={steps}",
        "save_every=4",
        # An evaluation and a sample where a split run's first half ends, as in the uninterrupted run.
        "eval_every=4",
        "sample_every=4",
        f"eval_tokens={batch}",
        f"total_batch_tokens={batch}",
        f"parallel={mode}",
        *FIXED_LR,
        *extra,
    )


def train(corpus, run_dir: Path, procs: int, mode: str, steps: int = STEPS, batch: int = 512, *extra):
    """train.py in one plain process (procs=1) or under torchrun with `procs` gloo ranks."""
    args = overrides(corpus, run_dir, mode, steps, batch, *extra)
    if procs == 1:
        return run_train(args, timeout=TIMEOUT)
    return run_train(([], args), torchrun_procs=procs, timeout=TIMEOUT)


class Runs:
    """Runs shared by the tests of this module, each made once, on first use, and never written to after."""

    def __init__(self, corpus, root: Path):
        self.corpus, self.root, self.done = corpus, root, {}

    def get(self, procs: int, mode: str = "ddp", steps: int = STEPS, batch: int = 512, *extra) -> Path:
        key = (procs, mode, steps, batch, *extra)
        if key not in self.done:
            name = "-".join(str(k).replace("=", "_").replace("/", "_") for k in key)
            run_dir = self.root / name
            train(self.corpus, run_dir, procs, mode, steps, batch, *extra)
            self.done[key] = run_dir
        return self.done[key]

    def copy(self, dest: Path, *key) -> Path:
        """A copy of a shared run's folder (checkpoints and metrics), to be continued by a test."""
        shutil.copytree(self.get(*key), dest)
        return dest


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    return Runs(corpus, tmp_path_factory.mktemp("parallel_runs"))


# ---- comparing runs ----------------------------------------------------------------------------------


def assert_close_run(got_dir: Path, want_dir: Path, steps: int = STEPS, weights_rel: float = WEIGHTS_REL):
    """Every step's loss and every evaluation within float rounding (rel 1e-4) of the reference, grad
    norms within 1e-3; steps 1..steps, once each; the final weights close (relative norm of the
    difference, per tensor)."""
    got, want = metrics(got_dir), metrics(want_dir)
    assert [r["step"] for r in got] == list(range(1, steps + 1)), [r["step"] for r in got]
    assert [r["step"] for r in want] == list(range(1, steps + 1))
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=REL), (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=10 * REL), (a["step"], a, b)
        assert ("val_loss" in a) == ("val_loss" in b), a["step"]
        if "val_loss" in b:
            assert a["val_loss"] == pytest.approx(b["val_loss"], rel=REL), (a["step"], a, b)
            assert a["val_bpb"] == pytest.approx(b["val_bpb"], rel=REL), (a["step"], a, b)
        assert a["tokens_seen"] == b["tokens_seen"]
    # The losses are not all alike: the comparison says something (the model learns over the steps).
    assert want[-1]["loss"] < 0.9 * want[0]["loss"]
    mine, theirs = final_weights(got_dir, steps), final_weights(want_dir, steps)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert mine[name].shape == theirs[name].shape, name
        rel = ((mine[name] - theirs[name]).norm() / theirs[name].norm()).item()
        assert rel <= weights_rel, (name, rel)


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def dcp_metadata(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata().state_dict_metadata


def assert_checkpoint_layout(path: Path, world_size: int, mode: str) -> None:
    """A DCP folder: `.metadata`, one `__<rank>_0.distcp` per rank, `run_state.pt` and a manifest that
    names the world size and mode and hashes every other file."""
    names = sorted(p.name for p in path.iterdir())
    shards = [f"__{r}_0.distcp" for r in range(world_size)]
    assert names == sorted([".metadata", "manifest.json", "run_state.pt", *shards]), names
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["world_size"] == world_size and manifest["parallel"] == mode
    assert manifest["config"]["parallel"] == mode
    assert sorted(manifest["files"]) == sorted(n for n in names if n != "manifest.json")
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry["size"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest(), name


def model_chunks(path: Path) -> dict[str, int]:
    """How many pieces each model tensor of a checkpoint was saved in (one per rank holding a shard)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: len(entry.chunks)
        for key, entry in dcp_metadata(path).items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }


def resumed_line(proc, run_dir: Path, step: int, procs: int, mode: str) -> bool:
    """Rank 0 says which checkpoint it resumed from, and with how many ranks and which mode it was written."""
    said = f"resumed from {checkpoint(run_dir, step)} at step {step} (written by {procs} rank"
    return any(said in line and f"parallel={mode})" in line for line in proc.stdout.splitlines())


# ---- the two modes train what one process trains ----------------------------------------------------


@pytest.mark.parametrize("mode", ["ddp", "zero", "fsdp"])
def test_two_ranks_match_the_single_process_run(runs, mode):
    single, ranks = runs.get(1), runs.get(2, mode)
    assert_close_run(ranks, single)
    for step in (HALF, STEPS):
        assert_checkpoint_layout(checkpoint(ranks, step), 2, mode)
    assert_checkpoint_layout(checkpoint(single, STEPS), 1, "ddp")
    chunks = model_chunks(checkpoint(ranks, STEPS))
    assert chunks and chunks.keys() == model_chunks(checkpoint(single, STEPS)).keys()
    if mode == "fsdp":
        # Sharded: every parameter (all have a first dimension divisible by 2 here) in one piece per rank.
        assert set(chunks.values()) == {2}, chunks
    else:
        assert set(chunks.values()) == {1}, chunks  # every rank holds it whole; written once


def test_zero_in_one_process_is_the_plain_run(runs):
    """One rank has nothing to shard: parallel=zero (the default) trains ddp's run bit for bit."""
    zero, plain = runs.get(1, "zero"), runs.get(1, "ddp")
    assert_same_run(zero, plain, STEPS)
    assert_checkpoint_layout(checkpoint(zero, STEPS), 1, "zero")


def test_four_fsdp_ranks_match_the_single_process_run(runs):
    """total_batch_tokens=1024: one micro-batch per rank and step on 4 ranks, 4 in one process."""
    single, ranks = runs.get(1, "ddp", STEPS, 1024), runs.get(4, "fsdp", STEPS, 1024)
    assert_close_run(ranks, single)
    assert_checkpoint_layout(checkpoint(ranks, STEPS), 4, "fsdp")
    assert set(model_chunks(checkpoint(ranks, STEPS)).values()) == {4}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_compiled_ranks_match_the_compiled_single_process_run(runs, mode):
    steps = HALF  # compiling on 2 CPU cores is most of the time: fewer steps (a save and eval at the end)
    single = runs.get(1, "ddp", steps, 512, "compile=true")
    ranks = runs.get(2, mode, steps, 512, "compile=true")
    assert_close_run(ranks, single, steps)
    # Compiled and eager agree too (the compiled model is the same function).
    eager = runs.get(1, "ddp", steps, 512)
    for a, b in zip(metrics(ranks), metrics(eager), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), a["step"]


# ---- resuming -----------------------------------------------------------------------------------------


# ddp's bitwise resume is also what the SIGKILL test below checks in CI: its run here is with the slow tests.
@pytest.mark.parametrize("mode", [pytest.param("ddp", marks=pytest.mark.slow), "zero", "fsdp"])
def test_resume_with_the_same_ranks_and_mode_is_bitwise(runs, tmp_path, corpus, mode):
    run_dir = runs.copy(tmp_path / "run", 2, mode, HALF)
    proc = train(corpus, run_dir, 2, mode)
    assert resumed_line(proc, run_dir, HALF, 2, mode), proc.stdout
    assert_same_run(run_dir, runs.get(2, mode), STEPS)


@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_resume_on_four_ranks_is_bitwise(runs, tmp_path, corpus, mode):
    """Four ranks, where the order in which the ranks' terms are summed depends on where each gradient sits
    in the tensor reduced. DDP (`zero`) reduces the first step after it is built in other buckets than
    later steps, so its gradients are reduced each on its own; `fsdp` reduce-scatters each block's own
    buffer, the same in every run."""
    run_dir = runs.copy(tmp_path / "run", 4, mode, HALF, 1024)
    proc = train(corpus, run_dir, 4, mode, STEPS, 1024)
    assert resumed_line(proc, run_dir, HALF, 4, mode), proc.stdout
    assert_same_run(run_dir, runs.get(4, mode, STEPS, 1024), STEPS)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_background_saves_write_the_same_checkpoints_and_the_same_run(runs, mode):
    """async_save=true: checkpoints written by a thread while training goes on hold the same bits as the
    synchronous saves of the same run, every one verifies, and the run itself is unchanged."""
    background = runs.get(2, mode, STEPS, 512, "async_save=true")
    plain = runs.get(2, mode)
    assert_same_run(background, plain, STEPS)
    assert steps_saved(background) == steps_saved(plain) and temporaries(background) == []
    for name in steps_saved(background):
        verify(background / "checkpoints" / name)
        got, want = (read_model_state(run / "checkpoints" / name) for run in (background, plain))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name


# (ranks, mode) of the first half, (ranks, mode) of the second, total_batch_tokens.
RESHARDS = {
    "ddp2-to-1": ((2, "ddp"), (1, "ddp"), 512),
    "1-to-ddp2": ((1, "ddp"), (2, "ddp"), 512),
    "ddp2-to-ddp4": ((2, "ddp"), (4, "ddp"), 1024),
    "ddp2-to-fsdp2": ((2, "ddp"), (2, "fsdp"), 512),
    "fsdp2-to-1": ((2, "fsdp"), (1, "ddp"), 512),
    "ddp2-to-zero2": ((2, "ddp"), (2, "zero"), 512),
    "zero4-to-1": ((4, "zero"), (1, "ddp"), 1024),
}


@pytest.mark.parametrize("case", list(RESHARDS))
def test_resume_on_other_ranks_or_mode_continues_the_run(runs, tmp_path, corpus, case):
    (procs_a, mode_a), (procs_b, mode_b), batch = RESHARDS[case]
    run_dir = runs.copy(tmp_path / "run", procs_a, mode_a, HALF, batch)
    proc = train(corpus, run_dir, procs_b, mode_b, STEPS, batch)
    assert resumed_line(proc, run_dir, HALF, procs_a, mode_a), proc.stdout
    # Steps 1..8, once each; all within rounding of the uninterrupted single process run (the first half
    # is the shared run's own, the second half is what this test checks).
    reference = runs.get(1, "ddp", STEPS, batch)
    assert_close_run(run_dir, reference)
    got = metrics(run_dir)
    assert [r["tokens_seen"] for r in got] == [batch * s for s in range(1, STEPS + 1)]
    assert_checkpoint_layout(checkpoint(run_dir, STEPS), procs_b, mode_b)


# ---- SIGKILL of every rank around and inside a save ----------------------------------------------------


def temporaries(run_dir: Path) -> list[Path]:
    folder = run_dir / "checkpoints"
    return [p for p in folder.iterdir() if ".tmp-" in p.name] if folder.is_dir() else []


def steps_saved(run_dir: Path) -> list[str]:
    folder = run_dir / "checkpoints"
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("step_")) if folder.is_dir() else []


def kill_trigger(point: str, run_dir: Path, log: Path):
    """When to kill: after a logged step, once a new checkpoint is renamed into place, or inside a save
    (a temporary folder of this run, holding the named file if any). Only once this run is set up (its
    "model:" line printed): by then it has cut the killed run's metrics back to its checkpoint."""

    def started() -> bool:
        return "model: " in log.read_text()

    if point.startswith("step "):
        n = int(point.split()[1])
        return lambda: started() and logged_steps(run_dir) >= n
    if point == "renamed":
        before = set(steps_saved(run_dir))
        return lambda: bool(set(steps_saved(run_dir)) - before)
    stale = {p.name for p in temporaries(run_dir)}  # left by the previous kill, removed by this run's start
    inside = {
        "saving": None,
        "a shard written": "__1_0.distcp",
        "metadata written": ".metadata",
        "run state written": "run_state.pt",
        "manifest written": "manifest.json",
    }[point]

    def hit() -> bool:
        try:
            return any(
                t.name not in stale and (inside is None or (t / inside).exists())
                for t in temporaries(run_dir)
            )
        except FileNotFoundError:  # a folder renamed or removed while listed
            return False

    return hit


def assert_checkpoints_intact(run_dir: Path) -> None:
    """Whatever the kill interrupted, every folder under a checkpoint's name verifies (hashes and all)."""

    for name in steps_saved(run_dir):
        if name.endswith(".damaged"):
            continue
        verify(run_dir / "checkpoints" / name)


def kill_and_resume(runs, tmp_path, corpus, mode: str, points: list[str]) -> None:
    run_dir = tmp_path / "run"
    # A save every 2 steps (4 in the run): the kill points meet saves often. Losses do not depend on it.
    args = overrides(corpus, run_dir, mode, STEPS, 512, "save_every=2", "keep_last=2")
    orphans_removed, inside_saves, resumed_after_inside = 0, 0, 0
    newest, inside = None, False  # the newest checkpoint left by the last kill; whether it was in a save
    for i, point in enumerate(points + ["the end"]):
        log = tmp_path / f"log{i}"
        if point == "the end":
            proc = run_train(([], args), torchrun_procs=2, timeout=TIMEOUT)
            log.write_text(proc.stdout + proc.stderr)
        else:
            proc = start_torchrun(2, args, log)
            try:
                wait_for(kill_trigger(point, run_dir, log), proc, f"kill point {point!r}", timeout=TIMEOUT)
            finally:
                kill_everything(proc)
        text = log.read_text()
        orphans_removed += "left by a save that never finished" in text
        if newest is not None:
            # Every restart goes on from the newest checkpoint the kill left: after a kill inside a save,
            # the one before that save.
            assert f"resumed from {run_dir / 'checkpoints' / newest} at step {int(newest[5:])}" in text, (
                point,
                text[-3000:],
            )
            resumed_after_inside += inside
        if point == "the end":
            break
        inside = bool(temporaries(run_dir)) and not point.startswith(("step", "renamed"))
        inside_saves += inside
        assert_checkpoints_intact(run_dir)
        newest = max((n for n in steps_saved(run_dir) if n[5:].isdigit()), default=None)
    # Steps 1..8 exactly as the uninterrupted run of the same ranks and mode.
    assert_same_run(run_dir, runs.get(2, mode), STEPS)
    assert inside_saves >= 1, "no kill landed inside a save"
    assert resumed_after_inside >= 1, "no kill inside a save had an earlier checkpoint to go back to"
    assert orphans_removed >= 1, "no restart found the temporary folder of a killed save"
    assert temporaries(run_dir) == []


# After a checkpoint exists (step 3: step 2 saved), two points inside the next save (its folder just made,
# its manifest written): each restart goes back to step 2. KILLS_SLOW has every point.
KILLS_CI = ["step 3", "saving", "manifest written"]
KILLS_SLOW = [
    "saving",  # the first save: no checkpoint to go back to, the restart starts afresh
    "a shard written",
    "metadata written",
    "run state written",
    "manifest written",
    "renamed",
    "step 5",
    "saving",
    "run state written",
    "renamed",
]


def test_sigkill_of_every_rank_around_and_inside_saves_resumes_bitwise(runs, tmp_path, corpus):
    kill_and_resume(runs, tmp_path, corpus, "ddp", KILLS_CI)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_sigkill_at_every_point_of_a_save_resumes_bitwise(runs, tmp_path, corpus, mode):
    kill_and_resume(runs, tmp_path, corpus, mode, KILLS_SLOW)


# ---- the lock under torchrun ------------------------------------------------------------------------------


def test_second_launch_on_a_run_in_use_is_refused_and_the_first_goes_on(runs, tmp_path, corpus):
    """While two ranks train (held by SIGSTOP), a second two-rank launch on the same run_dir is refused
    before any data work, naming the first run's rank 0; the first then finishes as the uninterrupted run."""
    run_dir = tmp_path / "run"
    args = overrides(corpus, run_dir, "ddp", STEPS, 512)
    log = tmp_path / "first.log"
    first = start_torchrun(2, args, log)
    try:
        wait_for(lambda: logged_steps(run_dir) >= 2, first, "step 2", timeout=TIMEOUT)
        ranks = rank_pids(first)
        for pid in ranks.values():
            os.kill(pid, signal.SIGSTOP)
        try:
            second = run_train(([], args), torchrun_procs=2, check=False, timeout=TIMEOUT)
        finally:
            for pid in ranks.values():
                os.kill(pid, signal.SIGCONT)
        assert first.wait(timeout=TIMEOUT) == 0, log.read_text()[-3000:]
    finally:
        kill_everything(first)
    assert second.returncode != 0
    assert f"is in use by another run: pid {ranks[0]}" in second.stdout + second.stderr
    assert "data:" not in second.stdout  # refused before anything else
    assert_same_run(run_dir, runs.get(2), STEPS)


# ---- a full disk during a distributed save ---------------------------------------------------------------


def test_full_disk_during_a_distributed_save_training_goes_on(runs, tmp_path, corpus):
    """Two ranks, a checkpoint every step, and the run_dir's filesystem (a tmpfs of few inodes) full in the
    middle of a save: one rank's shard meets ENOSPC, every rank learns the save failed, rank 0 removes the
    temporary folder and says so, training goes on, the next save succeeds once there is room, and the run
    ends as the uninterrupted one, bit for bit."""
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "size=64m,nr_inodes=400"):
        pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
    try:
        run_dir = disk / "run"
        log = tmp_path / "log"
        proc = start_torchrun(2, overrides(corpus, run_dir, "ddp", STEPS, 512, "save_every=1"), log)
        try:
            wait_for(lambda: "step_000002" in steps_saved(run_dir), proc, "the second checkpoint")
            ranks = children(proc.pid)
            for pid in ranks:
                os.kill(pid, signal.SIGSTOP)
            filler = disk / "filler"
            filler.mkdir()
            for i in range(os.statvfs(disk).f_ffree - 2):  # room for the temporary folder and one file
                (filler / str(i)).touch()
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
            wait_for(lambda: "No space left on device" in log.read_text(), proc, "ENOSPC", timeout=TIMEOUT)
            for pid in ranks:  # held while the room comes back, so that the run cannot end meanwhile
                os.kill(pid, signal.SIGSTOP)
            failed = logged_steps(run_dir)
            for p in filler.iterdir():
                p.unlink()
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
            assert proc.wait(timeout=TIMEOUT) == 0, log.read_text()[-3000:]
        finally:
            kill_everything(proc)
        text = log.read_text()
        assert "not written: [Errno 28] No space left on device" in text
        assert "Training goes on" in text
        assert failed < STEPS and steps_saved(run_dir)[-1] == f"step_{STEPS:06d}"
        assert temporaries(run_dir) == []  # the failed save's folder is gone
        for name in steps_saved(run_dir):
            verify(run_dir / "checkpoints" / name)
        assert_same_run(run_dir, runs.get(2), STEPS)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# ---- fsdp's resharding -------------------------------------------------------------------------------


def test_fsdp_keeps_the_last_blocks_weights_gathered_for_the_backward():
    """reshard_after_forward frees every block's gathered weights after its forward but the last one's, which
    the backward needs first; with it off, every block keeps them."""
    info = init_distributed("cpu", group_of_one=True)
    try:
        for reshard in (True, False):
            torch.manual_seed(0)
            model = GPT(ModelConfig(depth=3, head_dim=16, aspect_ratio=16), 64, "reference", 32)
            parallel = parallelize(model, "fsdp", info, compile=False, reshard_after_forward=reshard)
            ids = torch.randint(0, 64, (32,))
            cu = torch.tensor([0, 20, 32], dtype=torch.int32)
            pos = torch.cat([torch.arange(20), torch.arange(12)])
            loss = parallel.forward(ids, pos, cu, 32, ids.roll(-1))
            gathered = [not isinstance(block.attn.c_q.weight, DTensor) for block in model.blocks]
            assert gathered == ([False, False, True] if reshard else [True, True, True]), reshard
            loss.backward()  # the weights are resharded after the backward, and the gradients sharded
            assert all(isinstance(p.grad, DTensor) for p in model.parameters())
    finally:
        shutdown(info)


def test_compiled_fsdp_blocks_train_and_evaluate_without_recompiling():
    """Training (grad on) and evaluation (no_grad) run the same blocks, of two attention windows: each grad
    mode and window has its own graph, compiled once, and all give what the eager model gives."""
    info = init_distributed("cpu", group_of_one=True)
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        cfg = ModelConfig(depth=4, head_dim=16, aspect_ratio=16, window_pattern="SSSL", short_window=8)
        model, eager = GPT(cfg, 64, "reference", 32), GPT(cfg, 64, "reference", 32)
        eager.load_state_dict(model.state_dict())
        parallel = parallelize(model, "fsdp", info, compile=True, reshard_after_forward=True)
        cu = torch.tensor([0, 20, 32], dtype=torch.int32)
        pos = torch.cat([torch.arange(20), torch.arange(12)])
        with torch._dynamo.config.patch(error_on_recompile=True):
            for seed in range(2):  # train, evaluate, train, evaluate: a recompile would raise
                ids = torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(seed))
                loss = parallel.forward(ids, pos, cu, 32, ids.roll(-1))
                loss.backward()
                torch.testing.assert_close(loss, eager(ids, pos, cu, 32, ids.roll(-1)))
                with torch.no_grad():
                    got = parallel.token_losses(ids, pos, cu, 32, ids.roll(-1))
                    torch.testing.assert_close(got, eager.token_losses(ids, pos, cu, 32, ids.roll(-1)))
    finally:
        torch._dynamo.reset()
        shutdown(info)


# ---- ddp's buckets ---------------------------------------------------------------------------------------


def bucket_rank(rank: int, root: Path) -> None:
    """One rank of two: a backward through DDP with the default buckets and with one bucket for everything
    (ddp_bucket_mb=1000); their bucket caps and gradients to root/rank<r>.pt."""
    dist.init_process_group(
        "gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    info = DistInfo(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"))
    out = {}
    for bucket_mb in (None, 1000.0):
        torch.manual_seed(0)
        model = GPT(ModelConfig(depth=2, head_dim=16, aspect_ratio=16), 64, "reference", 32)
        parallel = parallelize(
            model, "ddp", info, compile=False, reshard_after_forward=True, ddp_bucket_mb=bucket_mb
        )
        ids = torch.randint(0, 64, (32,), generator=torch.Generator().manual_seed(rank))
        cu = torch.tensor([0, 20, 32], dtype=torch.int32)
        pos = torch.cat([torch.arange(20), torch.arange(12)])
        parallel.forward(ids, pos, cu, 32, ids.roll(-1)).backward()
        out[bucket_mb] = (parallel.ddp.bucket_bytes_cap, [p.grad.clone() for p in model.parameters()])
    torch.save(out, root / f"rank{rank}.pt")
    dist.barrier()
    os._exit(0)  # without tearing gloo down, as tests/eval/test_core.py's rank_main


def test_ddp_bucket_size_reaches_ddp_and_leaves_the_gradients_as_they_are(tmp_path):
    """ddp_bucket_mb sets DDP's bucket cap (one bucket for the whole model at 1000 MB); the all-reduced
    gradients hold the same bits with one bucket as with DDP's default ones, on every rank."""
    mp.start_processes(bucket_rank, args=(tmp_path,), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for got in ranks:
        (default_cap, default_grads), (one_cap, one_grads) = got[None], got[1000.0]
        assert default_cap == 25 * 2**20 and one_cap == 1000 * 2**20
        assert all(torch.equal(a, b) for a, b in zip(default_grads, one_grads, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ranks[0][None][1], ranks[1][None][1], strict=True))
