"""What a Tandem stack is made of: the launcher's config and the list of components to start.

Shared by the local launcher (``tandem up``) and the Ray launcher (``tandem ray up``): :func:`plan`,
a pure function, turns a :class:`StackConfig` plus the ports chosen for each component into
:class:`Component` specs (a name, a ``python -m`` module, its flags, whether it needs a GPU).
``tests/unit/deploy/test_command_lines.py`` checks that every module accepts the flags planned for it.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace

from deploy.draft_kinds import FLAG as DRAFT_KINDS_FLAG
from deploy.draft_kinds import METHOD_KEYS, DraftKind
from workers.speculation.methods import DTYPES as DRAFT_DTYPES
from workers.speculation.methods import HEAD_METHODS, METHODS
from workers.speculation.spec_config import SpeculativeConfig

DRAFT_METHODS = (*METHODS, "none")  # none: no draft workers (the targets decode plainly)
ROUTER_MODES = ("kv", "round_robin", "random")
MOCK_MODEL_NAME = "mock"
# of the target workers' engine flags, the ones the mock worker has
MOCK_ENGINE_FLAGS = ("--max-model-len", "--max-num-seqs", "--scheduling-policy")


@dataclass(frozen=True)
class StackConfig:
    """Everything ``tandem up`` / ``tandem ray up`` was asked for (``None``: a documented default)."""

    model: str | None = None  # None: the bundled SmolLM2 demo
    served_model_name: str | None = None
    draft_method: str | None = None  # None: eagle3 on the bundled head for the demo model, else ngram
    draft_model: str | None = None  # None with eagle3 and the demo model: the bundled head
    num_speculative_tokens: int | None = None
    speculative_eagle_topk: int | None = None  # draft trees: children per node (1: chains); None: the worker's
    speculative_num_steps: int | None = None  # draft trees: depth; None: the worker's
    draft_device: str = "auto"  # where model-based drafts run: auto (cuda when a GPU is visible), cpu, cuda[:N]
    draft_dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    load_aware: bool = True  # False: the workers' --speculative-config gets load_aware false
    targets: int = 1
    tensor_parallel_size: int = 1  # ranks (processes, devices) per target worker
    drafts: int | None = None  # None: 1 for a real model (0 with --draft-method none), 0 for --mock
    router_mode: str = "kv"
    standalone_router: bool = False
    http_port: int = 8000
    host: str = "127.0.0.1"
    mock: bool = False
    mock_token_latency_ms: float | None = None
    mock_token_latency_per_running_ms: float | None = None
    namespace: str = "tandem"
    drain_timeout: float = 30.0
    prefill_workers: int = 0  # > 0: that many prefill workers, and the targets run as decode workers
    planner: bool = False  # run python -m planner beside the stack, scaling it through this launcher
    planner_args: tuple[str, ...] = ()  # more flags for python -m planner (its SLA at least)
    served_model_aliases: tuple[str, ...] = ()  # more names for the model (--served-model-name a b: b)
    # flags passed through as given (their definitions: workers.target.flags, frontend.flags)
    engine_args: tuple[str, ...] = ()  # to every target and prefill worker (--max-model-len 2048 ...)
    frontend_args: tuple[str, ...] = ()  # to the frontend (--tool-call-parser hermes ...)
    # --speculative-config's keys that no launcher flag carries, as JSON: to every target and draft worker
    # (each reads its own: workers/speculation/spec_config.py)
    speculative_keys: str = "{}"
    api_keys: tuple[str, ...] = ()  # the frontend's --api-key values (passed in its environment, not its argv)
    # draft workers of several kinds side by side (--draft-kinds); (): one kind, --draft-method x --drafts
    draft_kinds: tuple[DraftKind, ...] = ()

    def __post_init__(self) -> None:
        demo = self.model is None and not self.mock
        if self.draft_kinds:
            self._take_draft_kinds(demo)
        if self.draft_method is None:
            object.__setattr__(self, "draft_method", "eagle3" if demo else "ngram")
        if self.draft_method == "eagle3" and self.draft_model is None and demo:
            from workers.demo_model import demo_head_dir

            object.__setattr__(self, "draft_model", str(demo_head_dir()))
        if self.draft_method not in DRAFT_METHODS:
            raise ValueError(f"draft_method must be one of {DRAFT_METHODS}, got {self.draft_method!r}")
        if self.router_mode not in ROUTER_MODES:
            raise ValueError(f"router_mode must be one of {ROUTER_MODES}, got {self.router_mode!r}")
        if self.targets < 1:
            raise ValueError(f"targets must be at least 1, got {self.targets}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.mock and self.tensor_parallel_size > 1:
            raise ValueError("--tensor-parallel-size applies to model targets, not --mock")
        model_only = sorted({w for w in self.engine_args if w.startswith("--")} - set(MOCK_ENGINE_FLAGS))
        if self.mock and model_only:
            raise ValueError(f"{', '.join(model_only)} appl{'ies' if len(model_only) == 1 else 'y'} to model targets, "
                             f"not --mock (the mock worker takes {', '.join(MOCK_ENGINE_FLAGS)})")
        if self.drafts is not None and self.drafts < 0:
            raise ValueError(f"drafts must be >= 0, got {self.drafts}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculative_eagle_topk is not None and self.speculative_eagle_topk < 1:
            raise ValueError(f"speculative_eagle_topk must be >= 1, got {self.speculative_eagle_topk}")
        if self.speculative_num_steps is not None and self.speculative_num_steps < 1:
            raise ValueError(f"speculative_num_steps must be >= 1, got {self.speculative_num_steps}")
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be a TCP port, got {self.http_port}")
        if self.mock_token_latency_ms is not None and self.mock_token_latency_ms < 0:
            raise ValueError(f"mock_token_latency_ms must be >= 0, got {self.mock_token_latency_ms}")
        if self.mock_token_latency_ms is not None and not self.mock:
            raise ValueError("--mock-token-latency-ms only applies with --mock")
        if self.mock_token_latency_per_running_ms is not None and (not self.mock or self.mock_token_latency_per_running_ms < 0):
            raise ValueError("--mock-token-latency-per-running-ms only applies with --mock, and must be >= 0")
        if self.prefill_workers < 0:
            raise ValueError(f"prefill_workers must be >= 0, got {self.prefill_workers}")
        if self.prefill_workers and self.mock:
            raise ValueError("--prefill-workers needs model workers (the mock worker has no prefill role)")
        if self.planner_args and not self.planner:
            raise ValueError("--planner-args applies with --planner")
        if self.draft_method in ("draft_model", *HEAD_METHODS) and not self.draft_model and self.num_drafts \
                and not self.draft_kinds:
            what = "a draft head directory" if self.draft_method in HEAD_METHODS else "a draft model"
            raise ValueError(f"--draft-method {self.draft_method} needs --draft-model PATH ({what})")
        if self.draft_model and self.draft_method in ("ngram", "suffix", "none"):
            raise ValueError(f"--draft-model applies to draft_model and the heads ({', '.join(HEAD_METHODS)}), "
                             f"not --draft-method "
                             f"{self.draft_method}")
        if self.draft_method == "none" and self.drafts:
            raise ValueError("--draft-method none cannot start drafts (drop --drafts or pick a method)")
        if self.mock and self.drafts:
            raise ValueError("--mock runs no draft workers (the mock target simulates speculation)")
        problem = self._keys_problem()
        if problem:
            raise ValueError(f"--speculative-config: {problem}")
        drafts_only = self.speculative.draft_only_keys()
        if drafts_only and not self.num_drafts:
            raise ValueError(f"--speculative-config's {', '.join(drafts_only)} are the draft workers' keys and this "
                             f"stack runs none (--mock, --drafts 0 or --draft-method none)")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if not (self.draft_device in ("auto", "cpu", "cuda") or
                (self.draft_device.startswith("cuda:") and self.draft_device[5:].isdigit())):
            raise ValueError(f"--draft-device must be auto, cpu, cuda or cuda:N, got {self.draft_device!r}")
        if self.draft_dtype not in DRAFT_DTYPES:
            raise ValueError(f"--draft-dtype must be one of {', '.join(DRAFT_DTYPES)}, got {self.draft_dtype!r}")

    def _take_draft_kinds(self, demo: bool) -> None:
        """``draft_kinds`` given: they alone name the drafts' methods, heads and counts; an EAGLE-3 kind
        without a path on the demo model runs the bundled head; ``draft_method`` is the first kind's."""
        if self.draft_method is not None or self.draft_model is not None or self.drafts is not None:
            raise ValueError(f"{DRAFT_KINDS_FLAG} names the draft workers' methods, heads and counts: drop "
                             f"--draft-method, --draft-model and --drafts (and --speculative-config's method and model)")
        if self.mock:
            raise ValueError(f"--mock runs no draft workers ({DRAFT_KINDS_FLAG} needs a model)")
        kinds = []
        for kind in self.draft_kinds:
            if kind.method == "eagle3" and kind.model is None and demo:
                from workers.demo_model import demo_head_dir

                kind = replace(kind, model=str(demo_head_dir()))
            if kind.method in ("draft_model", *HEAD_METHODS) and kind.model is None:
                what = "a draft head directory" if kind.method in HEAD_METHODS else "a draft model"
                raise ValueError(f"{DRAFT_KINDS_FLAG}: {kind.method} needs {what}: write {kind.method}=PATH:COUNT")
            kinds.append(kind)
        labels = [k.label for k in kinds]
        if len(set(labels)) < len(labels):
            raise ValueError(f"{DRAFT_KINDS_FLAG}: a kind is named twice (give it a count instead)")
        object.__setattr__(self, "draft_kinds", tuple(kinds))
        object.__setattr__(self, "draft_method", kinds[0].method)

    def _keys_problem(self) -> str | None:
        """Why ``--speculative-config``'s method keys fit no draft of the stack (None: they fit)."""
        if not self.draft_kinds:
            return self.speculative.method_problem(self.draft_method)
        methods = {k.method for k in self.draft_kinds}
        for prefix, owner in METHOD_KEYS:
            given = sorted(key for key in self.speculative.model_fields_set if key.startswith(prefix))
            if given and owner not in methods:
                return f"{', '.join(repr(k) for k in given)} apply to method {owner}, and no {DRAFT_KINDS_FLAG} kind is {owner}"
        return None

    @property
    def kinds(self) -> tuple[DraftKind, ...]:
        """The stack's draft kinds with their counts (its shares of the pool when a planner grows it): the
        ``--draft-kinds`` given, else the one kind of ``--draft-method`` (count at least 1, so that a stack
        started with ``--drafts 0`` can still be given drafts); none with ``--mock`` or method none."""
        if self.draft_kinds:
            return self.draft_kinds
        if self.mock or self.draft_method == "none":
            return ()
        return (DraftKind(self.draft_method, self.draft_model, max(1, self.num_drafts)),)

    def planned_drafts(self) -> tuple[DraftKind, ...]:
        """The kind of each draft worker the stack starts with (``draft-0``, ``draft-1``, ... in order)."""
        if self.draft_kinds:
            return tuple(k for k in self.draft_kinds for _ in range(k.count))
        return self.kinds[:1] * self.num_drafts

    @property
    def speculative(self) -> SpeculativeConfig:
        """The keys passed on to the workers, with the launcher's flags read onto them."""
        keys = json.loads(self.speculative_keys)
        keys.update({key: value for key, value in (("eagle_topk", self.speculative_eagle_topk),
                                                   ("num_steps", self.speculative_num_steps)) if value is not None})
        if not self.load_aware:
            keys["load_aware"] = False
        return SpeculativeConfig(**keys)

    def worker_speculative_config(self, kind: DraftKind | None = None) -> list[str]:
        """``--speculative-config`` as the stack's targets get it, or a draft worker of ``kind`` (without
        another method's own keys); none: nothing to say. A stack none of whose drafts read hidden states
        has its targets keep none (their per-slot store would only take KV blocks); a γ above a draft's own
        cap raises the cap."""
        spec = self.speculative
        keys = spec.given() if kind is None else kind.speculative_keys(spec.given())
        if not any(k.reads_hidden_states for k in self.kinds) and "hidden_layers" not in keys:
            keys["hidden_layers"] = "none"
        asked = self.num_speculative_tokens
        if asked is not None and asked > spec.max_num_speculative_tokens and "max_num_speculative_tokens" not in keys:
            keys["max_num_speculative_tokens"] = asked
        return ["--speculative-config", json.dumps(keys, sort_keys=True)] if keys else []

    @property
    def num_drafts(self) -> int:
        if self.draft_kinds:
            return sum(k.count for k in self.draft_kinds)
        if self.drafts is not None:
            return self.drafts
        return 0 if self.mock or self.draft_method == "none" else 1

    def model_names(self, model_path: str | None) -> tuple[str, ...]:
        """Every name clients may use, the canonical (first) one the workers register under first."""
        return (self.model_name(model_path), *self.served_model_aliases)

    def model_name(self, model_path: str | None) -> str:
        """The name clients use in ``"model": ...``."""
        if self.served_model_name:
            return self.served_model_name
        if self.mock:
            return MOCK_MODEL_NAME
        if self.model is None:
            from workers.demo_model import DEMO_NAME

            return DEMO_NAME
        return (model_path or self.model).rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Component:
    """One process of the stack: ``python -m module *args``."""

    name: str  # "frontend", "router", "target-0", "draft-1"
    kind: str  # frontend | router | target | draft
    module: str
    args: tuple[str, ...] = ()
    health_port: int | None = None  # where /health answers (the HTTP port for frontend and router)
    gpu: bool = False
    env: tuple[tuple[str, str], ...] = ()  # variables this process gets besides the stack's (secrets: not argv)
    draft_kind: str = ""  # a draft worker's kind (DraftKind.label), for launchers that add drafts of a kind

    def argv(self, python: str = sys.executable) -> list[str]:
        return [python, "-m", self.module, *self.args]


