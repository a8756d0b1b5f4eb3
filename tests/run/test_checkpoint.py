"""Checkpoint folders: atomic writes, checksums, fallback past damaged ones, keep-last-K, full disks, and
the resume checks that name every difference."""

import json
import os
import subprocess

import pytest
import torch

from run import checkpoint
from run.checkpoint import (
    MANIFEST,
    Checkpointer,
    CheckpointInvalid,
    CheckpointMismatch,
    check_compatible,
    check_resume,
    load,
    read_tensors,
)
from tests.train_helpers import mount_tmpfs

ABOUT = {
    "config": {"model": {"depth": 2}, "optim": {"name": "muon"}, "data": {}, "seed": 1},
    "world_size": 1,
    "shape": {"n_layer": 2},
    "tokenizer_id": "tok",
}


def tensors(step: int, numel: int = 1000) -> dict:
    return {"model": {"w": torch.arange(numel, dtype=torch.float32) * step}}


def run_state(step: int) -> dict:
    return {"step": step, "rng": (step, [1, 2])}


def save(ck: Checkpointer, step: int, numel: int = 1000, about: dict = ABOUT, **extra):
    return ck.save(step, tensors(step, numel), {**run_state(step), **extra}, about)


def read_w(path) -> torch.Tensor:
    state = {"model": {"w": torch.empty(1000)}}
    read_tensors(path, state)
    return state["model"]["w"]


def test_save_load_keeps_last_k(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=2)
    assert ck.latest_valid() is None
    for step in (10, 20, 30):
        assert save(ck, step) == ck.path(step)
    assert [p.name for p in ck.all()] == ["step_000020", "step_000030"]
    loaded = ck.latest_valid()
    assert loaded.path == ck.path(30) and loaded.manifest["step"] == 30
    assert torch.equal(read_w(loaded.path), tensors(30)["model"]["w"]) and loaded.run_state == run_state(30)
    assert loaded.manifest["config"] == ABOUT["config"]


