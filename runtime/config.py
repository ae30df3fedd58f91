"""Runtime configuration. Environment variables are read here and nowhere else: every flag's
``TANDEM_<FLAG>`` (:func:`apply_env_defaults`), the runtime's addresses (:meth:`RuntimeConfig.from_env`),
and the few variables that are not flags (the functions at the end of this module).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import unquote, urlparse

from pydantic import Field

from .settings import Group, parse_group

# gRPC's C core logs every failed TLS handshake at INFO on stderr, beside (and before) our own one
# line about it; its errors it still logs. An operator's GRPC_VERBOSITY wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

DEFAULT_ETCD = "http://127.0.0.1:2379"
DEFAULT_NATS = "nats://127.0.0.1:4222"
DEFAULT_NAMESPACE = "tandem"


@dataclass(frozen=True)
class RuntimeConfig:
    """Where etcd and NATS are, which namespace to live in, and lifecycle timings."""

    etcd_url: str = DEFAULT_ETCD
    nats_url: str = DEFAULT_NATS
    namespace: str = DEFAULT_NAMESPACE
    lease_ttl: int = 10
    drain_timeout: float = 30.0
    ack_timeout: float = 10.0  # how long a client waits for an instance to acknowledge a request
    heartbeat_interval: float = 1.0  # a stream idle this long gets a heartbeat frame
    handle_signals: bool = True
    health_host: str = "127.0.0.1"
    health_port: int | None = None  # serve /live, /health, /metrics here (0: any free port; None: off)
    connect_timeout: float = 30.0  # at start-up, give up on NATS or etcd after this long (one line, exit 1)
    # NATS security: a token or user:password go in the URL (nats://TOKEN@host:port); TLS (the CA that
    # signed the server's certificate; a client certificate and key for mutual TLS); a .creds file
    # (JWT + NKEY) or an NKEY seed file.
    nats_tls_ca: str | None = None
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None
    nats_creds: str | None = None
    nats_nkey: str | None = None
    # etcd security: TLS when the URL is https:// or a CA / client certificate is given (the CA that
    # signed etcd's certificate, default the system's roots; a client certificate and key for mutual
    # TLS); a user and password (also accepted in the URL, http://USER:PASSWORD@host:port).
    etcd_tls_ca: str | None = None
    etcd_tls_cert: str | None = None
    etcd_tls_key: str | None = None
    etcd_user: str | None = None
    etcd_password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("etcd_url", "nats_url"):
            url = urlparse(getattr(self, name))
            if not url.hostname or not url.port:
                raise ValueError(f"{name} must look like scheme://host:port, got {getattr(self, name)!r}")
        if not self.namespace or not self.namespace.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"namespace must be alphanumeric (with - or _), got {self.namespace!r}")
        if self.lease_ttl < 2:
            raise ValueError(f"lease_ttl must be at least 2 seconds, got {self.lease_ttl}")
        if bool(self.nats_tls_cert) != bool(self.nats_tls_key):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together")
        if bool(self.etcd_tls_cert) != bool(self.etcd_tls_key):
            raise ValueError("--etcd-tls-cert and --etcd-tls-key go together")
        user, password = self.etcd_credentials
        if (user is None) != (password is None):
            raise ValueError("an etcd user needs a password and a password needs a user")
        for name in ("nats_tls_ca", "nats_tls_cert", "nats_tls_key", "nats_creds", "nats_nkey",
                     "etcd_tls_ca", "etcd_tls_cert", "etcd_tls_key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"{name.replace('_', '-')} {path} does not exist")
        if self.connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be > 0, got {self.connect_timeout}")
        if self.drain_timeout < 0 or self.ack_timeout <= 0 or self.heartbeat_interval <= 0:
            raise ValueError("drain_timeout must be >= 0, ack_timeout and heartbeat_interval > 0")

    @classmethod
    def from_env(cls, **overrides) -> RuntimeConfig:
        """Defaults, then ``TANDEM_ETCD`` / ``TANDEM_NATS`` / ``TANDEM_NAMESPACE``, then overrides
        (``None`` values are ignored, so CLI flags can be passed through unconditionally)."""
        base = cls(
            etcd_url=os.environ.get("TANDEM_ETCD", DEFAULT_ETCD),
            nats_url=os.environ.get("TANDEM_NATS", DEFAULT_NATS),
            namespace=os.environ.get("TANDEM_NAMESPACE", DEFAULT_NAMESPACE),
            **{name: os.environ.get(f"TANDEM_{name.upper()}") or None
               for name in ("nats_tls_ca", "nats_tls_cert", "nats_tls_key", "nats_creds", "nats_nkey",
                            "etcd_tls_ca", "etcd_tls_cert", "etcd_tls_key", "etcd_user")},
            etcd_password=_read_at_file(os.environ.get("TANDEM_ETCD_PASSWORD") or None),
        )
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})

    def nats_options(self) -> dict:
        """Keyword arguments for ``nats.connect`` from the security settings."""
        options: dict = {}
        if self.nats_tls_ca or self.nats_tls_cert:
            import ssl

            context = ssl.create_default_context(cafile=self.nats_tls_ca)
            if self.nats_tls_cert:
                context.load_cert_chain(self.nats_tls_cert, self.nats_tls_key)
            options["tls"] = context
            options["tls_hostname"] = urlparse(self.nats_url).hostname
        if self.nats_creds:
            options["user_credentials"] = self.nats_creds
        if self.nats_nkey:
            options["nkeys_seed"] = self.nats_nkey
        return options

    @property
    def etcd_host_port(self) -> tuple[str, int]:
        url = urlparse(self.etcd_url)
        return url.hostname or "127.0.0.1", url.port or 2379

    @property
    def etcd_credentials(self) -> tuple[str | None, str | None]:
        """(user, password): the flags' or, failing those, the URL's."""
        if self.etcd_user is not None or self.etcd_password is not None:
            return self.etcd_user, self.etcd_password
        url = urlparse(self.etcd_url)
        return (unquote(url.username) if url.username else None,
                unquote(url.password) if url.password is not None else None)

    def etcd_security(self):
        """The etcd client's :class:`~runtime.etcd.EtcdSecurity` from these settings."""
        from .etcd import EtcdSecurity

        user, password = self.etcd_credentials
        tls = urlparse(self.etcd_url).scheme == "https" or bool(self.etcd_tls_ca or self.etcd_tls_cert)
        return EtcdSecurity(tls=tls, ca=self.etcd_tls_ca, cert=self.etcd_tls_cert, key=self.etcd_tls_key,
                            user=user, password=password)


