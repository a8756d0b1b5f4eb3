"""Buffers that start as NaN, for the tests that a pass reads only memory some pass wrote."""

import torch


def _nan_filled(make):
    def make_nan(*args, **kwargs):
        x = make(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    return make_nan


def poison_new_buffers(monkeypatch) -> None:
    """Every float tensor that torch.empty or torch.empty_like makes, until monkeypatch undoes it, starts as
    NaN: a kernel that read memory no pass wrote would carry NaN into its results."""
    monkeypatch.setattr(torch, "empty", _nan_filled(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _nan_filled(torch.empty_like))
