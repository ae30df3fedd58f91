"""vLLM's LoRA admin routes: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``.

Load: ``{"lora_name", "lora_path", "model"?}`` goes to every target worker of the base model
(``model``; may be left out when one base model is served) that serves ``target.lora`` (started
with ``--max-loras``); each loads the PEFT adapter and publishes the adapter's model card, and the
answer comes once this frontend sees the adapter, so a request right after it finds the model.
Unload: ``{"lora_name"}`` goes to the workers that hold the adapter; the answer comes once the
adapter is gone from ``/v1/models``. Refusals are 400s naming the field; an unknown adapter is a 404.
The path is read by the workers, on their machines.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from runtime import EndpointClient, InvalidRequest, NoInstances
from runtime.messages import LoraAdmin, LoraAdminReply
from runtime.request_plane import collect

from .models import ModelRegistry, UnknownModel

log = logging.getLogger(__name__)

VISIBLE_WAIT_S = 10.0  # the most a load/unload waits for the adapter's cards to show (or go)


def _body(raw: bytes, fields: tuple[str, ...]) -> dict:
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise InvalidRequest("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    for name in fields:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"{name} must be a non-empty string", field=name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", field="model")
    return body


class LoraAdminService:
    """Loads and unloads adapters on the workers of ``client`` (``target.lora``); plain values in."""

    def __init__(self, registry: ModelRegistry, client: EndpointClient | None, timeout: float = 60.0):
        self.registry = registry
        self.client = client
        self.timeout = timeout

    async def load(self, raw: bytes) -> str:
        body = _body(raw, ("lora_name", "lora_path"))
        name, path = body["lora_name"], body["lora_path"]
        bases = [m for m in self.registry.list() if not m.parent]
        if any(m.name == name for m in self.registry.list()):
            raise InvalidRequest(f"a model or adapter named {name!r} is already served", field="lora_name")
        base = body.get("model")
        if base is None:
            if len(bases) != 1:
                raise InvalidRequest(f"{len(bases)} base models are served: say which one in model", field="model")
            base = bases[0].name
        elif not any(m.name == base for m in bases):
            raise InvalidRequest(f"no base model {base!r} is served", field="model")
        workers = self._workers(base)
        await self._ask(workers, LoraAdmin(name, path))
        await self._until(lambda: self._holders(name) >= set(workers))
        log.info("LoRA adapter %s loaded from %s on %d workers of %s", name, path, len(workers), base)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, raw: bytes) -> str:
        name = _body(raw, ("lora_name",))["lora_name"]
        adapter = next((m for m in self.registry.list() if m.name == name), None)
        if adapter is None:
            raise UnknownModel(name)
        if not adapter.parent:
            raise InvalidRequest(f"{name!r} is a base model, not a LoRA adapter", field="lora_name")
        await self._ask(sorted(adapter.instance_ids), LoraAdmin(name))
        await self._until(lambda: not self._holders(name))
        log.info("LoRA adapter %s unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _workers(self, base: str) -> list[str]:
        found = [r.instance_id for r in self.client.instances(base)] if self.client is not None else []
        if not found:
            raise InvalidRequest(f"no worker of {base!r} serves LoRA adapters (start them with --max-loras)",
                                 field="model")
        return found

    def _holders(self, name: str) -> set[str]:
        return {i for m in self.registry.list() if m.name == name for i in m.instance_ids}

    async def _ask(self, workers: list[str], request: LoraAdmin) -> list[LoraAdminReply]:
        async def one(instance_id: str) -> LoraAdminReply:
            stream = await self.client.call(instance_id, request, LoraAdminReply)
            [reply] = await asyncio.wait_for(collect(stream), self.timeout)
            return reply

        results = await asyncio.gather(*(one(w) for w in workers), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r  # the first refusal (an InvalidRequest from the worker names the field)
        return results

    @staticmethod
    async def _until(done, timeout: float = VISIBLE_WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise NoInstances("target", "lora")
            await asyncio.sleep(0.02)