WORKER_POOLS = ("prefill", "target", "draft")  # the kinds a planner may resize


def draft_component(config: StackConfig, model_path: str | None, index: int, port: int,
                    kind: DraftKind | None = None) -> Component:
    """Draft worker ``draft-{index}`` of ``kind`` (default: the stack's first) serving the model named
    for ``model_path``."""
    kind = kind or config.kinds[0]
    args = ["--draft-method", kind.method, "--served-model-name", config.model_name(model_path),
            "--health-port", str(port)]
    if kind.method in HEAD_METHODS:  # the head reads the target's embedding and LM head
        args += ["--eagle-model", kind.model, "--target-model", str(model_path)]
    elif kind.model:
        args += ["--draft-model", kind.model]
    if kind.method in ("draft_model", *HEAD_METHODS):  # on the GPU reserved for it, where there is one
        args += ["--device", config.draft_device, "--dtype", config.draft_dtype]
    args += config.worker_speculative_config(kind)
    return Component(f"draft-{index}", "draft", "workers.draft", tuple(args), port, gpu=True, draft_kind=kind.label)


def target_component(config: StackConfig, model_path: str | None, index: int, port: int,
                     kind: str = "target") -> Component:
    """Target worker ``{kind}-{index}``: ``kind`` target (aggregated, or decode beside prefill workers)
    or prefill (``--role prefill``, the same model flags)."""
    names = config.model_names(model_path)
    if config.mock:
        args = ["--served-model-name", *names, "--health-port", str(port), *config.engine_args]
        if config.mock_token_latency_ms is not None:
            args += ["--token-latency-ms", f"{config.mock_token_latency_ms:g}"]
        if config.mock_token_latency_per_running_ms is not None:
            args += ["--token-latency-per-running-ms", f"{config.mock_token_latency_per_running_ms:g}"]
        if config.num_speculative_tokens is not None:
            args += ["--num-speculative-tokens", str(config.num_speculative_tokens)]
        return Component(f"{kind}-{index}", kind, "workers.mock", tuple(args), port)
    args = ["--model", str(model_path)] if model_path else []  # none: the worker's default, the demo
    args += ["--served-model-name", *names, "--health-port", str(port), *config.engine_args]
    if config.num_speculative_tokens is not None:
        args += ["--num-speculative-tokens", str(config.num_speculative_tokens)]
    args += config.worker_speculative_config()
    if config.tensor_parallel_size > 1:  # the worker starts its other ranks itself
        args += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    if config.prefill_workers:
        args += ["--role", "prefill" if kind == "prefill" else "decode"]
    return Component(f"{kind}-{index}", kind, "workers.target", tuple(args), port, gpu=True)


