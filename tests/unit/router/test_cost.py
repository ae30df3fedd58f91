"""The cost function and the choice: formula, cheapest wins, random ties, softmax temperature, config."""

from __future__ import annotations

import math
import random

import pytest
from router.cost import KvRouterConfig, choose, request_blocks

pytestmark = pytest.mark.unit

# chi-squared critical values at p = 0.001 by degrees of freedom: a fair sampler fails 1 run in 1000
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266}


def chi2(counts, expected=None) -> float:
    expected = expected or [sum(counts) / len(counts)] * len(counts)
    return sum((c - e) ** 2 / e for c, e in zip(counts, expected))


def test_request_blocks_counts_a_partial_block():
    assert [request_blocks(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_cheapest_wins():
    rng = random.Random(0)
    assert all(choose([5.0, 1.0, 3.0], 0.0, rng) == 1 for _ in range(100))


def test_ties_are_broken_uniformly_at_random():
    rng = random.Random(1)
    n = 3000
    counts = [0, 0, 0, 0]
    for _ in range(n):
        counts[choose([2.0, 1.0, 1.0, 1.0], 0.0, rng)] += 1
    assert counts[0] == 0
    # chi-squared goodness of fit to uniform over the three tied candidates
    assert chi2(counts[1:]) < CHI2_CRIT_001[2]


def test_softmax_temperature_matches_its_distribution():
    rng = random.Random(2)
    costs, temperature, n = [0.0, 5.0, 10.0], 0.5, 4000
    weights = [math.exp(-(c / 10.0) / temperature) for c in costs]
    expected = [n * w / sum(weights) for w in weights]
    counts = [0, 0, 0]
    for _ in range(n):
        counts[choose(costs, temperature, rng)] += 1
    assert chi2(counts, expected) < CHI2_CRIT_001[2]
    assert counts[0] > counts[1] > counts[2]


def test_softmax_with_equal_costs_is_uniform():
    rng = random.Random(3)
    counts = [0, 0]
    for _ in range(2000):
        counts[choose([4.0, 4.0], 1.0, rng)] += 1
    assert chi2(counts) < CHI2_CRIT_001[1]


def test_choose_needs_candidates():
    with pytest.raises(ValueError):
        choose([], 0.0, random.Random())


@pytest.mark.parametrize("bad", [dict(block_size=0), dict(overlap_weight=-1), dict(queue_weight=-0.5),
                                 dict(temperature=-1), dict(temperature=math.inf), dict(gap_timeout=0),
                                 dict(inflight_ttl=0), dict(maintenance_interval=-1)])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        KvRouterConfig(**bad)


def test_config_from_options_names_unknown_options():
    assert KvRouterConfig.from_options({"overlap_weight": 3.0}).overlap_weight == 3.0
    with pytest.raises(ValueError, match="overlap_wieght"):
        KvRouterConfig.from_options({"overlap_wieght": 3.0})