def test_crash_during_save_leaves_previous_checkpoint_and_orphan_is_removed(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path, keep_last=2)
    save(ck, 1)

    def dies_midway(path, data):
        path.write_bytes(data[:100])
        raise KeyboardInterrupt  # the process is stopped while writing, after the tensors

    monkeypatch.setattr(checkpoint, "write_durably", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        save(ck, 2)
    monkeypatch.undo()
    assert [p.name for p in ck.all()] == ["step_000001"]
    assert ck.latest_valid().manifest["step"] == 1
    orphans = [p for p in ck.dir.iterdir() if p.name.startswith(".step_000002")]
    assert len(orphans) == 1
    assert ck.remove_orphans() == orphans and not orphans[0].exists()


def damage(path, how: str) -> None:
    file = path / "__0_0.distcp"  # the tensors, as DCP writes them
    if how == "truncated":
        os.truncate(file, file.stat().st_size // 2)
    elif how == "emptied":
        os.truncate(file, 0)
    elif how == "flipped":  # one byte in the middle of the tensor data: the size is unchanged
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0x01
        file.write_bytes(bytes(data))
    elif how == "no manifest":
        (path / MANIFEST).unlink()
    elif how == "bad manifest":
        (path / MANIFEST).write_text("{not json")


@pytest.mark.parametrize("how", ["truncated", "emptied", "flipped", "no manifest", "bad manifest"])
def test_damaged_newest_falls_back_to_previous_with_warning(tmp_path, how):
    ck = Checkpointer(tmp_path, keep_last=3)
    for step in (1, 2):
        save(ck, step)
    damage(ck.path(2), how)
    with pytest.warns(UserWarning, match="step_000002 is damaged and was skipped") as record:
        loaded = ck.latest_valid()
    assert loaded.manifest["step"] == 1 and torch.equal(read_w(loaded.path), tensors(1)["model"]["w"])
    assert str(ck.path(2)) in str(record[0].message)
    # Nothing is deleted: the damaged folder is kept beside the valid ones, out of the resume's way.
    assert (ck.dir / "step_000002.damaged").is_dir()
    assert [p.name for p in ck.all()] == ["step_000001"]
    # The run goes on and writes step 2 again.
    save(ck, 2)
    assert ck.latest_valid().manifest["step"] == 2


def test_flipped_byte_is_caught_by_the_checksum_not_by_luck(tmp_path):
    """DCP alone reads a flipped tensor byte without complaint; the checksum refuses it."""
    ck = Checkpointer(tmp_path, keep_last=1)
    save(ck, 5)
    damage(ck.path(5), "flipped")
    assert not torch.equal(read_w(ck.path(5)), tensors(5)["model"]["w"])
    with pytest.raises(CheckpointInvalid, match="does not match its checksum"):
        load(ck.path(5))


def test_not_a_checkpoint_is_called_that(tmp_path):
    file = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, file)
    with pytest.raises(CheckpointInvalid, match="is not a checkpoint"):
        load(file)
    with pytest.raises(CheckpointInvalid, match="is not a checkpoint: it has no manifest.json"):
        load(tmp_path)
    with pytest.raises(CheckpointInvalid, match="does not exist"):
        load(tmp_path / "missing")


def test_pruning_keeps_the_newest_and_ignores_damaged(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=1)
    save(ck, 1)
    save(ck, 2)
    assert [p.name for p in ck.all()] == ["step_000002"]
    damage(ck.path(2), "truncated")
    with pytest.warns(UserWarning):
        assert ck.latest_valid() is None  # the only one is damaged: a fresh start, and nothing deleted
    save(ck, 3)
    assert [p.name for p in ck.all()] == ["step_000003"]
    assert (ck.dir / "step_000002.damaged").is_dir()


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs: a real filesystem that runs out of space."""
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, "size=4m"):
        pytest.skip("cannot mount a tmpfs here (needs root on Linux)")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_full_disk_save_fails_cleanly_and_the_next_one_works(small_disk):
    ck = Checkpointer(small_disk / "run", keep_last=1)
    assert save(ck, 1, numel=100_000)  # 0.4 MB
    # The free-space check refuses what clearly cannot fit, before writing anything.
    with pytest.warns(UserWarning, match="not written: it needs about"):
        assert save(ck, 2, numel=2_000_000) is None  # 8 MB
    # What the check cannot see (here a 5 MB Python object in the run state) meets ENOSPC mid-write.
    with pytest.warns(UserWarning, match="No space left on device"):
        assert save(ck, 3, numel=100_000, blob=os.urandom(5 << 20)) is None
    assert [p.name for p in ck.dir.iterdir()] == ["step_000001"]  # no temporary left to keep the disk full
    assert ck.latest_valid().manifest["step"] == 1
    assert save(ck, 4, numel=100_000)
    assert ck.latest_valid().manifest["step"] == 4


def manifest(**changes) -> dict:
    config = {
        "model": {
            "depth": 2,
            "window_pattern": "L",
            "short_window": 256,
            "logit_softcap": 15.0,
            "fused_mlp": True,
        },
        "optim": {"name": "muon", "matrix_lr": 0.02},
        "data": {"source": "a", "max_seqlen": 128},
        "seed": 1,
    }
    return {"config": config, "world_size": 2, **changes}


def test_resume_check_names_every_difference(tmp_path):
    saved = manifest()
    config = json.loads(json.dumps(saved["config"]))
    check_resume(saved, config, tmp_path)
    # Implementation choices, learning rates, the number of ranks and the parallel mode may change.
    config["model"]["fused_mlp"] = False
    config["optim"]["matrix_lr"] = 0.01
    config["parallel"] = "fsdp"
    check_resume(saved, config, tmp_path)
    config["model"].update(window_pattern="SSSL", short_window=128, logit_softcap=30.0)
    config["optim"]["name"] = "adamw"
    config["data"]["max_seqlen"] = 256
    with pytest.raises(CheckpointMismatch) as err:
        check_resume(saved, config, tmp_path)
    message = str(err.value)
    for expected in (
        "model.window_pattern: checkpoint 'L' vs config 'SSSL'",
        "model.short_window: checkpoint 256 vs config 128",
        "model.logit_softcap: checkpoint 15.0 vs config 30.0",
        "optim.name: checkpoint 'muon' vs config 'adamw'",
        "data.max_seqlen: checkpoint 128 vs config 256",
    ):
        assert expected in message
    assert "fused_mlp" not in message and "matrix_lr" not in message and "parallel" not in message


def test_mismatched_shape_or_tokenizer_is_refused(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=1)
    save(ck, 1, about={**ABOUT, "shape": {"n_layer": 2, "n_embd": 128}, "tokenizer_id": "abc"})
    loaded = load(ck.path(1))
    check_compatible(loaded, {"n_layer": 2, "n_embd": 128}, "abc")
    with pytest.raises(CheckpointMismatch, match="n_embd: checkpoint 128 vs config 256"):
        check_compatible(loaded, {"n_layer": 2, "n_embd": 256}, "abc")
    with pytest.raises(CheckpointMismatch, match="tokenizer"):
        check_compatible(loaded, {"n_layer": 2, "n_embd": 128}, "xyz")
