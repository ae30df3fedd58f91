"""The generated gRPC modules match proto/spec.proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def test_generated_modules_are_fresh():
    result = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]


def test_messages_round_trip_batches_and_raw_tensors():
    from proto import spec_pb2

    hidden = spec_pb2.Tensor(data=bytes(range(16)), dtype="float32", shape=[1, 4])
    msg = spec_pb2.TargetMessage(verify=spec_pb2.VerifyBatch(outcomes=[
        spec_pb2.VerifyOutcome(seq_id="a", round=3, num_accepted=2, emitted_tokens=[5, 6, 7], hidden_states=[hidden]),
        spec_pb2.VerifyOutcome(seq_id="b", round=1, num_accepted=0, emitted_tokens=[9]),
    ]))
    back = spec_pb2.TargetMessage.FromString(msg.SerializeToString())
    assert back.WhichOneof("body") == "verify"
    assert [o.seq_id for o in back.verify.outcomes] == ["a", "b"]
    assert back.verify.outcomes[0].hidden_states[0].data == bytes(range(16))
