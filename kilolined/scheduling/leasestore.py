"""Where leases live: the seam between the lease scope and the bookkeeping behind it.

One gateway keeps its leases in its own ``queue.Scheduler`` (the default, and the fast path).
A store shared by several gateways (cluster mode) or one that weighs leases by cost implements
the same few calls; the lease scope and the runners do not change.
"""

from __future__ import annotations

from typing import Protocol

from kilolined.scheduling.affinity import Affinity
from kilolined.scheduling.queue import Lease, Ticket


class LeaseStore(Protocol):
    def admit(self, route: str, key: str, priority: int, now: float, *, pinned_node: str | None = None,
              cost: float = 0.0, model: str | None = None, affinity: Affinity | None = None,
              body: int = 0) -> Ticket:
        """Queue a request of this cost, for this model, with ``body`` bytes of body held while it
        waits (raises Rejected); it may hold a lease at once."""
        ...

    def cancel(self, t: Ticket) -> bool:
        """Take a waiting ticket out; False when it is not waiting."""
        ...

    def requeue(self, lease: Lease, now: float, avoid_node: bool = True, lost: bool = False) -> Ticket:
        """Give the lease back and put its ticket at the head of its queue."""
        ...

    def release(self, lease: Lease, now: float, service_time: float | None) -> None:
        """Give the slot back (idempotent)."""
        ...

    def dispatch(self, now: float) -> list[Lease]:
        """Hand free slots to waiting tickets."""
        ...

    def forget_route(self, route: str, node: str | None) -> None:
        """A route made for a client-named target is gone (kilolined/ops/adhoc.py dropped it, and
        ``node`` with it, if given): what the store keeps for them goes too, unless in use."""
        ...
