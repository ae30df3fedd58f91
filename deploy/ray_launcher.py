"""``tandem ray up``: the same components as ``tandem up``, each supervised by a Ray actor.

Every component (router, target and draft workers, frontend) gets one :class:`ComponentActor`,
which runs ``python -m <module>`` as a child process on its node (so SIGTERM drain, health ports
and logs behave exactly as everywhere else). Target and draft actors reserve GPUs
(``--gpus-per-worker``) when serving a real model. etcd and NATS are not started here: their URLs
are passed in and must be reachable from every node. The driver waits until the frontend's
``/health`` (probed from the frontend's own node) lists a served model, as ``tandem up`` does,
prints the URL, and on Ctrl-C stops the actors in reverse start order.

With ``--planner`` the driver serves ``launcher.scale`` (:mod:`deploy.scaling`) and the planner runs
as one more actor: a new worker is one more :class:`ComponentActor` (placed and started like the
first ones), and a worker that goes is stopped through its actor (SIGTERM: it leaves discovery,
drains, exits), then the actor is killed.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace

from deploy.draft_kinds import kind_to_add, pick_victims
from deploy.scaling import ScaleService
from deploy.stack import WORKER_POOLS, Component, StackConfig, component_names, plan, worker_component
from planner.messages import PoolReplicas, ScaleReply, ScaleRequest
from runtime.config import RuntimeConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RayOptions:
    """Which Ray cluster, where etcd and NATS are, and what each worker actor reserves."""

    address: str = "auto"
    etcd_url: str = "http://127.0.0.1:2379"
    nats_url: str = "nats://127.0.0.1:4222"
    gpus_per_worker: float = 1.0
    cpus_per_component: float = 1.0
    startup_timeout: float = 600.0

    def __post_init__(self) -> None:
        if not self.etcd_url.startswith(("http://", "https://")):
            raise ValueError(f"etcd_url must be an http(s) URL, got {self.etcd_url!r}")
        if not self.nats_url.startswith(("nats://", "tls://")):
            raise ValueError(f"nats_url must be a nats:// URL, got {self.nats_url!r}")
        if self.gpus_per_worker < 0 or self.cpus_per_component < 0:
            raise ValueError("gpus_per_worker and cpus_per_component must be >= 0")
        if self.startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be > 0, got {self.startup_timeout}")


class ComponentActor:
    """Runs one Tandem component as a child process on the node Ray placed this actor on."""

    def __init__(self, name: str):
        self.name = name
        self.child = None

    def free_port(self) -> int:
        from deploy.binaries import free_port

        return free_port()

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def start(self, module: str, args: list[str], env: dict[str, str]) -> int:
        import sys

        from deploy.children import Child
        from runtime.config import child_env

        full_env = child_env(PYTHONUNBUFFERED="1", **env)
        self.child = Child(self.name, [sys.executable, "-m", module, *args], env=full_env).start()
        return self.child.pid

    def prepare_demo(self, tokenizer_only: bool) -> str:
        """Convert the bundled demo model (or only its tokenizer) on this node; returns its path."""
        import subprocess
        import sys

        from runtime.config import child_env

        argv = [sys.executable, "-m", "workers.demo_model", *(["--tokenizer-only"] if tokenizer_only else [])]
        out = subprocess.run(argv, capture_output=True, text=True, check=False, env=child_env())
        if out.returncode != 0:
            raise RuntimeError(f"python -m workers.demo_model failed on this node:\n{out.stderr[-2000:]}")
        return out.stdout.strip().splitlines()[-1]

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    def recent_output(self) -> str:
        return self.child.recent_output() if self.child else ""

    def ready(self, port: int, kind: str) -> bool:
        """This node's component on ``port`` is ready: its ``/health`` is 200 and, for the frontend,
        lists a served model (a frontend is ready to take traffic before any target registers) —
        the check ``tandem up`` makes."""
        from deploy.launcher import http_status, serves_a_model

        url = f"http://127.0.0.1:{port}/health"
        return serves_a_model(url) if kind == "frontend" else http_status(url) == 200

    def stop(self, timeout: float) -> int | None:
        from deploy.children import stop_tiers

        if self.child is None:
            return None
        stop_tiers([[self.child]], timeout)
        return self.child.returncode


def draft_placement(config: StackConfig, options: RayOptions) -> StackConfig:
    """Drafts run on the GPU their actor reserves: ``--draft-device auto`` becomes ``cuda`` when
    actors hold GPUs (Ray sets CUDA_VISIBLE_DEVICES for the actor and its child to the reserved one),
    so a draft that finds none fails at start-up instead of drafting on the CPU."""
    if config.draft_device == "auto" and options.gpus_per_worker > 0 and not config.mock:
        return replace(config, draft_device="cuda")
    return config


def _actor_options(comp_kind: str, config: StackConfig, options: RayOptions) -> dict:
    gpus = options.gpus_per_worker if comp_kind in ("target", "draft") and not config.mock else 0
    return {"num_cpus": options.cpus_per_component, "num_gpus": gpus, "max_concurrency": 4}


class _Abort(Exception):
    """Stop requested, or Ray could not do what was asked in time."""


def _get(refs, stop: threading.Event, timeout: float, what: str):
    """``ray.get(refs)`` that gives up on Ctrl-C or after ``timeout`` (e.g. no node has the GPUs)."""
    import ray

    single = not isinstance(refs, list)
    pending = [refs] if single else list(refs)
    deadline = time.monotonic() + timeout
    while pending:
        if stop.is_set():
            raise _Abort("stopped")
        if time.monotonic() > deadline:
            raise _Abort(f"{what}: Ray gave no answer within {timeout:.0f}s "
                         "(not enough free CPUs/GPUs for the actors? see `ray status`, --gpus-per-worker)")
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
    values = ray.get([refs] if single else refs)
    return values[0] if single else values


def run_ray(config: StackConfig, options: RayOptions) -> int:
    """Place the stack on the Ray cluster at ``options.address``; serve until SIGINT/SIGTERM."""
    try:
        import ray
    except ImportError:
        raise SystemExit("tandem ray up needs Ray: pip install 'tandem[ray]'") from None

    config = draft_placement(config, options)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(address=options.address, log_to_driver=True)
    remote_cls = ray.remote(ComponentActor)
    # No --model: each target resolves the bundled demo model on its own node.
    model_path = None if config.mock else config.model
    names = component_names(config)
    actors = {n: remote_cls.options(**_actor_options(n.split("-")[0], config, options)).remote(n) for n in names}
    started: list[str] = []
    service: ScaleService | None = None
    wait = options.startup_timeout
    try:
        ports = dict(zip(names, _get([actors[n].free_port.remote() for n in names], stop, wait, "placing actors")))
        ports["frontend"] = config.http_port or ports["frontend"]
        components = plan(config, model_path, ports)
        if config.model is None:
            # Model cards name a local tokenizer path, which the frontend reads on its own node:
            # prepare the demo files there too (targets and mock workers do it on theirs).
            _get(actors["frontend"].prepare_demo.remote(config.mock), stop, wait, "preparing the demo tokenizer")
        env = {"TANDEM_ETCD": options.etcd_url, "TANDEM_NATS": options.nats_url, "TANDEM_NAMESPACE": config.namespace}
        scaler = RayScaler(config, options, model_path, remote_cls, actors, components, started, env, stop)
        if config.planner:
            # before the planner starts, so that it finds the endpoint at its first tick
            service = ScaleService(RuntimeConfig.from_env(etcd_url=options.etcd_url, nats_url=options.nats_url,
                                                          namespace=config.namespace, handle_signals=False,
                                                          drain_timeout=5.0), scaler.scale)
            try:
                service.start()
            except RuntimeError as exc:
                raise _Abort(str(exc)) from None
        for comp in components:
            scaler.start(comp)
        frontend_ip = _get(actors["frontend"].node_ip.remote(), stop, 60, "frontend address")
        _wait_ready(actors, components, wait, stop)
        url = f"http://{frontend_ip if config.host == '0.0.0.0' else config.host}:{ports['frontend']}"
        print(f"\nTandem is ready on Ray at {url}/v1 (model {config.model_name(model_path)!r}). "
              "Press Ctrl-C to stop.\n", flush=True)
        while not stop.wait(1.0):
            if not _get(actors["frontend"].alive.remote(), stop, 60, "frontend status"):
                log.error("the frontend exited:\n%s", ray.get(actors["frontend"].recent_output.remote()))
                return 1
        return 0
    except _Abort as exc:
        if stop.is_set():
            return 0
        log.error("%s", exc)
        return 1
    finally:
        stop.set()  # a worker the planner asked for and not yet started is not started now
        if service is not None:
            service.stop()
        for name in reversed(list(started)):
            try:
                ray.get(actors[name].stop.remote(config.drain_timeout + 5), timeout=config.drain_timeout + 15)
            except Exception:  # the actor or its node is gone: nothing left to stop there
                log.warning("could not stop %s cleanly", name, exc_info=True)
        for actor in list(actors.values()):
            ray.kill(actor)
        ray.shutdown()
        log.info("all stopped")


def _wait_ready(actors: dict, components: list[Component], timeout: float, stop: threading.Event) -> None:
    """Every component alive and ready (probed on its own node), the frontend last, once it lists a model."""
    deadline = time.monotonic() + timeout
    pending = [c for c in components if c.kind != "frontend"] + [c for c in components if c.kind == "frontend"]
    while pending:
        for comp in components:
            if not _get(actors[comp.name].alive.remote(), stop, 60, f"{comp.name} status"):
                tail = _get(actors[comp.name].recent_output.remote(), stop, 60, f"{comp.name} output")
                raise _Abort(f"{comp.name} exited during startup:\n{tail}")
        while pending and _get(actors[pending[0].name].ready.remote(pending[0].health_port, pending[0].kind), stop, 60,
                               "probe"):
            pending.pop(0)
        if pending:
            if time.monotonic() > deadline:
                raise _Abort(f"{pending[0].name} was not healthy within {timeout:.0f}s")
            stop.wait(0.5)


class RayScaler:
    """``launcher.scale`` for ``tandem ray up``: one actor per worker, added or stopped on request."""

    def __init__(self, config: StackConfig, options: RayOptions, model_path: str | None, remote_cls, actors: dict,
                 components: list[Component], started: list[str], env: dict[str, str], stop: threading.Event):
        self.config, self.options, self.model_path = config, options, model_path
        self.remote_cls, self.actors, self.components, self.started = remote_cls, actors, components, started
        self.env, self.stop = env, stop
        self.pids: dict[str, int] = {}  # component name -> pid of its process (what remove_first names)
        self.stopping: set[str] = set()
        self._lock = threading.Lock()

    def _active(self, kind: str) -> list[str]:
        return [c.name for c in self.components if c.kind == kind and c.name in self.started
                and c.name not in self.stopping]

    def _sizes(self) -> list[PoolReplicas]:
        return [PoolReplicas(kind, len(self._active(kind))) for kind in WORKER_POOLS]

    def scale(self, request: ScaleRequest) -> ScaleReply:
        cfg = self.config
        with self._lock:
            if request.pool not in WORKER_POOLS:
                return ScaleReply(self._sizes(), error=f"unknown pool {request.pool!r}")
            if request.replicas is None:
                return ScaleReply(self._sizes())
            if request.pool == "draft" and (cfg.mock or cfg.draft_method == "none"):
                return ScaleReply(self._sizes(), error="this stack runs no draft workers")
            if request.pool == "prefill" and not cfg.prefill_workers:
                return ScaleReply(self._sizes(), error="this stack has no prefill pool (--prefill-workers N)")
            if request.replicas < (1 if request.pool == "target" else 0):
                return ScaleReply(self._sizes(), error=f"{request.replicas} {request.pool} workers is too few")
            active, started, stopping = self._active(request.pool), [], []
            while len(active) < request.replicas:
                name = self._add(request.pool)
                active.append(name)
                started.append(name)
            order = {pid: i for i, pid in enumerate(request.remove_first)}
            kinds = {c.name: c.draft_kind for c in self.components}
            victims = pick_victims([(n, kinds.get(n, "")) for n in active], max(0, len(active) - request.replicas),
                                   lambda n: order.get(self.pids.get(n, -1), len(order)))
            for name in victims:
                self.stopping.add(name)
                threading.Thread(target=self._remove, args=(name,), name=f"stop-{name}", daemon=True).start()
                stopping.append(name)
            return ScaleReply(self._sizes(), started, stopping)

    def start(self, comp: Component) -> None:
        """Start ``comp``'s process through its (placed) actor and remember its pid."""
        actor = self.actors[comp.name]
        args = list(comp.args)
        if comp.kind == "draft":
            # Targets on other nodes dial the gRPC address a draft registers: make it the node's IP.
            args += ["--grpc-host", _get(actor.node_ip.remote(), self.stop, 60, f"{comp.name} address")]
        env = {**self.env, **dict(comp.env)}  # the component's own variables (the frontend's API keys)
        self.pids[comp.name] = _get(actor.start.remote(comp.module, args, env), self.stop, 60,
                                    f"starting {comp.name}")
        self.started.append(comp.name)

    def _add(self, kind: str) -> str:
        taken = [int(c.name.rsplit("-", 1)[1]) for c in self.components if c.kind == kind]
        name = f"{kind}-{max(taken, default=-1) + 1}"
        # in the actors map at once, so that the launcher kills it at shutdown even if it never starts
        actor = self.actors[name] = self.remote_cls.options(**_actor_options(kind, self.config, self.options)).remote(name)
        port = _get(actor.free_port.remote(), self.stop, self.options.startup_timeout, f"placing {name}")
        draft_kind = None
        if kind == "draft":  # the kind furthest below its share of the pool (deploy.draft_kinds)
            labels = {c.name: c.draft_kind for c in self.components}
            draft_kind = kind_to_add(self.config.kinds, Counter(labels[n] for n in self._active("draft")))
        comp = worker_component(self.config, self.model_path, kind, int(name.rsplit("-", 1)[1]), port, draft_kind)
        self.components.append(comp)
        self.start(comp)
        return name

    def _remove(self, name: str) -> None:
        import ray

        try:
            ray.get(self.actors[name].stop.remote(self.config.drain_timeout + 5), timeout=self.config.drain_timeout + 15)
            ray.kill(self.actors[name])
        except Exception:
            log.warning("could not stop %s cleanly", name, exc_info=True)
        with self._lock:
            if name in self.started:
                self.started.remove(name)
