"""The hidden layers a target offers its drafts, from ``--speculative-config``'s hidden_layers (workers/engine/build.py)."""

from __future__ import annotations

import pytest

from workers.engine.build import offered_layers

pytestmark = pytest.mark.unit


def test_auto_offers_eagle3s_three_layers_and_the_last():
    assert offered_layers("auto", 30) == (2, 15, 27, 30)
    assert offered_layers("auto", 3) == (3,)  # too shallow for EAGLE-3's three: the final norm only


def test_none_and_a_list_sorted_without_repeats():
    assert offered_layers("none", 30) == ()
    assert offered_layers("30,0,5,5", 30) == (0, 5, 30)


def test_a_layer_outside_the_model_is_refused():
    with pytest.raises(ValueError, match=r"'hidden_layers' must be in \[0, 30\]"):
        offered_layers("31", 30)