# Flags a worker no longer has that a launcher (tandem up) still does, under the same name: their
# variables may be set for the launcher, and a worker inherits its environment.
LAUNCHER_FLAGS = frozenset({"--num-speculative-tokens", "--speculative-eagle-topk", "--speculative-num-steps",
                            "--no-load-aware-speculation"})

RETIRED_RUNTIME_FLAGS = {
    **{f"--nats-{key.replace('_', '-')}": f"use --nats-security '{{\"{key}\": ...}}' or TANDEM_NATS_{key.upper()}"
       for key in ("tls_ca", "tls_cert", "tls_key", "creds", "nkey")},
    **{f"--etcd-{key.replace('_', '-')}": f"use --etcd-security '{{\"{key}\": ...}}' or TANDEM_ETCD_{key.upper()}"
       for key in ("tls_ca", "tls_cert", "tls_key", "user", "password")},
}


def add_runtime_args(parser) -> None:
    """Add the flags every service shares to an ``argparse`` parser."""
    parser.add_argument("--etcd", default=None, help=f"etcd URL (env TANDEM_ETCD, default {DEFAULT_ETCD})")
    parser.add_argument("--nats", default=None, help=f"NATS URL (env TANDEM_NATS, default {DEFAULT_NATS})")
    parser.add_argument("--namespace", default=None, help="namespace (env TANDEM_NAMESPACE, default tandem)")
    parser.add_argument("--lease-ttl", type=int, default=None,
                        help="etcd lease TTL in seconds (env TANDEM_LEASE_TTL, default 10)")
    parser.add_argument("--health-port", type=int, default=None,
                        help="serve /live, /health and /metrics on this port (0: any free port; default: off)")
    parser.add_argument("--health-host", default=None, help="address for the health port (default 127.0.0.1)")
    parser.add_argument("--nats-security", default=None, metavar="JSON",
                        help="NATS TLS and credentials as JSON (or @FILE): tls_ca (the CA, PEM, that signed the "
                             "server's certificate: connect over TLS), tls_cert and tls_key (a client certificate "
                             "and its key, PEM, for mutual TLS), creds (a user credentials file, JWT + NKEY), nkey "
                             "(an NKEY seed file); a token or user:password go in the NATS URL. Each key also reads "
                             "from TANDEM_NATS_<KEY> (e.g. TANDEM_NATS_TLS_CA)")
    parser.add_argument("--etcd-security", default=None, metavar="JSON",
                        help="etcd TLS and auth as JSON (or @FILE): tls_ca (the CA, PEM, that signed etcd's "
                             "certificate: connect over TLS; https:// in the etcd URL alone uses the system's CAs), "
                             "tls_cert and tls_key (a client certificate and its key, PEM, for mutual TLS), user, "
                             "password (or @FILE to read it from a file; prefer TANDEM_ETCD_PASSWORD: flags show in "
                             "ps). Each key also reads from TANDEM_ETCD_<KEY>")
    if isinstance(parser, EnvParser):  # their per-key variables (TANDEM_NATS_TLS_CA, ...) still hold
        parser.retire(RETIRED_RUNTIME_FLAGS, env=False)
    parser.add_argument("--connect-timeout", type=float, default=None,
                        help="seconds to keep trying NATS and etcd at start-up before exiting with an error "
                             "(env TANDEM_CONNECT_TIMEOUT, default 30)")


