"""One adapter per route kind; adapters hold no state, so one instance each serves every request."""

from __future__ import annotations

from kilolined.adapters.base import Adapter
from kilolined.adapters.comfyui import ComfyUIAdapter
from kilolined.adapters.generic import GenericAdapter
from kilolined.adapters.openai import OpenAIAdapter

_BY_KIND: dict[str, type[Adapter]] = {"generic": GenericAdapter, "comfyui": ComfyUIAdapter, "openai": OpenAIAdapter}


def adapter_for(kind: str) -> Adapter:
    return _BY_KIND.get(kind, GenericAdapter)()
