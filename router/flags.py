"""The KV router's queue flags, defined once: ``python -m router`` and ``python -m frontend`` (its
embedded router) add them, and ``tandem up`` passes them through to the frontend
(:class:`runtime.flags.SharedFlag`). Dynamo's names. Light to import."""

from __future__ import annotations

from runtime.flags import SharedFlag

from .queue import QUEUE_POLICIES

ROUTER_QUEUE_THRESHOLD = SharedFlag(("--router-queue-threshold",), dict(
    type=float, default=None,
    help="kv router: hold a request in the router's queue while every worker it may go to has at least this "
         "fraction of its max_num_seqs in flight from this router (e.g. 1.0), releasing held requests by "
         "nvext.agent_hints.strict_priority, then --router-queue-policy (default: unset, no queue)"))
ROUTER_QUEUE_POLICY = SharedFlag(("--router-queue-policy",), dict(
    default="fcfs", choices=QUEUE_POLICIES,
    help="order of held requests within a strict tier: fcfs (arrival, moved earlier by 1 s per unit of "
         "priority), lcfs (newest first), wspt (least expected work per weight first, from the prompt and "
         "nvext.agent_hints.osl)"))

QUEUE_FLAGS = (ROUTER_QUEUE_THRESHOLD, ROUTER_QUEUE_POLICY)


def queue_options(threshold: float | None, policy: str) -> dict:
    """``create_router`` options for the queue flags (none when they keep their defaults)."""
    out: dict = {}
    if threshold is not None:
        out["queue_threshold"] = threshold
    if policy != "fcfs":
        out["queue_policy"] = policy
    return out
