"""The target ↔ draft gRPC stream over TLS and mutual TLS, with certificates made here by openssl."""

from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest

from proto import spec_pb2_grpc
from runtime.messages import InstanceRecord
from runtime.tls import ClientTls, ServerTls
from tests.support.pki import make_pki
from workers.draft.drafter import Capabilities, Draft, DraftInput, Drafter
from workers.draft.service import DraftService
from workers.target.draft_client import DraftClient

pytestmark = [pytest.mark.unit, pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI missing")]


class EchoProposer(Drafter):
    caps = Capabilities("echo")

    def commit(self, seq_id, tokens, hidden_states=(), sampling=None):
        pass

    def draft(self, branches, ready=None):
        return [Draft([42]) for _ in branches]

    def verified(self, results):
        pass

    def release(self, seq_ids):
        pass


async def _serve(tls: ServerTls):
    service = DraftService(EchoProposer(), "d1")
    await service.start()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    spec_pb2_grpc.add_DraftServiceServicer_to_server(service, server)
    port = server.add_secure_port("127.0.0.1:0", tls.credentials())
    await server.start()
    return service, server, InstanceRecord("d1", "ns", "draft", "speculate", "", grpc_address=f"127.0.0.1:{port}")


async def _propose(record: InstanceRecord, tls: ClientTls | None) -> list[int]:
    client = DraftClient("t1", "m", 100, record, tls=tls)
    try:
        await client.connect(timeout=3)
        got = await client.propose([DraftInput("s", 0, [1, 2], 1)], timeout=3)
        return got["s"].token_ids
    finally:
        await client.close()


def test_tls_and_mutual_tls(tmp_path):
    pki = make_pki(tmp_path)

    async def main():
        # server TLS: a target that trusts the CA talks; a plaintext one cannot
        service, server, record = await _serve(ServerTls(pki["server_cert"], pki["server_key"]))
        try:
            assert await _propose(record, ClientTls(pki["ca"])) == [42]
            with pytest.raises(Exception):
                await _propose(record, None)
        finally:
            await server.stop(None)
            await service.stop()
        # mutual TLS: the target must present a certificate signed by the CA
        service, server, record = await _serve(ServerTls(pki["server_cert"], pki["server_key"], pki["ca"]))
        try:
            assert await _propose(record, ClientTls(pki["ca"], pki["client_cert"], pki["client_key"])) == [42]
            with pytest.raises(Exception):
                await _propose(record, ClientTls(pki["ca"]))
        finally:
            await server.stop(None)
            await service.stop()

    asyncio.run(main())


def test_half_given_tls_settings_are_errors(tmp_path):
    with pytest.raises(ValueError, match="certificate needs its key"):
        ClientTls("ca.pem", cert="c.pem")
    with pytest.raises(ValueError, match="does not exist"):
        ClientTls(str(tmp_path / "missing.pem")).credentials()
