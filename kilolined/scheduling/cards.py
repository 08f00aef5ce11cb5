"""Cards: one GPU that several nodes share (docs/CONFIG.md#cards).

A ComfyUI server on 8188 and a TTS server on 5002 of one 4090 are two nodes with one budget of
VRAM. Every lease on a node of a card counts against the card's ``max_concurrency`` and
``capacity`` as well as against the node's and the route's. Pure, no clock: the scheduler
(queue.py) asks ``room`` before it leases, and writes the counts in its grant and release (the
one writer of every slot count).
"""

from __future__ import annotations

from collections import Counter

from kilolined.core.config import CardConfig

EPS = 1e-9  # costs are sums of floats: compare with a little slack (as queue.py)


def has_room(cfg: CardConfig, inflight: int, used: float, cost: float) -> bool:
    """The rule: the card has a free slot, and room for ``cost`` besides what its leases hold."""
    if cfg.max_concurrency is not None and inflight >= cfg.max_concurrency:
        return False
    cap = cfg.capacity
    return cap is None or used + cost <= cap + EPS


class CardLoad:
    """The cards as configured, and what the leases on each one hold now: their number and costs.

    Counts are by the card a lease was granted under (Scheduler.grant / release), so a reload that
    moves a node to another card, or removes a card, frees the old card as those leases end."""

    def __init__(self) -> None:
        self.cfg: dict[str, CardConfig] = {}
        self.inflight: Counter[str] = Counter()
        self.used: dict[str, float] = {}

    def room(self, card: str | None, cost: float) -> bool:
        """Whether a node on ``card`` may take a request of ``cost`` now (no card: always)."""
        if card is None or (cfg := self.cfg.get(card)) is None:
            return True
        return has_room(cfg, self.inflight[card], self.used.get(card, 0.0), cost)

    def capacity(self, card: str | None) -> float | None:
        cfg = self.cfg.get(card) if card is not None else None
        return None if cfg is None else cfg.capacity

    def slots(self, card: str | None, slots: int) -> int:
        """Of ``slots`` on the nodes of ``card``, how many it lets run at once."""
        cfg = self.cfg.get(card) if card is not None else None
        cap = None if cfg is None else cfg.max_concurrency
        return slots if cap is None else min(slots, cap)
