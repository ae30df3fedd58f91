"""The one service shape: parse flags, set up logging, run an async main on uvloop."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable

from .config import default_log_level

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | None = None) -> None:
    logging.basicConfig(level=(level or default_log_level()).upper(), format=LOG_FORMAT)


def run_service(main: Callable[[], Awaitable[None]], log_level: str | None = None) -> None:
    """Run ``main()`` on uvloop where available; exits 0 after a clean shutdown, and 1 with one
    line on stderr when the service cannot start (:class:`runtime.errors.StartupError`)."""
    from .errors import StartupError

    setup_logging(log_level)
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
