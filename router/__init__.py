"""Routing: which target instance serves a request.

``await create_router(rt, mode)`` returns a :class:`Router` (see :mod:`router.base`); the frontend
embeds one, or talks to a shared ``python -m router`` service through the same interface.
"""

from .base import ROUTER_MODES, Router, Selection, create_router

__all__ = ["ROUTER_MODES", "Router", "Selection", "create_router"]
