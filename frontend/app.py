"""The HTTP routes of the frontend and the object that wires them to the runtime.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``,
``GET /v1/models`` (LoRA adapters included, with their ``parent``), vLLM's ``POST /tokenize``,
``POST /detokenize``, ``GET /version``, ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``
(:mod:`frontend.lora`),
``GET /health`` (readiness: 200 while this frontend takes traffic, listing the models live target
workers serve; with none, requests get a 503 and Retry-After), ``GET|POST /ping`` (SageMaker's
health check: 200 only while a model is served too), ``GET /live``, ``GET /metrics``, and FastAPI's
``/openapi.json`` and ``/docs``. Request bodies are read by hand, so that the size
limit (413) applies before parsing and parsing errors keep OpenAI's error format.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib.metadata
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from starlette.responses import Response

from router import Router, create_router
from router.flags import queue_options
from router.kv_router import KvRouter
from router.metrics import RouterQueueCollector
from runtime import EndpointClient, InvalidRequest, NoInstances, Overloaded, PendingBytes, Runtime

from .auth import ApiKeyAuth
from .config import FrontendConfig
from .disagg import RemotePrefill
from .dispatch import Dispatcher
from .errors import install, to_http
from .lora import LoraAdminService
from .metrics import FrontendMetrics, RequestTimer
from .models import ModelRegistry, UnknownModel
from .protocol import (ChatCompletionRequest, CompletionRequest, openapi_body, openapi_components, parse_request,
                       session_header, unknown_fields)
from .asgi import EventStream, FastPath, read_body_in_time
from .render_pool import RenderPool
from .responses import encode_json
from .responses_api import ResponsesBuilder, ResponsesRequest, parse_responses, renamed
from .serving import CompletionService, close_all
from .streaming import ClientDisconnected, until_disconnect
from .tokenize_api import DetokenizeRequest, TokenizeRequest, TokenizeService

log = logging.getLogger(__name__)

JSON = "application/json"
INLINE_PARSE_BYTES = 64 * 1024  # larger bodies are validated in a thread, off the event loop
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
try:
    VERSION = importlib.metadata.version("tandem")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    VERSION = "0.1.0"


def _parse_completion(kind: type, body: bytes, strict: bool = False) -> tuple:
    req = parse_request(kind, body, strict)
    return req, req


# endpoint -> body parser: (the request as sent, the chat or text completion request that serves it),
# or InvalidRequest naming the field
_PARSERS = {
    "chat": functools.partial(_parse_completion, ChatCompletionRequest),
    "completions": functools.partial(_parse_completion, CompletionRequest),
    "responses": parse_responses,
}


class Frontend:
    """Model registry, router, dispatcher and metrics of one frontend process."""

    def __init__(self, config: FrontendConfig, router: Router, client: EndpointClient, registry: ModelRegistry,
                 prefill: RemotePrefill | None = None, render: RenderPool | None = None,
                 lora_client: EndpointClient | None = None):
        self.config = config
        self.lora_admin = LoraAdminService(registry, lora_client)
        self.router = router
        self.client = client
        self.registry = registry
        self.metrics = FrontendMetrics()
        if prefill is not None:
            prefill.on_decision = lambda where, why: self.metrics.prefills.labels(where, why).inc()
        self.dispatcher = Dispatcher(router, client, config.max_migrations, self.metrics.migrations.inc, prefill,
                                     config.restart_wait_s)
        self.service = CompletionService(registry, self.dispatcher, self.metrics, config.max_n, config.tokenizer_timeout_s,
                                         render, config.tool_call_parser, config.restart_wait_s)
        self.tokenizing = TokenizeService(registry, self.served_models, config.tokenizer_timeout_s)
        self.render = render
        self.fastapi = build_app(self)
        self.inflight = 0  # completion requests being served, streams included
        self.ready: Callable[[], bool] = lambda: True  # the runtime's readiness (connected, not draining)
        self.app = ApiKeyAuth(FastPath(self.fastapi, {
            "/v1/chat/completions": lambda request: self.complete(request, "chat"),
            "/v1/completions": lambda request: self.complete(request, "completions"),
            "/v1/responses": lambda request: self.complete(request, "responses"),
        }), config.api_keys, config.metrics_require_key)

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, rt: Runtime, config: FrontendConfig) -> AsyncIterator[Frontend]:
        """A frontend over ``rt``; stops its router and tokenizer loads on exit."""
        queue = {} if config.remote_router else queue_options(config.router_queue_threshold, config.router_queue_policy)
        if config.remote_router and queue_options(config.router_queue_threshold, config.router_queue_policy):
            log.warning("--router-queue-threshold/--router-queue-policy do nothing with --remote-router: the router "
                        "service's own flags decide its queue")
        router = await create_router(rt, config.router_mode, remote=config.remote_router, **queue)
        prefill_router = await create_router(rt, config.router_mode, component="prefill")
        render = RenderPool(config.render_processes, paused=True) if config.render_processes else None

        def loaded(tok) -> None:
            if render is not None:
                render.warm(tok)
            # Everything loaded by now (the HTTP stack, pydantic models, the runtime, the tokenizer) lives as
            # long as the process; every full collection would walk it again with the event loop stopped.
            # Frozen, it is left out of collections from now on.
            gc.freeze()

        registry = ModelRegistry(on_load=loaded)
        frontend = None
        try:
            client = await rt.client("target", "generate")
            cards = await rt.models()
            cards.add_listener(registry.update)
            registry.update(cards.items())
            prefill = RemotePrefill(prefill_router, await rt.client("prefill", "generate"), client,
                                    lambda model: registry.get(model).card.kv_block_size, config.disagg_min_tokens,
                                    config.prefill_max_queue)
            frontend = cls(config, router, client, registry, prefill, render, await rt.client("target", "lora"))
            if isinstance(router, KvRouter):  # embedded: its queue and sessions on this frontend's /metrics
                frontend.metrics.registry.register(RouterQueueCollector(router, dynamo=True))
            # answering at all means the HTTP side serves; the rest is NATS and not draining
            frontend.ready = lambda: rt.nc is not None and rt.nc.is_connected and not rt.shutting_down
            yield frontend
        finally:
            if frontend is not None:
                await frontend.service.next_turns.close()
            await router.stop()
            await prefill_router.stop()
            await registry.close()
            if render is not None:
                render.close()

    def serving(self) -> None:
        """The HTTP server is up: start the render process now (it waited, so that a (re)starting
        frontend answers before a second interpreter's imports share the machine's cores with it)."""
        if self.render is not None:
            self.render.resume()

    def served_models(self) -> list[str]:
        """The models whose card we know that some live target instance serves."""
        served = {r.model for r in self.client.instances()}
        return [m.name for m in self.registry.list() if m.served_as in served or m.parent in served]

    async def complete(self, request: Request, endpoint: str) -> Response:
        """Serve one chat completion (``endpoint`` "chat"), text completion ("completions") or
        Responses API ("responses") request, streaming or not."""
        start = time.perf_counter()
        # Unique even when clients reuse an X-Request-Id: workers key streams and cancels by this id.
        header_id = request.headers.get("x-request-id", "")
        request_id = f"{header_id}-{uuid.uuid4().hex[:8]}" if _REQUEST_ID.match(header_id) else uuid.uuid4().hex
        metrics, model, status, streaming, gauge, timer = self.metrics, "", 200, False, None, None
        streaming_request = False
        limit = self.config.max_inflight
        counted = False
        try:
            # The body first: a slow or stalled upload holds no in-flight slot, and gets a 408 in the end.
            body = await read_body_in_time(request, self.config.max_body_bytes, self.config.body_timeout_s)
            self.inflight += 1
            counted = True
            if limit and self.inflight > limit:
                raise Overloaded(f"{limit} requests are in flight")
            # a large body's validation goes to a thread; it holds the GIL, but in steps of tens of
            # milliseconds at most (the prompt and grammar checks are built so), so the loop still runs
            parse_body = functools.partial(_PARSERS[endpoint], strict=self.config.strict_fields)
            parsed, req = parse_body(body) if len(body) <= INLINE_PARSE_BYTES else \
                await asyncio.to_thread(parse_body, body)
            ignored = unknown_fields(parsed)
            if ignored:
                log.info("request %s: ignored fields this server does not know: %s", request_id, ", ".join(ignored))
                metrics.observe_ignored(ignored)
            try:
                job = await self.service.prepare(req, request_id, session_header(request.headers))
            except InvalidRequest as exc:
                raise (renamed(exc) if endpoint == "responses" else exc) from None
            if endpoint == "responses":
                job.builder, job.include_usage = ResponsesBuilder(parsed, job.model.name), True
            model = job.model.name
            streaming_request = job.stream
            series = metrics.series(model)
            gauge = series.in_flight
            gauge.inc()
            timer = RequestTimer(series, start)
            pending = PendingBytes(self.config.max_stream_buffer_bytes) if job.stream else None
            gens = await self.service.open(job, pending)
            outs = job.outputs()
            if job.stream:
                firsts = await until_disconnect(request.receive, self.service.first_deltas(gens))
                streaming = True

                ended = []

                def finished(code: int) -> None:
                    if ended:
                        return
                    ended.append(code)
                    self.inflight -= 1
                    timer.done()
                    gauge.dec()
                    metrics.observe_request(model, endpoint, code, stream=True)
                    self.service.account(job, outs)
                    if code == 200:
                        self.service.after_turn(job, gens, outs)

                async def cleanup() -> None:  # for a stream that never started: the client left at once
                    finished(499)
                    await close_all(gens)

                events = self.service.events(job, gens, outs, firsts, timer, self.config.retry_after_s, finished)
                headers = {"Cache-Control": "no-cache", "X-Request-Id": request_id}
                return EventStream(events, cleanup, headers=headers, write_timeout=self.config.write_timeout_s,
                                   request_id=request_id, pending=pending,
                                   on_drop=lambda reason: metrics.streams_dropped.labels(reason).inc())
            await until_disconnect(request.receive, self.service.collect(job, gens, outs, timer))
            timer.done()
            self.service.account(job, outs)
            self.service.after_turn(job, gens, outs)
            return Response(job.builder.body(outs, job.prompt_tokens), media_type=JSON, headers={"X-Request-Id": request_id})
        except ClientDisconnected:
            status = 499  # nginx's "client closed request"; nobody reads this answer
            log.info("request %s: client disconnected", request_id)
            return Response(status_code=status)
        except Exception as exc:
            if isinstance(exc, UnknownModel) and not self.client.instances():
                # no target at all (a rollout, a restart): the model may well come back
                exc = NoInstances("target", "generate", exc.name)
            err = to_http(exc, self.config.retry_after_s)
            status = err.status
            if status == 500:
                log.error("request %s failed", request_id, exc_info=exc)
            else:
                log.info("request %s: %d %s", request_id, status, err.message)
            return err.response()
        finally:
            if not streaming:
                if counted:
                    self.inflight -= 1
                if gauge is not None:
                    gauge.dec()
                if timer is not None:
                    timer.unqueue()
                metrics.observe_request(model, endpoint, status, streaming_request)


def build_app(frontend: Frontend) -> FastAPI:
    app = FastAPI(title="Tandem", version=VERSION, summary="OpenAI-compatible API of a Tandem deployment")
    install(app, frontend.config.retry_after_s)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(openapi_components(ChatCompletionRequest, CompletionRequest, ResponsesRequest,
                                              TokenizeRequest, DetokenizeRequest))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest), tags=["openai"])
    async def chat_completions(request: Request) -> Response:
        """Chat completion (``stream: true`` for server-sent events)."""
        return await frontend.complete(request, "chat")

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest), tags=["openai"])
    async def completions(request: Request) -> Response:
        """Text completion (``stream: true`` for server-sent events)."""
        return await frontend.complete(request, "completions")

    @app.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest), tags=["openai"])
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, text in and out (``stream: true`` for its server-sent events)."""
        return await frontend.complete(request, "responses")

    async def tokenizing(request: Request, handler) -> Response:
        try:
            body = await read_body_in_time(request, frontend.config.max_body_bytes, frontend.config.body_timeout_s)
            return Response(encode_json(await handler(body)), media_type=JSON)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            err = to_http(exc, frontend.config.retry_after_s)
            if err.status == 500:
                log.error("%s failed", request.url.path, exc_info=exc)
        return err.response()

    @app.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest), tags=["vllm"])
    async def tokenize(request: Request) -> Response:
        """vLLM's: the token ids of ``prompt`` or of chat ``messages``, as a request would send them."""
        return await tokenizing(request, frontend.tokenizing.tokenize)

    @app.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest), tags=["vllm"])
    async def detokenize(request: Request) -> Response:
        """vLLM's: the text of ``tokens``."""
        return await tokenizing(request, frontend.tokenizing.detokenize)

    @app.get("/version", tags=["vllm"])
    async def version() -> Response:
        """The server's version."""
        return Response(encode_json({"version": VERSION}), media_type=JSON)

    @app.api_route("/ping", methods=["GET", "POST"], tags=["ops"])
    async def ping() -> Response:
        """SageMaker's health check: 200 while this frontend takes traffic and a live target worker
        serves a model; else 503 with Retry-After."""
        if frontend.ready() and frontend.served_models():
            return Response(b"{}", media_type=JSON)
        return Response(b"{}", 503, {"Retry-After": str(frontend.config.retry_after_s)}, media_type=JSON)

    @app.get("/v1/models", tags=["openai"])
    async def models() -> Response:
        """The models that live target workers serve."""
        data = [{"id": m.name, "object": "model", "created": m.created, "owned_by": "tandem",
                 "max_model_len": m.card.context_length, "instances": m.num_instances, "parent": m.parent or None}
                for m in frontend.registry.list()]
        return Response(encode_json({"object": "list", "data": data}), media_type=JSON)

    @app.get("/v1/models/{model_id:path}", tags=["openai"])
    async def model(model_id: str) -> Response:
        """One served model (404 in OpenAI's format when no live worker serves it)."""
        for m in frontend.registry.list():
            if m.name == model_id:
                return Response(encode_json({"id": m.name, "object": "model", "created": m.created, "owned_by": "tandem",
                                             "max_model_len": m.card.context_length,
                                             "instances": m.num_instances, "parent": m.parent or None}),
                                media_type=JSON)
        err = to_http(UnknownModel(model_id))
        return Response(encode_json(err.body()), status_code=err.status, media_type=JSON)

    async def lora_admin(request: Request, action) -> Response:
        try:
            body = await read_body_in_time(request, frontend.config.max_body_bytes, frontend.config.body_timeout_s)
            text = await action(body)
        except Exception as exc:
            err = to_http(exc, frontend.config.retry_after_s)
            if err.status == 500:
                log.error("LoRA admin request failed", exc_info=exc)
            return err.response()
        return Response(text.encode(), media_type="text/plain")

    @app.post("/v1/load_lora_adapter", tags=["vllm"])
    async def load_lora_adapter(request: Request) -> Response:
        """Load a PEFT LoRA adapter (``lora_name``, ``lora_path``; ``model``: its base, when several
        are served) on every worker of its base model that serves adapters."""
        return await lora_admin(request, frontend.lora_admin.load)

    @app.post("/v1/unload_lora_adapter", tags=["vllm"])
    async def unload_lora_adapter(request: Request) -> Response:
        """Unload a LoRA adapter (``lora_name``) from the workers that hold it."""
        return await lora_admin(request, frontend.lora_admin.unload)

    @app.get("/health", tags=["ops"])
    async def health() -> Response:
        """Readiness: 200 while this frontend can take traffic (connected, serving, not draining), with
        the models live target workers serve; none is still 200 (requests then get a 503 with
        Retry-After, so a target rollout does not take frontends out of their Service). Else 503."""
        ok = frontend.ready()
        body = {"status": "healthy" if ok else "unhealthy", "models": frontend.served_models()}
        return Response(encode_json(body), 200 if ok else 503, media_type=JSON)

    @app.get("/live", tags=["ops"])
    async def live() -> Response:
        """200 while the process runs."""
        return Response(b'{"status":"alive"}', media_type=JSON)

    @app.get("/metrics", tags=["ops"])
    async def metrics() -> Response:
        """Prometheus metrics."""
        return Response(frontend.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
