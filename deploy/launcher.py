"""``tandem up``: the whole stack on 127.0.0.1 as child processes of one command.

Start order: etcd, nats-server (unless external URLs are given), the standalone router (if asked),
draft workers, target workers, the frontend. Each child runs in its own process group, in the
launcher's working directory with this checkout first on ``PYTHONPATH`` (so a plain checkout, not
installed, starts them too), and its output is forwarded as ``[name] line``. The launcher waits until the frontend's ``/health`` is 200
and lists a model (readiness alone says only that the frontend takes traffic),
prints the URL, a curl example and where each target's ``vllm:`` metrics are (its own health port:
the frontend's ``/metrics`` has the frontend's), and on Ctrl-C or SIGTERM stops the children in
reverse order (SIGTERM a tier, wait for its drain, SIGKILL stragglers), then removes its temp dir.
While it serves, a child that exits without being asked is started again on the same ports under the same
name (:mod:`deploy.supervisor`); only the launcher's own stop ends the stack. The launcher opens
the frontend's listening socket itself and keeps it (the frontend serves on it, ``--http-fd``), so a
client that connects while the frontend restarts waits for the new one instead of being refused.

With ``--planner`` (or ``--allow-scaling``) it also serves ``launcher.scale`` (:mod:`deploy.scaling`):
a planner asks it for a number of prefill, target or draft workers, and it starts new ones (named
``target-2``, ... as :func:`deploy.stack.worker_component` plans them) or SIGTERMs the ones the
planner would rather lose, which leave discovery at once, drain, then exit.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from deploy.binaries import free_port, free_ports, listening_socket, port_open, wait_port
from deploy.children import Child, stop_tiers
from deploy.draft_kinds import kind_to_add, pick_victims
from deploy.infra import etcd_child, nats_child
from deploy.scaling import ScaleService
from deploy.stack import WORKER_POOLS, Component, StackConfig, component_names, plan, worker_component
from deploy.supervisor import RestartPolicy, RestartState
from planner.messages import PoolReplicas, ScaleReply, ScaleRequest
from runtime.config import RuntimeConfig, child_env, redact_url

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """The stack could not be brought up (a child exited, a timeout, a missing module)."""


@dataclass(frozen=True)
class LocalOptions:
    """Where infrastructure comes from and how long to wait for the stack."""

    etcd_url: str | None = None  # an existing etcd; None: start one
    nats_url: str | None = None  # an existing NATS server; None: start one
    etcd_port: int = 0  # 0: a free port
    nats_port: int = 0
    startup_timeout: float = 600.0
    allow_scaling: bool = False  # serve launcher.scale even without --planner (for a planner run elsewhere)

    def __post_init__(self) -> None:
        for name in ("etcd_port", "nats_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be a TCP port or 0, got {getattr(self, name)}")
        if self.startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be > 0, got {self.startup_timeout}")


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status code of ``GET url``, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def serves_a_model(url: str, timeout: float = 2.0) -> bool:
    """True when the frontend readiness probe at ``url`` is 200 and lists a served model."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200 and bool(json.loads(resp.read()).get("models"))
    except (urllib.error.URLError, OSError, ValueError):
        return False


