"""Checkpoint files: atomic writes, keep-last-K, refusal of another shape or tokenizer."""

import os

import pytest
import torch

from model.checkpoint import Checkpointer, CheckpointMismatch, check_compatible


def test_save_keeps_last_k_and_latest(tmp_path):
    ck = Checkpointer(tmp_path, keep_last=2)
    assert ck.latest() is None
    for step in (10, 20, 30):
        ck.save(step, {"step": step, "w": torch.full((3,), float(step))})
    assert [p.name for p in ck.list()] == ["step_000020.pt", "step_000030.pt"]
    assert Checkpointer.load(ck.latest())["w"].tolist() == [30.0] * 3


def test_crash_during_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    ck = Checkpointer(tmp_path, keep_last=2)
    ck.save(1, {"step": 1})

    def dies_midway(obj, f):
        f.write(b"partial")
        raise KeyboardInterrupt  # the process is stopped while writing

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        ck.save(2, {"step": 2})
    monkeypatch.undo()
    assert ck.latest().name == "step_000001.pt"
    assert Checkpointer.load(ck.latest())["step"] == 1
    assert any(name.startswith(".step_000002") for name in os.listdir(ck.dir))  # never picked up


def test_mismatched_shape_or_tokenizer_is_refused(tmp_path):
    state = {"shape": {"n_layer": 2, "n_embd": 128}, "tokenizer_id": "abc"}
    check_compatible(state, {"n_layer": 2, "n_embd": 128}, "abc", tmp_path)
    with pytest.raises(CheckpointMismatch, match="n_embd: checkpoint 128 vs config 256"):
        check_compatible(state, {"n_layer": 2, "n_embd": 256}, "abc", tmp_path)
    with pytest.raises(CheckpointMismatch, match="tokenizer"):
        check_compatible(state, {"n_layer": 2, "n_embd": 128}, "xyz", tmp_path)
    with pytest.raises(FileNotFoundError, match="resume="):
        Checkpointer.load(tmp_path / "missing.pt")
