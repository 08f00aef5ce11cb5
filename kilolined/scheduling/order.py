"""The queue order of every strategy, as one key per ticket: both lease stores sort by it.

A waiting ticket's *place* is ``(score, arrival)``, lowest first: ``arrival`` counts the tickets
the store has queued (the local store's counter, Redis' ``wseq`` in the cluster), and ``score``
is ``base + per_arrival * arrival + round``, where this module computes ``base`` and
``per_arrival`` when the ticket is queued (or queued again) and ``round`` is the per-key fair
round below. The place never changes while the ticket waits, so a store keeps its queue sorted
(a sorted list here, a ZSET in Redis, kilolined/cluster/scripts.py) and takes the lowest: no
policy in the store, and the order is the same in both because this is its one definition.

- ``fifo``: score 0, so arrival order.
- ``fifo_fair_lease`` (one FIFO per key, served round-robin across keys), as start-time fair
  queuing: the ticket's round is ``max(its key's last round + 1, the route's current round)``
  (``fair_round``), the current round being the highest round dispatched so far. A key's n-th
  waiting ticket is in the n-th round from now, a key that was idle joins the current round, and
  within a round the earlier arrival goes first. The two counters are what a store keeps
  (``Rounds`` here; ``P fr:<route>`` and ``P fc:<route>`` in Redis, updated atomically by the
  scripts: counting, not policy). Unlike a ring of keys, a key new to the queue is served in
  the current round, before the keys already served in it, rather than after every other key's
  next turn: each key still gets one turn per round. A ticket granted on admission, without
  waiting, takes no round. Keys' last rounds are kept per client key, like the per-key counts.
- ``priority`` (higher priority first, FIFO within a priority, aging): the score is
  ``enqueued_at / age_step - priority``, ``age_step`` being ``queue_timeout_sec / 4``. Sorting by
  it is sorting by the *continuous* effective priority ``priority + waited / age_step``: the
  ``now / age_step`` every ticket shares drops out, so the place is fixed at enqueue. The documented
  "rises by 1 for every queue_timeout_sec/4 it waits" holds exactly at each of a ticket's step
  boundaries (waited k steps: risen by k); between them it has risen by the fraction waited,
  where a stepped rule (``floor(waited / age_step)``) would still count the last whole step.
  So a request of priority p goes ahead of one of priority p + k exactly when it has waited
  k steps longer (on a tie the earlier arrival first), whereas the stepped rule let it through
  as much as one step sooner or later depending on where the two were in their steps, and an
  order that changed with the clock needed a store to rescan every level at every pick.
  The cluster's score uses the gateway's Unix time: gateways' clocks differ by their skew (ms
  under NTP), which moves a request by skew / age_step of a level against another gateway's.
- Re-queued (its node failed under it; docs/API.md): before every other ticket, the latest
  re-queued first (``FRONT - arrival``) — it already waited its turn once.

``position`` (1 = next) is a ticket's rank in this order (ZRANK + 1 in Redis), and est_wait is
computed from it: the positions a view shows and the order of dispatch are one key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIFO, FAIR, PRIORITY = "fifo", "fifo_fair_lease", "priority"
#: Below every other score: re-queued tickets (scores of waiting tickets stay far above it:
#: Unix seconds over an age step of at least 1 ms are < 2e12; arrivals stay < 2**53 - 2**50)
FRONT = -float(2**50)


@dataclass(frozen=True, slots=True)
class Place:
    """Where a ticket waits: ``base + per_arrival * arrival`` (+ its key's round when ``fair`` names
    the key); ``wire`` is what the Redis scripts read to fill in their arrival and round."""

    base: float = 0.0
    per_arrival: int = 0  # -1: re-queued (the latest first)
    fair: str | None = None  # the key whose fair round it takes

    def score(self, arrival: int, round_: int) -> float:
        return self.base + self.per_arrival * arrival + (round_ if self.fair is not None else 0)

    def wire(self) -> list[float | int | str]:
        out: list[float | int | str] = [self.base, self.per_arrival]
        if self.fair is not None:
            out.append(self.fair)
        return out


def age_step(queue_timeout_sec: float) -> float:
    """The wait that raises a priority by 1 (``queue_timeout_sec / 4``, docs/CONFIG.md)."""
    return max(queue_timeout_sec / 4, 1e-3)


def place(strategy: str, key: str, priority: int, enqueued_at: float, step: float, front: bool = False) -> Place:
    """The ticket's place in its route's order (the module's docstring says why each)."""
    if front:
        return Place(FRONT, -1)
    if strategy == PRIORITY:
        return Place(enqueued_at / step - priority)
    if strategy == FAIR:
        return Place(fair=key)
    return Place()


def fair_round(last: int | None, current: int) -> int:
    """A key's next round: after its last one, and never before the round being served."""
    return current if last is None else max(last + 1, current)


@dataclass(slots=True)
class Rounds:
    """The fair rounds' counters of one route, as the local store keeps them."""

    current: int = 0
    last: dict[str, int] = field(default_factory=dict)

    def assign(self, key: str) -> int:
        r = self.last[key] = fair_round(self.last.get(key), self.current)
        return r

    def served(self, round_: int) -> None:
        self.current = max(self.current, round_)