def resolve_demo_model() -> str:
    """The bundled demo model's directory: the cached one, else ``python -m workers.demo_model``
    converts it (once; in a child, so this launcher never imports torch)."""
    from workers.demo_model import prepared_demo_model

    ready = prepared_demo_model()
    if ready is not None:
        return str(ready)
    log.info("converting the bundled demo model (the first run only, about 20 s)")
    out = subprocess.run([sys.executable, "-m", "workers.demo_model"], capture_output=True, text=True,
                         env=child_env())
    if out.returncode != 0:
        raise LaunchError(f"python -m workers.demo_model failed:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def gpu_visible() -> bool:
    """Whether an NVIDIA GPU is visible to this machine's children (the driver lists one; this
    launcher never imports torch). A device hidden by CUDA_VISIBLE_DEVICES="" counts as none."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return gpus.is_dir() and any(gpus.iterdir())


CPU_SPECULATION_NOTE = (
    "On a CPU most steps decode plainly, by design. A verify step costs here about what a plain step does (at 4 "
    "draft tokens, 1.02x and 1.13x in docs/benchmarks.md), so what decides is the draft's own time and how much of "
    "it is accepted (the bundled EAGLE-3 head: a round costs about 0.2 of a target step and yields about 1.6 "
    "tokens per verify step on chat), and load-aware speculation drafts only where its cost model of this "
    "machine's own steps says that pays (a response's usage.spec_decode.plain_steps counts the plain steps by "
    "reason, 'load' for these; --no-load-aware-speculation drafts every step).")


def banner(config: StackConfig, model_path: str | None, url: str, env: dict[str, str],
           engine_metrics: dict[str, str] | None = None) -> str:
    """What ``tandem up`` prints once the stack serves: the URL, a curl that works as printed (with the
    API key header when keys are required), where vLLM's metrics are (``engine_metrics``: each target
    or prefill worker's name -> its ``/metrics`` URL), how to add a worker, and why a CPU decodes plainly."""
    name = config.model_name(model_path)
    names = config.model_names(model_path)
    worker = (f"workers.mock --served-model-name {' '.join(names)}" if config.mock
              else f"workers.target --model {model_path} --served-model-name {' '.join(names)}")
    auth = "-H \"Authorization: Bearer $TANDEM_API_KEY\" " if config.api_keys else ""
    lines = [f"\nTandem is ready at {url}/v1 (model {name!r}"
             + (f", also served as {', '.join(map(repr, names[1:]))}" if names[1:] else "") + ").",
             f"  curl {url}/v1/chat/completions {auth}-H 'Content-Type: application/json' \\",
             f"    -d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}], "
             f"\"max_tokens\": 32}}'"]
    if config.api_keys:
        lines.append("  (the server wants one of the --api-key keys: export TANDEM_API_KEY=<key> first)")
    if engine_metrics and not config.mock:  # the mock worker exports no vllm: names
        lines.append(f"vLLM's engine metrics (vllm:*) are each target's, not on {url}/metrics (the frontend's: "
                     f"tandem_frontend_*, dynamo_frontend_*):")
        lines += [f"  {where}  ({name})" for name, where in engine_metrics.items()]
    if not config.mock and config.draft_method != "none" and config.num_drafts and not gpu_visible():
        lines.append(CPU_SPECULATION_NOTE)
    lines += ["Add a worker while it runs:",
              f"  TANDEM_ETCD={redact_url(env['TANDEM_ETCD'])} TANDEM_NATS={redact_url(env['TANDEM_NATS'])} "
              f"TANDEM_NAMESPACE={env['TANDEM_NAMESPACE']} {sys.executable} -m {worker}",
              "Press Ctrl-C to stop.", ""]
    return "\n".join(lines)


SUPERVISE_PERIOD_S = 0.1  # how often the launcher looks for children that died
SPARE_AFTER_S = 2.0  # a restarted child's next spare starts this long after it, not beside its start-up


class Launcher:
    """Brings a :class:`StackConfig` up locally and keeps it up until :meth:`request_stop`."""

    def __init__(self, config: StackConfig, options: LocalOptions = LocalOptions(),
                 restart_policy: RestartPolicy = RestartPolicy()):
        self.config = config
        self.options = options
        self.restart_policy = restart_policy
        self._stop = threading.Event()
        self._infra: list[Child] = []
        self._children: dict[str, Child] = {}
        self._components: list[Component] = []
        self._workdir: Path | None = None
        self._env: dict[str, str] = {}
        self._model_path: str | None = None
        self._child_env: dict[str, str] = {}
        self._scale_lock = threading.Lock()
        self._stopping: list[threading.Thread] = []
        self._scaler: ScaleService | None = None
        self._http_socket: socket.socket | None = None  # the frontend's, held across its restarts
        self.url = ""

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def run(self) -> int:
        """Up, serve until asked to stop, down. Returns the process exit code."""
        try:
            self._up()
            self._announce()
            return self._supervise()
        except LaunchError as exc:
            log.error("%s", exc)
            return 1
        except _Stopped:
            return 0
        finally:
            self._down()

    # --- bring up --------------------------------------------------------------------------------

    def _up(self) -> None:
        cfg = self.config
        if cfg.http_port and port_open(cfg.http_port, "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host):
            raise LaunchError(f"port {cfg.http_port} is already in use: stop what runs there or pass --http-port")
        self._workdir = Path(tempfile.mkdtemp(prefix="tandem-up-"))
        model_path = None
        if not cfg.mock:
            if cfg.model and not Path(cfg.model).exists():
                raise LaunchError(f"--model {cfg.model} does not exist")
            for kind in cfg.draft_kinds or cfg.planned_drafts()[:1]:
                if kind.model and not Path(kind.model).exists():
                    flag = f"--draft-kinds {kind.label}:" if cfg.draft_kinds else "--draft-model"
                    raise LaunchError(f"{flag} {kind.model} does not exist")
            model_path = cfg.model or resolve_demo_model()
        self._model_path = model_path
        self._check_stop()
        etcd_url, nats_url = self._start_infra()
        names = component_names(cfg)
        picked = free_ports(len(names) + 1)  # distinct (see free_ports)
        ports = dict(zip(names, picked))
        ports["frontend"] = cfg.http_port or picked[-1]
        try:
            self._http_socket = listening_socket(cfg.host, ports["frontend"])
        except OSError as exc:
            raise LaunchError(f"cannot listen for HTTP on {cfg.host}:{ports['frontend']}: {exc.strerror or exc}") from None
        http_fd = self._http_socket.fileno()
        self._components = plan(cfg, model_path, ports, http_fd)
        env = child_env(TANDEM_ETCD=etcd_url, TANDEM_NATS=nats_url, TANDEM_NAMESPACE=cfg.namespace,
                        PYTHONUNBUFFERED="1")
        self._child_env = env
        if self.config.planner or self.options.allow_scaling:
            # before the planner starts, so that it finds the endpoint at its first tick
            self._scaler = ScaleService(RuntimeConfig.from_env(etcd_url=etcd_url, nats_url=nats_url,
                                                               namespace=cfg.namespace, handle_signals=False,
                                                               drain_timeout=5.0), self.scale)
            try:
                self._scaler.start()
            except RuntimeError as exc:
                raise LaunchError(str(exc)) from None
        for comp in self._components:
            self._check_stop()
            frontend = comp.kind == "frontend"
            self._children[comp.name] = Child(comp.name, comp.argv(), env={**env, **dict(comp.env)},
                                              pass_fds=(http_fd,) if frontend else (),
                                              spare_flag="--spare" if frontend else None).start()
        host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
        self.url = f"http://{host}:{ports['frontend']}"
        self._env = {"TANDEM_ETCD": etcd_url, "TANDEM_NATS": nats_url, "TANDEM_NAMESPACE": cfg.namespace}
        # Every component ready, the frontend last, once it sees a target serving the model.
        urls = [f"http://127.0.0.1:{c.health_port}/health" for c in self._components if c.kind != "frontend"]
        self._wait_healthy([*urls, f"{self.url}/health"])

    def _start_infra(self) -> tuple[str, str]:
        opts, env = self.options, child_env()
        etcd_url, nats_url = opts.etcd_url, opts.nats_url
        if etcd_url is None:
            port = opts.etcd_port or free_port()
            child = etcd_child(port, free_port(), self._workdir, env).start()
            self._infra.append(child)
            self._wait_port(child, port)
            etcd_url = f"http://127.0.0.1:{port}"
        if nats_url is None:
            port = opts.nats_port or free_port()
            child = nats_child(port, self._workdir, env).start()
            self._infra.append(child)
            self._wait_port(child, port)
            nats_url = f"nats://127.0.0.1:{port}"
        log.info("etcd at %s, NATS at %s, namespace %s", redact_url(etcd_url), redact_url(nats_url),
                 self.config.namespace)
        return etcd_url, nats_url

    def _wait_port(self, child: Child, port: int) -> None:
        try:
            wait_port(port, timeout=30, alive=child.alive)
        except (TimeoutError, RuntimeError) as exc:
            raise LaunchError(f"{child.name} did not start: {exc}\n{child.recent_output()}") from None

    def _wait_healthy(self, urls: list[str]) -> None:
        deadline = time.monotonic() + self.options.startup_timeout
        pending = list(urls)
        log.info("waiting for %s", ", ".join(pending))
        while time.monotonic() < deadline:
            self._check_stop()
            for child in [*self._infra, *self._children.values()]:
                if not child.alive():
                    raise LaunchError(f"{child.name} exited with {child.returncode} during startup; "
                                      f"its last lines:\n{child.recent_output()}")
            while pending and (serves_a_model(pending[0]) if pending[0] == f"{self.url}/health"
                               else http_status(pending[0]) == 200):
                pending.pop(0)
            if not pending:
                return
            self._stop.wait(0.25)
        raise LaunchError(f"{pending[0]} was not healthy within {self.options.startup_timeout:.0f}s")

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise _Stopped()

    # --- serve -----------------------------------------------------------------------------------

    def _announce(self) -> None:
        for comp in self._components:
            log.info("%-10s pid %-7d health http://127.0.0.1:%s/health", comp.name, self._children[comp.name].pid,
                     comp.health_port)
        engine_metrics = {c.name: f"http://127.0.0.1:{c.health_port}/metrics" for c in self._components
                          if c.kind in ("target", "prefill")}
        print(banner(self.config, self._model_path, self.url, self._env, engine_metrics), flush=True)

    def _supervise(self) -> int:
        """Serve until a stop is requested, restarting every child that exits without being asked
        (:mod:`deploy.supervisor`): etcd and NATS on their ports, the router, the frontend, every
        worker under its name. Returns 0: only the launcher's own stop ends the stack.

        The frontend is replaced from a spare process that has loaded its code and waits (started
        once the stack serves, and again after each restart): a new interpreter's imports were most
        of a restarted frontend's seconds."""
        states: dict[str, RestartState] = {}
        now = time.monotonic()
        for child in self._all_children():
            states[child.name] = RestartState(self.restart_policy, started_at=now)
            child.prepare_spare()
        while not self._stop.wait(SUPERVISE_PERIOD_S):
            with self._scale_lock:
                if self._stop.is_set():
                    break
                now = time.monotonic()
                for child in self._all_children():
                    state = states.setdefault(child.name, RestartState(self.restart_policy, started_at=now))
                    if child.expected_exit:
                        continue
                    if child.alive():
                        if now - state.started_at >= SPARE_AFTER_S:
                            child.prepare_spare()
                        continue
                    if state.due is None:
                        delay = state.died(now)
                        log.warning("%s exited with %s; restarting it in %.1fs (restart %d); the rest of the stack "
                                    "keeps serving. Its last lines:\n%s", child.name, child.returncode, delay,
                                    state.restarts + 1, child.recent_output(10))
                    if state.ready(now):
                        state.restarts += 1
                        child.restart()
                        state.started(time.monotonic())
        return 0

    def _all_children(self) -> list[Child]:
        return [*self._infra, *list(self._children.values())]

    # --- bring down ------------------------------------------------------------------------------

    def _down(self) -> None:
        with self._scale_lock:  # no worker starts or stops on a planner's word from here on
            self._stop.set()
            by_kind: dict[str, list[Child]] = {}
            for comp in self._components:
                if comp.name in self._children:
                    by_kind.setdefault(comp.kind, []).append(self._children[comp.name])
        tiers = [by_kind.get(k, []) for k in ("planner", "frontend", "target", "prefill", "draft", "router")]
        if self._scaler is not None:
            self._scaler.stop()
        stop_tiers(tiers[:1], timeout=10)
        stop_tiers(tiers[1:2], timeout=self.config.drain_timeout + 5)
        if self._http_socket is not None:  # no frontend any more: refuse connections, do not queue them
            self._http_socket.close()
        stop_tiers(tiers[2:], timeout=self.config.drain_timeout + 5)
        for thread in self._stopping:
            thread.join(self.config.drain_timeout + 10)
        stop_tiers([[c] for c in reversed(self._infra)], timeout=self.config.drain_timeout + 5)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        log.info("all stopped")


    # --- scale (the planner's launcher connector) --------------------------------------------------

    def _pool(self, kind: str, children: dict[str, Child] | None = None) -> list[Child]:
        """Workers of ``kind`` started and not told to stop, oldest first."""
        children = self._children if children is None else children
        return [children[c.name] for c in self._components
                if c.kind == kind and c.name in children and not children[c.name].expected_exit]

    def _sizes(self) -> list[PoolReplicas]:
        out = []
        for kind in WORKER_POOLS:
            draining = sum(1 for c in self._components if c.kind == kind and c.name in self._children
                           and self._children[c.name].expected_exit and self._children[c.name].alive())
            out.append(PoolReplicas(kind, len(self._pool(kind)), draining))
        return out

    def _refusal(self, request: ScaleRequest) -> str:
        cfg = self.config
        if request.pool not in WORKER_POOLS:
            return f"unknown pool {request.pool!r} (one of {', '.join(WORKER_POOLS)})"
        if request.replicas is None:
            return ""
        if request.pool == "draft" and (cfg.mock or cfg.draft_method == "none"):
            return "this stack runs no draft workers (--mock or --draft-method none)"
        if request.pool == "prefill" and not cfg.prefill_workers:
            return "this stack has no prefill pool (its targets are not decode workers; start it with --prefill-workers N)"
        if request.replicas < (1 if request.pool == "target" else 0):
            return f"{request.replicas} {request.pool} workers: " + (
                "at least one target must serve" if request.pool == "target" else "a count is >= 0")
        if request.replicas > 64:
            return f"{request.replicas} {request.pool} workers: at most 64 on one machine"
        return ""

    def scale(self, request: ScaleRequest) -> ScaleReply:
        """Grow or shrink one worker pool to ``request.replicas`` (None: only report the sizes)."""
        with self._scale_lock:
            refusal = self._refusal(request)
            if refusal or request.replicas is None or self._stop.is_set():
                return ScaleReply(self._sizes(), error=refusal or ("the stack is stopping" if self._stop.is_set() else ""))
            kind, started, stopping = request.pool, [], []
            active = self._pool(kind)
            while len(active) < request.replicas:
                child = self._start_worker(kind)
                active.append(child)
                started.append(child.name)
            if len(active) > request.replicas:
                order = {pid: i for i, pid in enumerate(request.remove_first)}
                # the planner's choice first (least loaded), then the newest; a kind's last draft last
                by_name = {c.name: c for c in active}
                kinds = {c.name: c.draft_kind for c in self._components}
                victims = pick_victims([(c.name, kinds.get(c.name, "")) for c in active], len(active) - request.replicas,
                                       lambda name: order.get(by_name[name].pid, len(order)))
                for child in (by_name[name] for name in victims):
                    child.expected_exit = True
                    thread = threading.Thread(target=stop_tiers, args=([[child]], self.config.drain_timeout + 5),
                                              name=f"stop-{child.name}", daemon=True)
                    thread.start()
                    self._stopping.append(thread)
                    stopping.append(child.name)
            return ScaleReply(self._sizes(), started, stopping)

    def _start_worker(self, kind: str) -> Child:
        taken = [int(c.name.rsplit("-", 1)[1]) for c in self._components if c.kind == kind]
        draft_kind = None
        if kind == "draft":  # the kind furthest below its share of the pool (deploy.draft_kinds)
            labels = {c.name: c.draft_kind for c in self._components}
            draft_kind = kind_to_add(self.config.kinds, Counter(labels[c.name] for c in self._pool("draft")))
        comp = worker_component(self.config, self._model_path, kind, max(taken, default=-1) + 1, free_port(), draft_kind)
        self._components.append(comp)
        child = self._children[comp.name] = Child(comp.name, comp.argv(), env={**self._child_env, **dict(comp.env)})
        return child.start()


class _Stopped(Exception):
    """A stop was requested while the stack was still coming up."""


def run_local(config: StackConfig, options: LocalOptions) -> int:
    """Run the launcher with SIGINT and SIGTERM wired to a clean stop."""
    launcher = Launcher(config, options)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, launcher.request_stop)
    return launcher.run()
