"""Conversion between protobuf messages (``proto/spec.proto``) and the proposer's own types.

Protobuf objects stop here: the draft worker and the target's draft client convert at the gRPC edge.
Hidden states travel as raw bytes + dtype + shape (inline), or as a :class:`~.payloads.HiddenRef`
into the data plane (:mod:`.hidden_plane`) that the receiving edge resolves.
"""

from __future__ import annotations

import torch

from proto import spec_pb2

from .payloads import DraftInput, DraftOutput, HiddenRef, SamplingSpec, SparseDist, VerifyResult

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a hidden-state dtype ('float32', 'float16', 'bfloat16')."""
    if dtype not in _NAMES:
        raise ValueError(f"unsupported hidden-state dtype {dtype}")
    return _NAMES[dtype]


def tensor_to_pb(t: torch.Tensor, dtype: str = "") -> spec_pb2.Tensor:
    """``t`` as raw bytes + dtype + shape, cast to ``dtype`` (a wire name) first when given."""
    if dtype:
        if dtype not in DTYPES:
            raise ValueError(f"unsupported hidden-state dtype {dtype!r}")
        t = t.to(DTYPES[dtype])
    t = t.detach().contiguous().cpu()
    if t.dtype not in _NAMES:
        raise ValueError(f"unsupported hidden-state dtype {t.dtype}")
    # bfloat16 has no numpy dtype: ship its raw 16-bit pattern.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return spec_pb2.Tensor(data=raw.numpy().tobytes(), dtype=_NAMES[t.dtype], shape=list(t.shape))


def tensor_from_pb(msg: spec_pb2.Tensor) -> torch.Tensor:
    dtype = DTYPES.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"unsupported hidden-state dtype {msg.dtype!r}")
    if not msg.data:  # no rows (a proposal request with nothing new): frombuffer refuses empty buffers
        return torch.zeros(list(msg.shape), dtype=dtype)
    storage = torch.int16 if dtype == torch.bfloat16 else dtype
    flat = torch.frombuffer(bytearray(msg.data), dtype=storage)
    return flat.view(dtype).reshape(list(msg.shape))


def sampling_to_pb(s: SamplingSpec) -> spec_pb2.SamplingSpec:
    return spec_pb2.SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                 has_seed=s.seed is not None, seed=s.seed or 0)


def sampling_from_pb(msg: spec_pb2.SamplingSpec) -> SamplingSpec:
    return SamplingSpec(msg.temperature, msg.top_p or 1.0, msg.top_k, msg.seed if msg.has_seed else None)


def ref_to_pb(ref: HiddenRef | None) -> spec_pb2.HiddenRef | None:
    return None if ref is None else spec_pb2.HiddenRef(offset=ref.offset, count=ref.count, streamed=ref.streamed)


def ref_from_pb(msg) -> HiddenRef | None:
    """The descriptor of a ProposeRequest or VerifyOutcome (None: its rows, if any, are inline)."""
    if not msg.HasField("hidden"):
        return None
    return HiddenRef(msg.hidden.offset, msg.hidden.count, msg.hidden.streamed)


def draft_input_to_pb(d: DraftInput, hidden_dtype: str = "") -> spec_pb2.ProposeRequest:
    return spec_pb2.ProposeRequest(seq_id=d.seq_id, round=d.round, new_tokens=d.new_tokens,
                                   num_speculative_tokens=d.num_speculative_tokens, sampling=sampling_to_pb(d.sampling),
                                   hidden_states=[tensor_to_pb(h, hidden_dtype) for h in d.hidden_states],
                                   tree_topk=d.tree_topk, tree_depth=d.tree_depth, max_depth=d.max_depth,
                                   hidden=ref_to_pb(d.hidden_ref))


def draft_input_from_pb(msg: spec_pb2.ProposeRequest) -> DraftInput:
    """``hidden_ref`` set: the rows are on the plane, for the service to resolve (hidden_states empty)."""
    return DraftInput(msg.seq_id, msg.round, list(msg.new_tokens), msg.num_speculative_tokens, sampling_from_pb(msg.sampling),
                      [tensor_from_pb(h) for h in msg.hidden_states], msg.tree_topk, msg.tree_depth,
                      msg.max_depth, ref_from_pb(msg))


def draft_output_to_pb(d: DraftOutput) -> spec_pb2.Proposal:
    return spec_pb2.Proposal(
        seq_id=d.seq_id, round=d.round, token_ids=d.token_ids,
        distributions=[spec_pb2.SparseDistribution(ids=s.ids, probs=s.probs) for s in d.distributions],
        parents=d.parents if d.is_tree else [], start=d.start, assumed=d.assumed, confidence=d.confidence)


def draft_output_from_pb(msg: spec_pb2.Proposal) -> DraftOutput:
    return DraftOutput(msg.seq_id, msg.round, list(msg.token_ids),
                       [SparseDist(list(s.ids), list(s.probs)) for s in msg.distributions], list(msg.parents),
                       msg.start, list(msg.assumed), list(msg.confidence))


def verify_to_pb(v: VerifyResult, hidden_dtype: str = "") -> spec_pb2.VerifyOutcome:
    return spec_pb2.VerifyOutcome(seq_id=v.seq_id, round=v.round, num_accepted=v.num_accepted,
                                  emitted_tokens=v.emitted_tokens,
                                  hidden_states=[tensor_to_pb(h, hidden_dtype) for h in v.hidden_states],
                                  hidden=ref_to_pb(v.hidden_ref))


def verify_from_pb(msg: spec_pb2.VerifyOutcome) -> VerifyResult:
    return VerifyResult(msg.seq_id, msg.round, msg.num_accepted, list(msg.emitted_tokens),
                        [tensor_from_pb(h) for h in msg.hidden_states], ref_from_pb(msg))
