"""An Anthropic Messages request (``POST /v1/messages``) as the scheduler reads it.

llama.cpp, vLLM and llama-swap serve Anthropic's Messages API beside OpenAI's on the same server,
so an ``openai`` route takes both. What the gateway reads of a request — the prompt's tokens for
a budget's reservation and the ``tokens`` cost unit, the text a prefix is indexed by — it reads
from one view: the request as the chat the model sees, ``system`` (a string or a list of text
blocks) as its first message, as those servers render it into the chat template.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Any


def is_messages_path(path: str) -> bool:
    """``path`` (no query) is the Messages endpoint of an OpenAI-compatible server: ``…/v1/messages``,
    or ``/messages`` on a route whose prefix ``/v1`` was cut off. Not OpenAI's Assistants
    ``/v1/threads/{id}/messages``."""
    return path.endswith("/v1/messages") or path == "/messages"


def is_anthropic_path(path: str) -> bool:
    """``path`` is one of Anthropic's API: the Messages endpoint or its ``/count_tokens``. A client
    there is an Anthropic client: the gateway's errors take Anthropic's shape."""
    return is_messages_path(path.removesuffix("/count_tokens"))


def chat_view(data: dict[str, Any]) -> dict[str, Any]:
    """The request as an OpenAI chat request: ``model``, ``tools``, ``max_tokens`` as they are,
    ``messages`` with ``system`` first. A shallow view: its values are the request's own."""
    view: dict[str, Any] = {k: data[k] for k in ("model", "tools", "max_tokens") if k in data}
    messages = data.get("messages")
    messages = messages if isinstance(messages, list) else []
    system = data.get("system")
    if isinstance(system, str | list) and system:
        messages = [{"role": "system", "content": system}, *messages]
    view["messages"] = messages
    return view
