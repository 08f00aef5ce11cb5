"""``generic``: bytes in, bytes out; no progress beyond the queue events."""

from __future__ import annotations

from kilolined.adapters.base import Adapter


class GenericAdapter(Adapter):
    kind = "generic"