ENV_PREFIX = "TANDEM_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def env_name(action: argparse.Action, prefix: str = ENV_PREFIX) -> str:
    """``TANDEM_<FLAG>`` for an option: its first long spelling (the canonical one), upper case."""
    flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
    return prefix + flag.lstrip("-").upper().replace("-", "_")


class EnvParser(argparse.ArgumentParser):
    """The services' parser: plain argparse through its public interface only. It keeps what
    ``add_argument`` returns (``options``; each action's ``kind`` is the ``action=`` it was added with,
    groups' options included) and the sub-commands ``add_parser`` makes (``subcommands``), so that
    :func:`apply_env_defaults` can give every option its ``TANDEM_<FLAG>`` fallback; and its
    :meth:`error` is one line that points at ``--help``, not the usage block first."""

    def __init__(self, *args, **kwargs):
        self.options: list[argparse.Action] = []
        self.subcommands: dict[str, EnvParser] = {}
        self.retired: dict[str, str] = {}
        self.retired_env: set[str] = set()
        super().__init__(*args, **kwargs)

    def retire(self, flags: Mapping[str, str], env: bool = True) -> None:
        """Flags this parser no longer has, each with where its setting went: given one, the parser
        exits with one line saying so (not argparse's bare "unrecognized arguments"). With ``env``, its
        ``TANDEM_<FLAG>`` variable set is refused the same way (it would be ignored without a word),
        unless a launcher still has a flag of that name (:data:`LAUNCHER_FLAGS`: a shared environment
        may set it for the launcher)."""
        self.retired.update(flags)
        if env:
            self.retired_env.update(flag for flag in flags if flag not in LAUNCHER_FLAGS)

    def parse_known_args(self, args=None, namespace=None):
        import sys

        words = sys.argv[1:] if args is None else list(args)
        for word in words:
            flag = word.partition("=")[0]
            if flag in self.retired:
                self.error(f"{flag} was retired: {self.retired[flag]}")
        for flag in sorted(self.retired_env):
            name = _flag_env_name(flag)
            if os.environ.get(name):
                hint = self.retired[flag]
                moved = hint.split()[1] if hint.startswith("use --") else None  # the flag it moved into
                also = f" (or {_flag_env_name(moved)} with that JSON)" if moved else ""
                self.error(f"{name} ({flag}) was retired: {hint}{also}")
        return super().parse_known_args(args, namespace)

    def _keep(self, add):
        def add_argument(*args, **kwargs):
            action = add(*args, **kwargs)
            action.kind = kwargs.get("action", "store")
            self.options.append(action)
            return action

        return add_argument

    def add_argument(self, *args, **kwargs):
        return self._keep(super().add_argument)(*args, **kwargs)

    def add_argument_group(self, *args, **kwargs):
        group = super().add_argument_group(*args, **kwargs)
        group.add_argument = self._keep(group.add_argument)
        return group

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", EnvParser)
        action = super().add_subparsers(**kwargs)
        add_parser = action.add_parser

        def add(name, **kw):
            self.subcommands[name] = sub = add_parser(name, **kw)
            return sub

        action.add_parser = add
        return action

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


