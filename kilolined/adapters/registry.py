"""One adapter per route kind; adapters hold no state, so one instance each serves every request."""

from __future__ import annotations

from kilolined.adapters.anthropic import MessagesAdapter
from kilolined.adapters.base import Adapter
from kilolined.adapters.comfyui import ComfyUIAdapter
from kilolined.adapters.generic import GenericAdapter
from kilolined.adapters.openai import OpenAIAdapter
from kilolined.scheduling.anthropic_body import is_anthropic_path

_BY_KIND: dict[str, type[Adapter]] = {"generic": GenericAdapter, "comfyui": ComfyUIAdapter, "openai": OpenAIAdapter}


def adapter_for(kind: str, path: str = "/") -> Adapter:
    """The adapter of a route kind; on an ``openai`` route, Anthropic's API (``path``, the node
    path without query) has its own."""
    if kind == "openai" and is_anthropic_path(path):
        return MessagesAdapter()
    return _BY_KIND.get(kind, GenericAdapter)()
