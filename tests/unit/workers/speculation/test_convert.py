"""Hidden states on the wire: every dtype, and the empty tensors a proposal request with no new
rows carries (an EAGLE draft over gRPC dropped its stream on those)."""

from __future__ import annotations

import pytest
import torch

from workers.speculation.convert import (draft_input_from_pb, draft_input_to_pb, tensor_from_pb, tensor_to_pb,
                                         verify_from_pb, verify_to_pb)
from workers.speculation.payloads import DraftInput, VerifyResult

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 8), (0, 8), (0,)])
def test_tensors_round_trip(dtype, shape):
    t = torch.randn(*shape).to(dtype)
    back = tensor_from_pb(tensor_to_pb(t))
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_messages_with_empty_hidden_states_round_trip():
    d = DraftInput("s", 2, [], 3, hidden_states=[torch.zeros(0), torch.zeros(0, 4)])
    back = draft_input_from_pb(draft_input_to_pb(d, "bfloat16"))
    assert [h.shape for h in back.hidden_states] == [torch.Size([0]), torch.Size([0, 4])]
    v = VerifyResult("s", 2, 1, [5, 6], [torch.ones(2, 4)])
    assert torch.equal(verify_from_pb(verify_to_pb(v)).hidden_states[0], torch.ones(2, 4))


def test_tree_proposals_and_shapes_round_trip():
    from proto import spec_pb2
    from workers.speculation.convert import draft_output_from_pb, draft_output_to_pb
    from workers.speculation.payloads import DraftOutput, SparseDist

    tree = DraftOutput("s", 3, [5, 6, 7, 8], [SparseDist([5], [1.0])] * 4, [-1, -1, 0, 2],
                       confidence=[0.5, 0.25, 0.125, 0.0625])  # floats exact in float32
    wire = spec_pb2.Proposal.FromString(draft_output_to_pb(tree).SerializeToString())
    assert draft_output_from_pb(wire) == tree
    chain = DraftOutput("s", 4, [5, 6], [], [-1, 0])  # a chain travels without parents, as before trees
    assert list(draft_output_to_pb(chain).parents) == []
    assert not draft_output_from_pb(draft_output_to_pb(chain)).is_tree
    ask = DraftInput("s", 1, [1, 2], 8, tree_topk=4, tree_depth=3, max_depth=2)
    back = draft_input_from_pb(spec_pb2.ProposeRequest.FromString(draft_input_to_pb(ask).SerializeToString()))
    assert (back.tree_topk, back.tree_depth, back.num_speculative_tokens, back.max_depth, back.chain_budget) == (4, 3, 8, 2, 2)
