"""The one service shape: parse flags, set up logging, run an async main on uvloop."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | None = None) -> None:
    logging.basicConfig(level=(level or os.environ.get("TANDEM_LOG_LEVEL", "INFO")).upper(), format=LOG_FORMAT)


def run_service(main: Callable[[], Awaitable[None]], log_level: str | None = None) -> None:
    """Run ``main()`` on uvloop where available; exits 0 after a clean shutdown."""
    setup_logging(log_level)
    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
