"""What a target accepts from a draft worker: the handshake and proposal checks, case by case."""

from __future__ import annotations

import math

import pytest

from workers.speculation.checks import hello_ack_problem, proposal_problem
from workers.speculation.payloads import DraftOutput, SparseDist

pytestmark = pytest.mark.unit

V = 100


def prop(tokens, dists=(), parents=()):
    return DraftOutput("s", 0, list(tokens), list(dists), list(parents))


def test_a_sane_proposal_passes():
    assert proposal_problem(prop([1, 2, 3]), 4, V) is None
    assert proposal_problem(prop([1, 2, 3], parents=[-1, -1, 0]), 3, V) is None
    dists = [SparseDist([1, 5], [0.6, 0.4]), SparseDist([2], [1.0])]
    assert proposal_problem(prop([1, 2], dists), 2, V) is None
    assert proposal_problem(prop([]), 4, V) is None
    assert proposal_problem(DraftOutput("s", 0, [1, 2], confidence=[0.9, 0.5]), 2, V) is None
    # a float32 log_softmax of a peaked head rounds a hair above 0: exp of it a hair above 1, not malformed
    assert proposal_problem(DraftOutput("s", 0, [1], confidence=[1.0000002]), 1, V) is None


@pytest.mark.parametrize("bad, reason", [
    (prop([1, 2, 3, 4, 5]), "too_long"),
    (prop([1] * 5000), "too_long"),
    (prop([-1]), "token_id"),
    (prop([V]), "token_id"),
    (prop([1, 2], parents=[-1, 1]), "parents"),  # a token its own parent
    (prop([1, 2], parents=[-1, 5]), "parents"),  # a later token as parent
    (prop([1, 2], parents=[-2, 0]), "parents"),
    (prop([1, 2], parents=[-1]), "parents"),  # one parent for two tokens
    (prop([1, 2], [SparseDist([1], [1.0])]), "distributions"),  # one distribution for two tokens
    (prop([1], [SparseDist([1, 2], [1.0])]), "distributions"),  # ids and probabilities disagree
    (prop([1], [SparseDist([1, V], [0.5, 0.5])]), "distributions"),
    (prop([1], [SparseDist([1], [math.nan])]), "probabilities"),
    (prop([1], [SparseDist([1, 2], [1.5, -0.5])]), "probabilities"),
    (prop([1], [SparseDist([1, 2], [0.9, 0.9])]), "probabilities"),  # mass above 1
    (prop([1], [SparseDist([2], [1.0])]), "probabilities"),  # no mass on the drafted token
    (prop([1], [SparseDist([1], [math.inf])]), "probabilities"),
    (DraftOutput("s", 0, [1, 2], confidence=[0.9]), "confidence"),  # one value for two tokens
    (DraftOutput("s", 0, [1], confidence=[1.5]), "confidence"),
    (DraftOutput("s", 0, [1], confidence=[1.01]), "confidence"),
    (DraftOutput("s", 0, [1], confidence=[math.nan]), "confidence"),
    (DraftOutput("s", 0, [1], confidence=[-0.1]), "confidence"),
])
def test_malformed_proposals_are_named(bad, reason):
    assert proposal_problem(bad, 4, V) == reason


def test_handshake_checks():
    offered = (2, 15, 27, 30)
    assert hello_ack_problem([2, 15, 27], "float16", V, 3, offered, V) is None
    assert hello_ack_problem([], "", 0, 0, (), V) is None  # an n-gram draft: nothing asked
    label, why = hello_ack_problem([0, 999], "", 0, 3, offered, V)
    assert label == "hidden_layers" and "[0, 999]" in why and "hidden_layers" in why
    assert hello_ack_problem([2], "float99", 0, 3, offered, V)[0] == "hidden_dtype"
    assert hello_ack_problem([], "", V + 1, 3, offered, V)[0] == "vocab_size"
    assert hello_ack_problem([], "", 0, -1, offered, V)[0] == "num_speculative_tokens"
