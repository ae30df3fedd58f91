"""The one service shape: parse flags, set up logging, run an async main on uvloop."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable

from .config import default_log_level

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def check_log_level(level: str | None = None) -> str:
    """``level`` (else ``TANDEM_LOG_LEVEL``, else INFO) upper-cased; ``ValueError`` for an unknown one."""
    value = (level or default_log_level()).upper()
    if value not in LOG_LEVELS:
        raise ValueError(f"unknown log level {(level or default_log_level())!r} (--log-level or TANDEM_LOG_LEVEL): "
                         f"choose {', '.join(LOG_LEVELS)}")
    return value


def setup_logging(level: str | None = None) -> None:
    logging.basicConfig(level=check_log_level(level), format=LOG_FORMAT)


def exit_on_bad_config(prog: str, *checks: Callable[[], object]) -> None:
    """Run ``checks`` (config builders, path checks, the log level) before anything starts: a
    ``ValueError`` or ``OSError`` from one is one line on stderr and exit status 1."""
    for check in checks:
        try:
            check()
        except (ValueError, OSError) as exc:
            sys.exit(f"{prog}: {exc}")


def run_service(main: Callable[[], Awaitable[None]], log_level: str | None = None) -> None:
    """Run ``main()`` on uvloop where available; exits 0 after a clean shutdown, and 1 with one
    line on stderr when the service cannot start (:class:`runtime.errors.StartupError`)."""
    from .errors import StartupError

    try:
        setup_logging(log_level)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(main())
        else:
            uvloop.run(main())
    except StartupError as exc:
        logging.getLogger("tandem").error("%s", exc)
        sys.exit(1)
