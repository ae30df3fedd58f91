"""API keys: OpenAI's ``Authorization: Bearer <key>`` scheme in front of the whole HTTP API.

With keys configured (``--api-key``, repeatable, ``@FILE`` for one key per line, or
``TANDEM_API_KEY`` with comma-separated keys), every request needs one of them, except the probes
``/health``, ``/live`` and ``/ping`` (and ``/metrics`` unless ``--metrics-require-key``). A missing or wrong key
is a 401 in OpenAI's error format (``code: invalid_api_key``) with ``WWW-Authenticate: Bearer``;
keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

from .responses import encode_json

OPEN_PATHS = frozenset({"/health", "/live", "/ping"})


def read_keys(values: Iterable[str]) -> tuple[str, ...]:
    """Keys from flag values: a key, comma-separated keys, or ``@path`` (one key per line; # comments)."""
    keys: list[str] = []
    for value in values:
        if value.startswith("@"):
            path = Path(value[1:])
            if not path.is_file():
                raise ValueError(f"API key file {path} does not exist")
            lines = [line.strip() for line in path.read_text().splitlines()]
            keys += [line for line in lines if line and not line.startswith("#")]
        else:
            keys += [k.strip() for k in value.split(",") if k.strip()]
    return tuple(dict.fromkeys(keys))


class ApiKeyAuth:
    """ASGI middleware: 401 unless the request carries one of ``keys`` (or its path is open)."""

    def __init__(self, app, keys: Iterable[str], protect_metrics: bool = False):
        self.app = app
        self.keys = tuple(k.encode() for k in keys)
        self.open = OPEN_PATHS if protect_metrics else OPEN_PATHS | {"/metrics"}

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                token = token.strip()
                if scheme.lower() == b"bearer" and token:
                    # constant time in the key, and every key tried
                    return sum(hmac.compare_digest(token, k) for k in self.keys) > 0
        return False

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open or self.allowed(scope["headers"]):
            await self.app(scope, receive, send)
            return
        body = encode_json({"error": {"message": "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}})
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
