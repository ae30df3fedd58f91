"""Every message that crosses NATS or etcd, as msgspec Structs.

Contract: values are msgpack-encoded with :func:`encode` and decoded with :func:`decode`, which
keeps one decoder per type, built once. Structs are ``array_like`` (positional on the wire) and
``omit_defaults``; add new fields only at the end and with a default, so old readers keep working.
No pickle and no ``dict[str, Any]`` payloads anywhere.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Base of all wire messages."""


# --------------------------------------------------------------------------- discovery (etcd)


class InstanceRecord(_Wire):
    """One served endpoint of one process, stored under its lease."""

    instance_id: str
    namespace: str
    component: str
    endpoint: str
    subject: str  # NATS subject that reaches exactly this instance
    host: str = ""
    pid: int = 0
    role: str = ""  # "target", "draft", "router", "frontend", ...
    model: str = ""
    grpc_address: str = ""
    http_address: str = ""  # health/metrics port, when the process serves one
    started_at: float = 0.0
    # Which start of the process behind ``instance_id`` this is (nanoseconds since the epoch at its
    # start; 0: not said): a worker restarted under the same id (TANDEM_INSTANCE_ID) registers a
    # greater one, and a peer refuses anything of an older one (see workers/target/draft_pool.py).
    incarnation: int = 0


class ModelCard(_Wire):
    """What a frontend needs to serve a model, published by every worker that serves it."""

    name: str
    role: str = "target"  # "target" or "draft"
    tokenizer_path: str = ""  # local directory with tokenizer.json / tokenizer_config.json
    context_length: int = 2048
    kv_block_size: int = 16
    spec_method: str = ""  # "", "ngram", "draft_model", "eagle"
    num_speculative_tokens: int = 0
    eos_token_ids: list[int] = []
    chat_template: str = ""
    supports_logprobs: bool = True
    instance_id: str = ""
    structured_outputs: bool = False  # the workers constrain output to a grammar (:class:`StructuredOutput`)
    aliases: list[str] = []  # more names clients may pass as "model" for this one (``--served-model-name a b``)
    parent: str = ""  # a LoRA adapter's card: the base model it runs on (its instances serve ``parent``)


# --------------------------------------------------------------------------- request plane (NATS)


class FrameKind:
    """Kinds of response frames on a reply inbox."""

    ACK = 0  # the worker received the request and started the handler
    DATA = 1  # one item yielded by the handler
    END = 2  # the handler finished; nothing follows
    ERROR = 3  # the handler failed; nothing follows
    HEARTBEAT = 4  # the stream is alive but has nothing to say yet


class RequestEnvelope(_Wire):
    """A request to one instance; the reply subject is the client's inbox."""

    request_id: str
    payload: bytes
    reply_to: str


class Frame(_Wire):
    """One message of a response stream. ``seq`` counts DATA frames from 0."""

    kind: int
    seq: int = 0
    payload: bytes = b""
    error_kind: str = ""
    error_message: str = ""
    error_field: str = ""


class Cancel(_Wire):
    """Sent on an instance's control subject: stop the handler of ``request_id``. An empty
    ``request_id`` cancels nothing: clients send it as a liveness probe (see the request plane)."""

    request_id: str


# --------------------------------------------------------------------------- generate endpoint


def is_greedy(temperature):
    """The one greedy rule: temperature 0 means argmax, no randomness (validation rejects negative
    temperatures). Works on floats and elementwise on tensors."""
    return temperature <= 0


class StructuredOutput(_Wire):
    """A grammar every generated token must follow; exactly one field is set. The target worker
    compiles it and masks the logits of every position it samples or verifies."""

    json_schema: str = ""  # JSON text of a JSON Schema (response_format, tools)
    regex: str = ""  # the whole output matches this regular expression
    choice: list[str] = []  # the output is exactly one of these strings


