"""scripts/bench_attention.py's work count under a sliding window, against counting the pairs one by one."""

import pytest

from scripts.bench_attention import causal_flops, window_pairs


@pytest.mark.parametrize("n", [1, 2, 7, 512, 513, 2048])
@pytest.mark.parametrize("window", [0, 1, 511, 512, 4096])
def test_window_pairs_count_each_query_and_the_keys_it_sees(n, window):
    want = sum(1 for i in range(n) for j in range(i + 1) if i - j <= window)
    assert window_pairs(n, window) == want


def test_windowed_flops_are_four_head_dim_heads_per_pair_kept():
    lengths, heads, head_dim, window = [100, 700, 3], 2, 64, 512
    pairs = sum(1 for n in lengths for i in range(n) for j in range(i + 1) if i - j <= window)
    assert causal_flops(lengths, heads, head_dim, window) == 4.0 * head_dim * heads * pairs