def worker_component(config: StackConfig, model_path: str | None, kind: str, index: int, port: int,
                     draft_kind: DraftKind | None = None) -> Component:
    """A worker of pool ``kind`` (prefill, target, draft; a draft of ``draft_kind``, default the first)
    as :func:`plan` would start it, drain flag included: for launchers that add workers to a running stack."""
    if kind == "draft":
        comp = draft_component(config, model_path, index, port, draft_kind)
    elif kind in ("target", "prefill"):
        comp = target_component(config, model_path, index, port, kind)
    else:
        raise ValueError(f"unknown worker pool {kind!r} (one of {', '.join(WORKER_POOLS)})")
    return replace(comp, args=comp.args + ("--drain-timeout", f"{config.drain_timeout:g}"))


def planner_argv(config: StackConfig, frontend_port: int, health_port: int) -> tuple[str, ...]:
    """``python -m planner`` flags for a stack: the launcher connector, the frontend's metrics, bounds that
    fit the stack (drafts only where it has a draft method, prefill only with prefill workers), then
    ``planner_args`` (which win: argparse keeps the last of a repeated flag)."""
    drafts = not config.mock and config.draft_method != "none"
    args = ["--connector", "launcher", "--frontend-url", f"http://127.0.0.1:{frontend_port}",
            "--health-port", str(health_port), "--max-targets", str(max(4, config.targets)),
            "--min-drafts", "1" if drafts and config.num_drafts else "0",
            "--max-drafts", str(max(4, config.num_drafts)) if drafts else "0",
            "--min-prefill", "1" if config.prefill_workers else "0",
            "--max-prefill", str(max(4, config.prefill_workers)) if config.prefill_workers else "0"]
    return (*args, *config.planner_args)