class SamplingParams(_Wire):
    """Per-request sampling. temperature 0 is greedy (:func:`is_greedy`); top_k 0 disables top-k."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus top-k
    structured: StructuredOutput | None = None  # None: unconstrained
    # Logits processors (applied before temperature, in the order below; speculation verifies under
    # the same pipeline, so it stays exact): OpenAI's additive penalties over the tokens generated so
    # far, vLLM's multiplicative repetition penalty over prompt and output, a bias per token id, and
    # min_p (drop tokens whose probability is below min_p × the most likely one's).
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    logit_bias: dict[int, float] = {}  # token id -> bias in [-100, 100]
    min_p: float = 0.0  # [0, 1]


class KvHandoff(_Wire):
    """A prompt computed by a prefill worker, waiting in its KV cache for a decode worker to pull.

    ``block_ids`` are the prefill worker's blocks holding positions ``[0, num_tokens)`` (block i
    holds positions ``[i·bs, (i+1)·bs)``); the decode worker reads them, and the hidden-state rows
    of the same slots, with one-sided NIXL READs from the agent ``worker_id`` registered in etcd
    (:class:`KvAgentRecord`), then sends :class:`KvRelease`. The prefill worker frees them then, or
    after ``ttl`` seconds whatever happens.
    """

    worker_id: str  # the prefill worker's instance id (its agent record and release subject)
    handoff_id: str
    block_ids: list[int]
    num_tokens: int
    ttl: float = 30.0
    cached_tokens: int = 0  # prompt tokens the prefill worker found in its own prefix cache
    expires_at: float = 0.0  # the prefill worker's wall clock (time.time()) when it frees the blocks unpulled


class KvRelease(_Wire):
    """Sent to a prefill worker (event topic ``kv_release.{worker_id}``): free a handoff's blocks."""

    handoff_ids: list[str]
    ok: bool = True  # False: the pull failed (counted; the blocks are freed all the same)


class KvLayout(_Wire):
    """What a worker's registered KV memory holds, so that a reader can refuse what does not fit.

    Regions are listed keys then values per layer, then hidden-state rows per offered layer; block
    b of region r starts at ``addresses[r] + b * block_bytes[r]``.
    """

    model: str
    block_size: int
    dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    hidden_layers: list[int]
    hidden_size: int
    num_blocks: int
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int
    addresses: list[int]
    block_bytes: list[int]


class KvAgentRecord(_Wire):
    """A worker's NIXL agent (etcd ``tandem/{ns}/kv_agents/{instance_id}``, on its lease): published
    once at start, read by decode workers the first time they pull from it."""

    instance_id: str
    agent_name: str
    metadata: bytes
    layout: KvLayout


class RoutingHints(_Wire):
    """What a request tells the router about itself beyond its tokens (``nvext.agent_hints``, vLLM's
    ``priority``, the session header).

    ``priority`` is vLLM's convention everywhere inside Tandem: lower values are served first, 0 is the
    default (the frontend negates Dynamo's ``agent_hints.priority``, where higher means sooner).
    ``strict_priority`` is the router queue's tier: a higher tier always leaves the queue first; it
    never reaches a worker. ``osl``: the expected output length in tokens (0: unknown), which the
    ``wspt`` queue policy orders by. ``session_id``: the agent session (``X-Dynamo-Session-ID``) whose
    turns the KV router keeps on one worker while that costs no more than its score says.
    """

    priority: int = 0
    strict_priority: int = 0
    osl: int = 0
    session_id: str = ""


class GenerateRequest(_Wire):
    """Token ids in. ``output_ids`` carries tokens already generated elsewhere (migration, or the first
    token of a remote prefill, whose KV ``kv_transfer`` says where to pull from). ``priority``: vLLM's
    (lower is served first), honoured by a worker started with ``--scheduling-policy priority``.
    ``next_turn``: an agent's next-turn prefill (``nvext.agent_hints.speculative_prefill``): background
    work that only fills the prefix cache with ``token_ids``. It runs while the worker has no real
    request, yields to any that arrives, is dropped under memory pressure, and answers one delta
    without tokens whose finish reason is ``NEXT_TURN_DONE`` or ``NEXT_TURN_DROPPED``."""

    token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    model: str = ""
    num_speculative_tokens: int | None = None  # None: the worker's default; 0 disables (a tree's node budget)
    output_ids: list[int] = []
    speculative_tree_topk: int | None = None  # draft trees: children per node (1: a chain); None: the worker's
    speculative_tree_depth: int | None = None  # draft trees: depth; None: the worker's
    kv_transfer: KvHandoff | None = None  # the prompt's KV waits on a prefill worker: pull it
    lora: str = ""  # the LoRA adapter to run with ("": the base model ``model``)
    priority: int = 0
    next_turn: bool = False
    draft_id: str = ""  # the draft worker the router chose for it (a hint: honoured when the target streams to it)


# The finish reasons of a next-turn prefill (GenerateRequest.next_turn): the context is in the prefix
# cache, or it was dropped (the worker was busy, a real request arrived, too few free blocks).
NEXT_TURN_DONE = "prefilled"
NEXT_TURN_DROPPED = "dropped"


class LoraAdmin(_Wire):
    """``target.lora``: load (``path`` set) or unload (``path`` empty) a LoRA adapter on one worker.
    The reply is one :class:`LoraAdminReply`; a refusal is an ``invalid_request`` error frame."""

    lora_name: str
    lora_path: str = ""


class LoraAdminReply(_Wire):
    adapters: list[str] = []  # the adapters the worker holds afterwards