SWITCHES = ("store_true", "store_false", "store_const")


def apply_env_defaults(parser: EnvParser, environ=None, prefix: str = ENV_PREFIX) -> EnvParser:
    """Give every option of ``parser`` (and of its sub-commands) a ``TANDEM_<FLAG>`` fallback.

    A set variable becomes the option's default (converted with the option's type, checked against
    its choices; a switch reads 1/true/yes/on or 0/false/no/off), so a flag on the command line still
    wins. A bad value exits through ``parser.error`` naming the variable. Each option's help gains
    its variable and its default; ``action.env_var`` and ``action.plain_help`` keep both apart for
    the generated reference. ``prefix`` sets a command apart whose flags mean something else than
    the services' flags of the same name (``tandem train-draft``: ``TANDEM_TRAIN_``).
    """
    if not isinstance(parser, EnvParser):
        raise TypeError("build the parser with runtime.config.EnvParser")
    environ = os.environ if environ is None else environ
    for sub in parser.subcommands.values():
        apply_env_defaults(sub, environ, prefix)
    for action in parser.options:
        if not action.option_strings or action.kind in ("help", "version"):
            continue
        if action.help == argparse.SUPPRESS or hasattr(action, "env_var"):
            continue
        name = env_name(action, prefix)
        raw = environ.get(name)
        if raw is not None and (raw != "" or action.kind in SWITCHES):
            action.default = _from_env(parser, action, name, raw)
            action.required = False
        action.env_var, action.plain_help = name, action.help or ""
        action.help = _help_with_env(action, name)
    return parser


def _from_env(parser: EnvParser, action: argparse.Action, name: str, raw: str):
    if action.kind in SWITCHES:
        value = raw.strip().lower()
        if value not in _TRUE | _FALSE:
            parser.error(f"environment variable {name}={raw!r}: expected 1/true/yes/on or 0/false/no/off")
        return action.const if value in _TRUE else action.default
    many = action.kind in ("append", "extend") or action.nargs in ("*", "+")
    values = [v.strip() for v in raw.split(",") if v.strip()] if many else [raw]
    out = []
    for value in values:
        try:
            converted = action.type(value) if action.type else value
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            parser.error(f"environment variable {name}={raw!r}: not a valid "
                         f"{getattr(action.type, '__name__', 'value')} ({exc})")
        if action.choices is not None and converted not in action.choices:
            parser.error(f"environment variable {name}={raw!r}: choose from "
                         f"{', '.join(map(str, action.choices))}")
        out.append(converted)
    return out if many else out[0]


def _help_with_env(action: argparse.Action, name: str) -> str:
    text = action.help or ""
    extra = [] if name in text else [f"env {name}"]
    if "default" not in text.lower() and action.kind not in SWITCHES:
        shown = "unset" if action.default is None else action.default
        extra.append(f"default: {shown}".replace("%", "%%"))
    if not extra:
        return text
    return f"{text} ({'; '.join(extra)})" if text else "; ".join(extra)


class NatsSecurity(Group):
    """``--nats-security``: TLS and credentials towards NATS."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    creds: str | None = None
    nkey: str | None = None


class EtcdSecurity(Group):
    """``--etcd-security``: TLS and auth towards etcd."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    user: str | None = None
    password: str | None = Field(None, repr=False)


def config_from_args(args, **overrides) -> RuntimeConfig:
    """Build the runtime config from parsed :func:`add_runtime_args` flags (a security key the flag's
    JSON leaves out reads from its ``TANDEM_NATS_<KEY>`` / ``TANDEM_ETCD_<KEY>`` variable)."""
    nats = parse_group(NatsSecurity, "--nats-security", getattr(args, "nats_security", None),
                       flag_env("--nats-security"))
    etcd = parse_group(EtcdSecurity, "--etcd-security", getattr(args, "etcd_security", None),
                       flag_env("--etcd-security"))
    return RuntimeConfig.from_env(
        etcd_url=args.etcd, nats_url=args.nats, namespace=args.namespace, lease_ttl=args.lease_ttl,
        health_port=args.health_port, health_host=args.health_host,
        **{f"nats_{key}": value for key, value in nats.model_dump().items()},
        **{f"etcd_{key}": value for key, value in etcd.model_dump().items() if key != "password"},
        etcd_password=_read_at_file(etcd.password),
        connect_timeout=args.connect_timeout or (float(os.environ["TANDEM_CONNECT_TIMEOUT"])
                                                 if os.environ.get("TANDEM_CONNECT_TIMEOUT") else None), **overrides
    )


