"""scripts/bench_attention.py: the work count under a sliding window, against counting the pairs one by one;
the interleaved rounds (the order in which methods run, and their medians); and --rounds's bad values."""

import sys

import pytest

from scripts import bench_attention
from scripts.bench_attention import across_rounds, causal_flops, interleaved, window_pairs


@pytest.mark.parametrize("n", [1, 2, 7, 512, 513, 2048])
@pytest.mark.parametrize("window", [0, 1, 511, 512, 4096])
def test_window_pairs_count_each_query_and_the_keys_it_sees(n, window):
    want = sum(1 for i in range(n) for j in range(i + 1) if i - j <= window)
    assert window_pairs(n, window) == want


def test_windowed_flops_are_four_head_dim_heads_per_pair_kept():
    lengths, heads, head_dim, window = [100, 700, 3], 2, 64, 512
    pairs = sum(1 for n in lengths for i in range(n) for j in range(i + 1) if i - j <= window)
    assert causal_flops(lengths, heads, head_dim, window) == 4.0 * head_dim * heads * pairs


def test_each_round_starts_one_method_later_so_every_method_runs_in_every_position():
    calls = []

    def run(name):
        calls.append(name)
        return {"fwd": float(len(calls))}

    results = interleaved(["ours", "fa4", "flex"], 3, run)
    assert calls == ["ours", "fa4", "flex", "fa4", "flex", "ours", "flex", "ours", "fa4"]
    for name in ("ours", "fa4", "flex"):
        positions = sorted(i % 3 for i, called in enumerate(calls) if called == name)
        assert positions == [0, 1, 2]
        # Each method's results are its own, in its rounds' order.
        assert [r["fwd"] for r in results[name]] == [i + 1.0 for i, c in enumerate(calls) if c == name]


def test_a_method_that_raises_is_reported_and_not_run_again():
    calls = []

    def run(name):
        calls.append(name)
        if name == "broken":
            raise RuntimeError("no kernel for this GPU")
        return {"fwd": 1.0}

    results = interleaved(["ours", "broken"], 3, run)
    assert calls.count("broken") == 1 and calls.count("ours") == 3
    assert isinstance(results["broken"], RuntimeError) and len(results["ours"]) == 3


def test_across_rounds_takes_medians_and_the_spread_of_the_time_parts():
    runs = [
        {"fwd": 1.0, "bwd": 4.0, "fwd_host": 0.5},
        {"fwd": 3.0, "bwd": 2.0, "fwd_host": 0.1},
        {"fwd": 2.0, "bwd": 3.0, "fwd_host": 0.3},
    ]
    merged = across_rounds(runs)
    assert merged == {
        "fwd": 2.0, "bwd": 3.0, "fwd_host": 0.3,
        "fwd_spread": (3.0 - 1.0) / 2.0, "bwd_spread": (4.0 - 2.0) / 3.0,
    }
    # Two rounds: the median is their mean. One round: its own values, and no spread.
    assert across_rounds(runs[:2])["fwd"] == 2.0
    assert across_rounds(runs[:1]) == runs[0]


@pytest.mark.parametrize(
    "argv, message",
    [(["--rounds", "0"], "--rounds must be at least 1"), (["--tune", "--rounds", "3"], "not to --tune")],
)
def test_bad_rounds_stop_before_any_timing(monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["bench_attention.py", *argv])

    def no_gpu_work():
        raise AssertionError("reached the GPU before rejecting the arguments")

    monkeypatch.setattr(bench_attention, "environment", no_gpu_work)
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
