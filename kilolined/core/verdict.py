"""A node's failure, typed: what the lease scope judges a node by (scheduling/lease.py).

Where a failure is seen (the proxy, an adapter, a client mode) it is named once, as a ``Cause``,
and carried as that: the scope, the speed watch and stream continuation read the cause, never
the words. The words (``reason``) are for the client, the log and alerts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Cause(enum.Enum):
    STATUS = "status"  # the node answered with a failing status (failed_status)
    LOST = "lost"  # refused, reset, dropped, a prompt gone: nothing more comes from it
    STALL = "stall"  # silent for stall_sec in a running request: the speed watch judges it
    TIMEOUT = "timeout"  # no answer (or no end) within the request's time


def failed_status(status: int) -> bool:
    """An HTTP status from a node that counts as the node's failure (its breaker, its health):
    a 5xx. A 4xx is the request's doing, and passes through as an answer."""
    return status >= 500


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    """A node failed a request: ``cause``, in ``reason``'s words. ``mid_body``: after its answer
    had begun, so nothing of it can be retried."""

    cause: Cause
    reason: str
    mid_body: bool = False

    @property
    def stalled(self) -> bool:
        return self.cause is Cause.STALL


def status_verdict(status: int, mid_body: bool = False) -> NodeVerdict:
    return NodeVerdict(Cause.STATUS, f"HTTP {status} from node", mid_body)
