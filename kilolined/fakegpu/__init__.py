"""`kilolined fakegpu`: a simulated GPU inference server for the demo, the tests and benchmarks.

`FakeGPU(kind, ...)` is the card of `card.py` with the API of one kind: `generic.py`,
`comfy.py` (ComfyUI 0.19 as measured on loopback) or `openai.py` (a `/v1`-only server with
llama.cpp's errors). This module only picks the kind; the kinds import the card, never this.
`provider.py` (with `provider_vastai.py`, `provider_runpod.py`) is a fake GPU market whose
instances are such cards (`kilolined fakegpu --provider`); it imports this module, never the reverse.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from kilolined.fakegpu.base import BLOB_CHUNK, BLOB_PATTERN, GIB, Job, serve_until_signal
from kilolined.fakegpu.card import Backend, Card
from kilolined.fakegpu.comfy import ComfyBackend
from kilolined.fakegpu.generic import GenericBackend
from kilolined.fakegpu.openai import OpenAIBackend

__all__ = ["BLOB_CHUNK", "BLOB_PATTERN", "GIB", "KINDS", "Backend", "FakeGPU", "Job", "run"]

BACKENDS: MappingProxyType[str, Callable[[Card], Backend]] = MappingProxyType(
    {"generic": GenericBackend, "comfyui": ComfyBackend, "openai": OpenAIBackend}
)
KINDS = tuple(BACKENDS)


class FakeGPU(Card):
    """One simulated card of the given kind (see `card.Card` for the options)."""

    def __init__(self, kind: str = "generic", **options: Any) -> None:
        if kind not in BACKENDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
        super().__init__(kind, BACKENDS[kind], **options)


def run(kind: str = "generic", **options: Any) -> int:
    """Serve until Ctrl-C or SIGTERM (for `kilolined fakegpu`); returns the exit code. ``options``
    are the card's (``card.Card``)."""
    try:
        gpu = FakeGPU(kind, **options)
    except ValueError as exc:
        print(f"fakegpu: {exc}", file=sys.stderr)
        return 2
    return serve_until_signal(gpu, f"fakegpu {gpu.kind}")
