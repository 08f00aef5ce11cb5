"""What differs per backend kind (SPEC §5). ``generic`` is the identity; the others know their API.

An adapter may:
- ``prepare`` a request before it is queued (validate, rewrite; raise Rejected 400),
- ``observer`` the bytes of a sync response as they pass (usage, time to first token),
- ``sync_hold`` the slot after a sync response (ComfyUI answers /prompt at once but the GPU
  works on), returning a coroutine that finishes when the GPU work does,
- ``run_job`` an sse/async job to its end, emitting progress and returning the result.
"""

from __future__ import annotations

from kilolined.adapters.base import Adapter, Observer
from kilolined.adapters.generic import GenericAdapter


def adapter_for(kind: str) -> Adapter:
    if kind == "openai":
        from kilolined.adapters.openai import OpenAIAdapter

        return OpenAIAdapter()
    if kind == "comfyui":
        from kilolined.adapters.comfyui import ComfyUIAdapter

        return ComfyUIAdapter()
    return GenericAdapter()


__all__ = ["Adapter", "GenericAdapter", "Observer", "adapter_for"]
