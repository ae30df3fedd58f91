"""The launcher's restart policy: at once, then backing off, and a fresh burst after a stable run."""

from __future__ import annotations

import pytest

from deploy.supervisor import RestartPolicy, RestartState

pytestmark = pytest.mark.unit


def test_restarts_back_off_within_a_burst_and_reset_after_a_stable_run():
    policy = RestartPolicy(initial_delay=0.0, second_delay=0.5, factor=2.0, max_delay=3.0, stable_after=30.0)
    state = RestartState(policy, started_at=0.0)
    delays = []
    now = 100.0
    for _ in range(6):  # crashes one second after each restart
        delays.append(state.died(now))
        assert not state.ready(now + delays[-1] - 0.01) or delays[-1] == 0
        assert state.ready(now + delays[-1])
        now += delays[-1]
        state.started(now)
        now += 1.0
    assert delays == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    now += 60.0  # up for a minute: the next death is the first of a new burst
    assert state.died(now) == 0.0


def test_bad_policies_are_refused():
    with pytest.raises(ValueError):
        RestartPolicy(factor=0.5)
    with pytest.raises(ValueError):
        RestartPolicy(max_delay=-1)