def plan(config: StackConfig, model_path: str | None, ports: dict[str, int],
         http_fd: int | None = None) -> list[Component]:
    """The components in start order: router (if standalone), drafts, prefill workers, targets,
    frontend, planner (if asked).

    Drafts start before the targets that stream to them and (stopping in reverse) end after them,
    so no draft waits out its drain for a target's open stream.

    ``ports`` maps each component name to its health port (``frontend``/``router``: HTTP port);
    ``http_fd``: the launcher's listening socket on that port, which the frontend serves on.
    """
    out: list[Component] = []
    if config.standalone_router:
        out.append(Component("router", "router", "router",
                             ("--http-port", str(ports["router"]), "--router-mode", config.router_mode),
                             ports["router"]))
    out += [draft_component(config, model_path, i, ports[f"draft-{i}"], kind)
            for i, kind in enumerate(config.planned_drafts())]
    out += [target_component(config, model_path, i, ports[f"prefill-{i}"], "prefill")
            for i in range(config.prefill_workers)]
    out += [target_component(config, model_path, i, ports[f"target-{i}"]) for i in range(config.targets)]
    frontend = ["--http-port", str(ports["frontend"]), "--host", config.host, "--router-mode", config.router_mode]
    if config.standalone_router:  # route through the shared router service, not an embedded router
        frontend.append("--remote-router")
    frontend += config.frontend_args
    if http_fd is not None:
        frontend += ["--http-fd", str(http_fd)]
    env = (("TANDEM_API_KEY", ",".join(config.api_keys)),) if config.api_keys else ()
    out.append(Component("frontend", "frontend", "frontend", tuple(frontend), ports["frontend"], env=env))
    drain = ("--drain-timeout", f"{config.drain_timeout:g}")
    out = [replace(c, args=c.args + drain) for c in out]
    if config.planner:
        out.append(Component("planner", "planner", "planner", planner_argv(config, ports["frontend"], ports["planner"]),
                             ports["planner"]))
    return out


def component_names(config: StackConfig) -> list[str]:
    """Names of the components :func:`plan` will return (to choose their ports first)."""
    names = ["router"] if config.standalone_router else []
    names += [f"draft-{i}" for i in range(config.num_drafts)]
    names += [f"prefill-{i}" for i in range(config.prefill_workers)]
    names += [f"target-{i}" for i in range(config.targets)]
    return names + ["frontend"] + (["planner"] if config.planner else [])
