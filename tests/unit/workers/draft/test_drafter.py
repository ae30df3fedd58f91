"""The one draft interface: the synchronous seam is one branch per sequence, capabilities are declared."""

from __future__ import annotations

import pytest

from workers.draft.draft_model import DraftModelProposer
from workers.draft.drafter import Branch, Capabilities, Draft, DraftInput, Drafter, SamplingSpec, SparseDist
from workers.draft.eagle_proposer import EagleProposer
from workers.draft.head_proposer import HeadProposer
from workers.draft.ngram import NgramProposer
from workers.draft.oracle import OracleProposer
from workers.draft.suffix import SuffixProposer

pytestmark = pytest.mark.unit


class Recording(Drafter):
    caps = Capabilities("recording")

    def __init__(self):
        self.calls: list = []

    def commit(self, seq_id, tokens, hidden_states=(), sampling=SamplingSpec()):
        self.calls.append(("commit", seq_id, list(tokens), sampling))

    def draft(self, branches, ready=None):
        self.calls.append(("draft", branches))
        dist = SparseDist([1], [1.0])
        return [Draft(list(range(b.num_tokens)), parents=[-1] * b.num_tokens if b.tree else [],
                      dists=[dist] * b.num_tokens if b.sampled else [], confidence=[0.5] * b.num_tokens)
                for b in branches]


def test_the_synchronous_seam_commits_each_request_then_drafts_one_branch_per_sequence():
    drafter = Recording()
    hot = SamplingSpec(temperature=0.7)
    out = drafter.propose([DraftInput("a", 3, [5, 6], 4, hot, max_depth=2),
                           DraftInput("b", 1, [], 6, tree_topk=2, tree_depth=3)])
    assert drafter.calls[:2] == [("commit", "a", [5, 6], hot), ("commit", "b", [], SamplingSpec())]
    [(kind, branches)] = drafter.calls[2:]  # one drafting call for the batch
    assert kind == "draft" and branches == [Branch("a", (), 2, sampled=True), Branch("b", (), 6, tree=(2, 3))]
    assert [(o.seq_id, o.round, o.token_ids) for o in out] == [("a", 3, [0, 1]), ("b", 1, list(range(6)))]
    assert len(out[0].distributions) == 2 and out[1].distributions == [] and out[1].is_tree
    assert out[0].confidence == [0.5, 0.5]


def test_capabilities_are_validated_and_every_method_implements_the_interface():
    with pytest.raises(ValueError):
        Capabilities("")
    with pytest.raises(ValueError):
        Capabilities("x", vocab_size=-1)
    assert Capabilities("x", [3, 1]).hidden_layers == (3, 1)
    with pytest.raises(ValueError, match="takes no new weights"):
        Recording().load_weights({})
    for cls in (NgramProposer, SuffixProposer, OracleProposer, DraftModelProposer, EagleProposer, HeadProposer):
        assert issubclass(cls, Drafter)
        for call in ("commit", "verified", "release", "draft"):
            assert getattr(cls, call) is not getattr(Drafter, call), (cls.__name__, call)
        assert cls.propose is Drafter.propose  # the synchronous seam is written once
    assert NgramProposer().caps == Capabilities("ngram", on_loop=True, stages=True)
    assert not NgramProposer(tree_topk=2).caps.stages  # trees: the synchronous seam only
    assert OracleProposer([[1, 2]], 0.0, 9).caps == Capabilities("oracle", vocab_size=9, stages=True,
                                                                 drafts_ahead=True)