class SpecUsage(_Wire):
    """Speculative-decoding counters of one request."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = []  # [i]: verify steps whose accepted path reached depth i + 1
    # decode steps of the request that ran without a draft, by why (see PLAIN_STEP_REASONS)
    plain_steps: dict[str, int] = {}
    draft_id: str = ""  # the draft worker it speculated with last (router.drafts: its next turn goes back)


# Why a speculating request decoded a step plainly (SpecUsage.plain_steps and the target's metrics):
PLAIN_STEP_REASONS = {
    "no_draft": "no draft worker is connected",
    "draft_backoff": "the draft worker is backed off (too slow, silent, or sending malformed proposals)",
    "draft_late": "the proposal missed the step's deadline",
    "draft_stale": "the proposal answered an older round or a sequence that no longer decodes next",
    "draft_invalid": "the proposal was malformed and dropped",
    "draft_empty": "the draft had nothing to propose (e.g. no n-gram match)",
    "paused": "adaptive speculation paused drafting after rejected drafts",
    "load": "load-aware speculation judged drafting not worth it at this load",
    "no_room": "max_tokens or the context length leaves no room for drafts",
}


class Usage(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec: SpecUsage | None = None


class TopLogprob(_Wire):
    token_id: int
    logprob: float


class TokenDelta(_Wire):
    """Token ids out. The last frame of a request has ``finish_reason`` and ``usage``."""

    token_ids: list[int] = []
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "cancelled"
    usage: Usage | None = None


class PrefillDelta(_Wire):
    """A prefill worker's one frame (``prefill.generate``): the first token's delta and, unless that
    token ended the request (then ``delta`` has the finish reason and usage), where its KV waits."""

    delta: TokenDelta
    handoff: KvHandoff | None = None


# --------------------------------------------------------------------------- event plane (NATS)


class KvEventKind:
    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


class KvEvent(_Wire):
    """A change to one worker's prefix cache.

    ``block_hashes`` are chained hashes (see :mod:`runtime.kv_hash`). For ``stored`` they are
    consecutive blocks of one sequence, the first of which follows ``parent_hash`` (None: the
    first block of the sequence). ``event_id`` increases by one per event of a worker, so a
    reader can spot gaps and duplicates. ``tier``: "" for the device pool (the prefix cache), or
    the lower tier the change is in (``host``, ``disk``: see ``workers/engine/kv_tiers.py``); each
    tier of a worker numbers its events on its own.
    """

    worker_id: str
    event_id: int
    kind: str
    block_hashes: list[int] = []
    parent_hash: int | None = None
    block_size: int = 16
    tier: str = ""


class KvDumpRequest(_Wire):
    """Ask workers to republish their whole cache state as one ``stored`` event per chain."""

    requester: str = ""


class LoadEvent(_Wire):
    """A worker's load, published periodically and on change."""

    worker_id: str
    running: int = 0
    queued: int = 0
    active_blocks: int = 0
    total_blocks: int = 0
    free_blocks: int = 0
    timestamp: float = 0.0
    max_num_seqs: int = 0  # the most requests it runs at once (0: not said); the router queue's capacity


class SpecStatsEvent(_Wire):
    """Cumulative speculative-decoding counters of one (target, draft) pair since ``epoch``.

    Counters only grow while ``epoch`` (the target process's start time) stays the same; a new
    epoch means the target restarted and counts from zero again.
    """

    target_id: str
    draft_id: str
    epoch: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = []
    method: str = ""
    timestamp: float = 0.0


# --------------------------------------------------------------------------- router service (NATS)


class RouteRequest(_Wire):
    """Ask a shared router (``router.select``) which target instance should serve a prompt."""

    model: str
    token_ids: list[int] = []
    exclude: list[str] = []  # instance ids not to choose (e.g. ones that already failed this request)
    request_id: str = ""
    lora: str = ""  # the request's LoRA adapter: its prompt's blocks hash from the adapter's chain root
    hints: RoutingHints | None = None  # priority, queue tier, expected output length, session


class RouteResponse(_Wire):
    """The router's choice; ``ticket`` names the selection in a later :class:`RouteRelease`."""

    instance_id: str
    overlap_blocks: int = 0
    ticket: int = 0
    router_id: str = ""  # the router instance that holds the in-flight accounting


class RouteRelease(_Wire):
    """Published (event topic ``route_release``) when requests routed by ``router_id`` end."""

    router_id: str
    tickets: list[int] = []


# --------------------------------------------------------------------------- codec

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: Any) -> bytes:
    """msgpack-encode a Struct (or plain value)."""
    return _encoder.encode(message)


def decode(data: bytes, type_: type[T]) -> T:
    """Decode ``data`` as ``type_``; raises ``msgspec.DecodeError`` on malformed input."""
    decoder = _decoders.get(type_)
    if decoder is None:
        decoder = _decoders[type_] = msgspec.msgpack.Decoder(type_)
    return decoder.decode(data)