def redact_url(url: str) -> str:
    """``url`` with a token, user or password replaced by '***' (for logs and errors)."""
    parts = urlparse(url)
    if not parts.username and not parts.password:
        return url
    return url.replace(parts.netloc, f"***@{parts.hostname}:{parts.port}")


def _read_at_file(value: str | None) -> str | None:
    """``@PATH`` -> the file's first line; anything else as given."""
    if value is None or not value.startswith("@"):
        return value
    with open(value[1:]) as f:
        return f.readline().rstrip("\r\n")


# --------------------------------------------------------------------------- variables that are not flags


def default_log_level() -> str:
    """``TANDEM_LOG_LEVEL``, else ``INFO``: the level of a process started without ``--log-level``."""
    return os.environ.get("TANDEM_LOG_LEVEL") or "INFO"


def _flag_env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def flag_env(flag: str) -> str | None:
    """The value of ``flag``'s ``TANDEM_<FLAG>`` variable (None: unset): a JSON-valued flag's keys from
    the environment, read beneath the flag's own (:func:`runtime.settings.parse_group`)."""
    return os.environ.get(_flag_env_name(flag)) or None


def fixed_instance_id() -> str | None:
    """``TANDEM_INSTANCE_ID``: a worker id kept across restarts (a StatefulSet pod's name; None: a random
    one per start). Each start is told apart by its incarnation (:attr:`runtime.Runtime.incarnation`)."""
    return os.environ.get("TANDEM_INSTANCE_ID") or None


def load_interval() -> float:
    """``TANDEM_LOAD_INTERVAL``: seconds between a target worker's load events (default 0.5)."""
    raw = os.environ.get("TANDEM_LOAD_INTERVAL") or "0.5"
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"TANDEM_LOAD_INTERVAL={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"TANDEM_LOAD_INTERVAL must be positive, got {raw}")
    return value


def cache_dir() -> Path:
    """Where downloads (the demo model, its tokenizer) are kept: ``$TANDEM_CACHE``, else
    ``$XDG_CACHE_HOME/tandem``, else ``~/.cache/tandem``."""
    if os.environ.get("TANDEM_CACHE"):
        return Path(os.environ["TANDEM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem"


def cpu_linear() -> str:
    """``TANDEM_CPU_LINEAR``: ``onednn`` (the default: oneDNN's packed linear kernels on CPU) or
    anything else, usually ``torch``, to turn them off for comparisons."""
    return os.environ.get("TANDEM_CPU_LINEAR") or "onednn"


def triton_interpret() -> bool:
    """Whether Triton runs its kernels in its interpreter (``TRITON_INTERPRET=1``; Triton reads it too)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# The folder this checkout's packages (runtime/, workers/, deploy/, ...) are imported from.
SOURCE_ROOT = Path(__file__).resolve().parents[1]


def importable_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with :data:`SOURCE_ROOT` first on ``PYTHONPATH``: a child ``python -m deploy...``
    imports the code its parent runs, from any working directory, whether the project was installed,
    installed in editable mode or is a plain checkout. Unchanged when it is already there, or when the
    packages sit in a site-packages folder (which the child's interpreter finds on its own; put on
    ``PYTHONPATH`` it would move ahead of the standard library)."""
    root = str(SOURCE_ROOT)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root in parts or root in _site_dirs():
        return dict(env)
    return {**env, "PYTHONPATH": os.pathsep.join([root, *parts])}


def _site_dirs() -> set[str]:
    import site

    dirs = set(site.getsitepackages()) if hasattr(site, "getsitepackages") else set()
    return {str(Path(d).resolve()) for d in (*dirs, site.getusersitepackages())}


def child_env(**extra: str) -> dict[str, str]:
    """The environment a launched child process gets: this process's, with ``extra`` set and this
    checkout importable (:func:`importable_env`)."""
    return importable_env({**os.environ, **extra})


@contextlib.contextmanager
def without_tandem_env() -> Iterator[None]:
    """Unset every ``TANDEM_*`` variable for the block (parsers then show their own defaults)."""
    saved = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith(ENV_PREFIX)]}
    try:
        yield
    finally:
        os.environ.update(saved)
