"""The one small interface a GPU market is spoken through, and what its failures mean.

Pure types: the wire clients (vastai.py, runpod.py) implement ``Provider``; the decision module
and the loop only see ``Offer``, ``Instance`` and ``ProviderError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kilolined.core.config import FleetOfferConfig, FleetTemplateConfig

LABEL_PREFIX = "kiloline:"  # an instance the gateway rented is labelled kiloline:<pool>
Status = Literal["running", "booting", "stopped", "gone"]
RUNNING: Status = "running"
BOOTING: Status = "booting"
STOPPED: Status = "stopped"  # not running, its disk kept: it can be resumed (stopped, or a spot reclaim)
GONE: Status = "gone"


def label_of(pool: str) -> str:
    return LABEL_PREFIX + pool


def price_per_hour(v: Any) -> float | None:
    """A provider's $/hour, or None where it gives none the spend cap can add up: missing, not a
    number, negative, NaN or infinite (JSON parsers take ``NaN``; one NaN in the sum would make
    ``max_spend_per_hour`` compare false and so never refuse)."""
    if isinstance(v, bool):
        return None
    try:
        price = float(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return price if math.isfinite(price) and price >= 0 else None


def pool_of(label: str | None) -> str | None:
    """The pool an instance was rented for, from its label; None: not the gateway's."""
    if label and label.startswith(LABEL_PREFIX):
        return label[len(LABEL_PREFIX):] or None
    return None


@dataclass(frozen=True, slots=True)
class Offer:
    id: str
    machine: str | None
    price: float  # $/hour
    reliability: float
    gpu_name: str
    num_gpus: int


@dataclass(frozen=True, slots=True)
class Instance:
    id: str
    label: str | None
    status: Status
    price: float
    machine: str | None
    url: str | None  # http://host:port of the template's port once the provider maps it


ErrorKind = Literal["no_offer", "quota", "client", "server", "rate_limited", "network"]


class ProviderError(Exception):
    """A provider refused or failed a call. ``retry_after``: its 429's Retry-After, in seconds."""

    def __init__(self, kind: ErrorKind, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.kind = kind
        self.retry_after = retry_after


class Provider(Protocol):
    """Search offers, create, status, stop, resume, destroy, list own. Every call raises
    ProviderError."""

    async def search(self, offer: FleetOfferConfig, exclude_machines: frozenset[str], max_price: float) -> list[Offer]:
        ...

    async def create(self, offer: Offer, cfg: FleetOfferConfig, template: FleetTemplateConfig, label: str) -> str:
        ...

    async def status(self, instance_id: str, port: int) -> Instance | None:
        """None: the provider does not know it (destroyed)."""
        ...

    async def stop(self, instance_id: str) -> None:
        """Stop it, keeping its disk (and the model on it); the GPU is no longer paid for."""
        ...

    async def resume(self, instance_id: str, num_gpus: int) -> None:
        """Start a stopped instance again on its machine (``num_gpus``: the GPUs it had)."""
        ...

    async def destroy(self, instance_id: str) -> None:
        ...

    async def list_own(self, port: int) -> list[Instance]:
        """Every instance of the account labelled kiloline:<pool>."""
        ...

    async def close(self) -> None:
        ...
