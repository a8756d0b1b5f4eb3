"""eval.metrics.exposed_time against counting on a fine grid: random sets of communication and compute
intervals (overlapping, nested, touching, empty), with integer ends so that the grid count is exact."""

import random

import pytest

from eval.metrics import exposed_time, merged


def grid_count(comm, compute, horizon: int) -> tuple[int, int]:
    total = exposed = 0
    for t in range(horizon):  # the unit cell [t, t + 1)
        in_comm = any(s <= t and t + 1 <= e for s, e in comm)
        in_compute = any(s <= t and t + 1 <= e for s, e in compute)
        total += in_comm
        exposed += in_comm and not in_compute
    return total, exposed


def random_intervals(rng: random.Random, n: int, horizon: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(n):
        start = rng.randrange(horizon)
        out.append((start, min(horizon, start + rng.randrange(0, 25))))  # zero-length ones included
    return out


@pytest.mark.parametrize("seed", range(40))
def test_exposed_time_equals_the_grid_count(seed):
    rng = random.Random(seed)
    horizon = 200
    comm = random_intervals(rng, rng.randrange(0, 12), horizon)
    compute = random_intervals(rng, rng.randrange(0, 30), horizon)
    assert exposed_time(comm, compute) == grid_count(comm, compute, horizon)


def test_cases_by_hand():
    assert exposed_time([], [(0, 5)]) == (0, 0)
    assert exposed_time([(0, 10)], []) == (10, 10)
    assert exposed_time([(0, 10)], [(2, 4), (3, 6), (8, 12)]) == (10, 4)  # gaps [0,2), [6,8)
    assert exposed_time([(0, 4), (2, 6)], [(0, 1)]) == (6, 5)  # overlapping collectives count once
    assert merged([(5, 6), (0, 2), (2, 3), (1, 1)]) == [(0, 3), (5, 6)]
