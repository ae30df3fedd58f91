"""The one backoff formula: base, doubling, capped; huge attempt counts stay finite."""

import pytest

from runtime.backoff import backoff_delay

pytestmark = pytest.mark.unit


def test_doubles_from_the_base_up_to_the_cap():
    assert [backoff_delay(n, 0.5, 3.0) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_a_huge_attempt_count_is_the_cap():
    assert backoff_delay(10_000, 2.0, 30.0) == 30.0
