"""The etcd client every component uses: plaintext or TLS (mutual TLS with a client certificate),
optionally authenticated with a user and password.

aetcd opens plaintext channels only and sends the auth token it got at connect time for ever. This
client opens a TLS channel when asked, and carries the token in channel interceptors instead: when
etcd no longer knows the token (a restart forgets etcd's default "simple" tokens, which live in
memory) the call that finds out authenticates again and is retried once, as etcd's Go client does.
A watch or lease stream that fails this way is simply opened again by discovery, with the new token.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import aetcd
import grpc
from aetcd import exceptions, rpc, watcher

log = logging.getLogger(__name__)

# etcd's answers when a token it issued is no longer valid (etcd server/etcdserver/api/v3rpc/rpctypes)
_STALE_TOKEN = ("invalid auth token", "revision of auth store is old")
_AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"


@dataclass(frozen=True)
class EtcdSecurity:
    """TLS files (PEM paths) and credentials for one etcd client. ``tls`` without a CA trusts the
    system's roots; ``cert``/``key`` add a client certificate (mutual TLS)."""

    tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


def is_stale_token(exc: BaseException) -> bool:
    """True for etcd's "this token is no longer valid" errors (raw gRPC or aetcd-wrapped)."""
    return any(text in str(exc) for text in _STALE_TOKEN)


class _Token:
    """The current auth token, shared by the channel's interceptors."""

    def __init__(self, client: EtcdClient):
        self.client = client
        self.value: str | None = None

    def details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        if self.value is None or details.method in (_AUTHENTICATE, _AUTHENTICATE.encode()):
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()), ("token", self.value))
        return details._replace(metadata=metadata)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: _Token):
        self.token = token

    async def intercept_unary_unary(self, continuation, details, request):
        used = self.token.value
        call = await continuation(self.token.details(details), request)
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            if used is None or not is_stale_token(exc):
                raise
            await self.token.client.authenticate(stale=used)
            return await continuation(self.token.details(details), request)
        return call


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: _Token):
        self.token = token

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self.token.details(details), request)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: _Token):
        self.token = token

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self.token.details(details), request_iterator)


class EtcdClient(aetcd.Client):
    """An :class:`aetcd.Client` over a plaintext or TLS channel, with re-authentication."""

    def __init__(self, host: str, port: int, security: EtcdSecurity = EtcdSecurity(), timeout: float | None = None):
        super().__init__(host=host, port=port, timeout=timeout)
        self.security = security
        self._token = _Token(self)
        self._auth_lock = asyncio.Lock()

    async def authenticate(self, stale: str | None = None) -> None:
        """Get a new token (unless another call already replaced ``stale``)."""
        async with self._auth_lock:
            if stale is not None and self._token.value != stale:
                return
            try:
                reply = await rpc.AuthStub(self.channel).Authenticate(
                    rpc.AuthenticateRequest(name=self.security.user, password=self.security.password),
                    timeout=self._timeout)
            except rpc.AioRpcError as exc:
                exceptions._handle_exception(exc)
            if stale is not None:
                log.info("etcd: authenticated again as %s (the old token was no longer valid)", self.security.user)
            self._token.value = reply.token

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        sec = self.security
        target = f"{self._host}:{self._port}"
        # The token rides in interceptors only when there is one to carry: without auth the channel is
        # the plain one aetcd opens (grpc.aio interceptors change how calls are wrapped and cancelled)
        interceptors = ([_UnaryUnary(self._token), _UnaryStream(self._token), _StreamStream(self._token)]
                        if sec.user is not None else None)
        if sec.tls:
            self.channel = grpc.aio.secure_channel(target, sec.channel_credentials(), interceptors=interceptors)
        else:
            self.channel = grpc.aio.insecure_channel(target, interceptors=interceptors)
        if sec.user is not None:
            await self.authenticate()
        self.metadata = None  # the interceptors add the token
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout)
        self._connected.set()

    async def refresh_lease(self, lease_id):
        """As aetcd's, but a stale token is replaced and the refresh tried once more."""
        used = self._token.value
        try:
            return await super().refresh_lease(lease_id)
        except exceptions.ClientError as exc:
            if used is None or not is_stale_token(exc):
                raise
            await self.authenticate(stale=used)
            return await super().refresh_lease(lease_id)
