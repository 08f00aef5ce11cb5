"""Cards: one GPU that several nodes share (docs/CONFIG.md#cards).

A ComfyUI server on 8188 and a TTS server on 5002 of one 4090 are two nodes with one budget of
VRAM. Every lease on a node of a card counts against the card's ``max_concurrency`` and
``capacity`` as well as against the node's and the route's. Pure, no clock: the rules
(rules.py ``card_slots``, ``card_capacity``) check them before a lease, and the scheduler writes
the counts in its grant and release (the one writer of every slot count).
"""

from __future__ import annotations

from collections import Counter

from kilolined.core.config import CardConfig


class CardLoad:
    """The cards as configured, and what the leases on each one hold now: their number and costs.

    Counts are by the card a lease was granted under (Scheduler.grant / release), so a reload that
    moves a node to another card, or removes a card, frees the old card as those leases end."""

    def __init__(self) -> None:
        self.cfg: dict[str, CardConfig] = {}
        self.inflight: Counter[str] = Counter()
        self.used: dict[str, float] = {}

    def capacity(self, card: str | None) -> float | None:
        cfg = self.cfg.get(card) if card is not None else None
        return None if cfg is None else cfg.capacity

    def slots(self, card: str | None, slots: int) -> int:
        """Of ``slots`` on the nodes of ``card``, how many it lets run at once."""
        cfg = self.cfg.get(card) if card is not None else None
        cap = None if cfg is None else cfg.max_concurrency
        return slots if cap is None else min(slots, cap)
