"""Wire messages: round trips, typed decoding, and the error-frame mapping."""

from __future__ import annotations

import msgspec
import pytest

from runtime.errors import InvalidRequest, RemoteError, ShuttingDown, error_from_frame, error_to_frame
from runtime.messages import GenerateRequest, KvEvent, SamplingParams, SpecUsage, TokenDelta, Usage, decode, encode

pytestmark = pytest.mark.unit


def test_generate_request_round_trip_keeps_every_field():
    req = GenerateRequest([1, 2, 3], SamplingParams(temperature=0.5, top_p=0.9, top_k=5, seed=7, max_tokens=9,
                                                    stop_token_ids=[2], ignore_eos=True, logprobs=2),
                          model="m", num_speculative_tokens=3, output_ids=[4])
    assert decode(encode(req), GenerateRequest) == req


def test_defaults_are_omitted_on_the_wire():
    assert len(encode(TokenDelta(token_ids=[5]))) < 8
    delta = TokenDelta([1], finish_reason="stop", usage=Usage(3, 1, 0, SpecUsage(1, 4, 2)))
    assert decode(encode(delta), TokenDelta) == delta


def test_decoding_the_wrong_type_is_a_validation_error():
    with pytest.raises(msgspec.ValidationError):
        decode(encode(KvEvent("w", 1, "stored", [1])), GenerateRequest)
    with pytest.raises(msgspec.DecodeError):
        decode(b"\xc1", GenerateRequest)


def test_error_frames_round_trip_to_typed_errors():
    kind, message, field = error_to_frame(InvalidRequest("top_p must be in (0, 1]", field="top_p"))
    err = error_from_frame(kind, message, field)
    assert isinstance(err, InvalidRequest) and err.field == "top_p" and "top_p" in str(err)
    assert isinstance(error_from_frame(*error_to_frame(ShuttingDown())), ShuttingDown)
    remote = error_from_frame(*error_to_frame(KeyError("x")))
    assert isinstance(remote, RemoteError) and remote.kind == "KeyError"
