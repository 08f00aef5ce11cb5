"""The Anthropic Messages API (`POST /v1/messages`) of the simulated LLM server, as llama.cpp's
`llama-server` serves it (its tools/server/server-task.cpp: `to_json_anthropic`, the partial
result's `to_json_anthropic` and the final one's `to_json_anthropic_stream`; server-common.cpp:
`format_anthropic_sse`).

- A request's `system` (a string or a list of text blocks) becomes the first message of the chat,
  as llama.cpp's conversion to its chat template does; `messages` follow.
- The answer: `{"id", "type": "message", "role": "assistant", "content": [{"type": "text",
  "text"}], "model", "stop_reason", "stop_sequence": null, "usage": {"input_tokens",
  "output_tokens"}}`; `stop_reason` is `max_tokens` when the limit was reached, else `end_turn`.
- A stream is `event: <type>` / `data: <json>` pairs: `message_start` (its message's usage has
  `input_tokens` and `output_tokens: 0`) with the first token, `content_block_start` (index 0,
  an empty text block), one `content_block_delta` (`text_delta`) per token, then
  `content_block_stop`, `message_delta` (`stop_reason`, and `usage: {"output_tokens"}`) and
  `message_stop`. No `[DONE]`.
- A final assistant message is prefilled: the answer goes on from its text, and the first delta
  (and a whole answer's text) repeats it, as llama-server's does with or without
  `continue_final_message`.
- Errors before the stream are llama.cpp's own body (`{"error": {"code", "message", "type"}}`, not
  Anthropic's shape); one mid-stream is `event: error` with that same error object as its data.

Pure shapes; `openai.py`'s backend drives them.
"""

from __future__ import annotations

from typing import Any

import orjson


def chat_messages(body: dict[str, Any]) -> list[Any] | None:
    """The request as the chat the model sees: `system` first, then `messages`; None when
    `messages` is not a non-empty list."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    system = body.get("system")
    if isinstance(system, str | list) and system:
        return [{"role": "system", "content": system}, *messages]
    return list(messages)


def stop_reason(finish_reason: str) -> str:
    return "max_tokens" if finish_reason == "length" else "end_turn"


def message(msg_id: str, model: str, text: str, finish_reason: str, input_tokens: int,
            output_tokens: int) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "content": [{"type": "text", "text": text}],
            "model": model, "stop_reason": stop_reason(finish_reason), "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as llama.cpp's `format_anthropic_sse` writes it."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def first_events(msg_id: str, model: str, input_tokens: int) -> bytes:
    """What comes with the first token: the message's start and its text block's."""
    start: dict[str, Any] = {"id": msg_id, "type": "message", "role": "assistant", "content": [], "model": model,
             "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
    return (event("message_start", {"type": "message_start", "message": start})
            + event("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}}))


def text_delta(text: str) -> bytes:
    return event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": text}})


def last_events(finish_reason: str, output_tokens: int, text_started: bool) -> bytes:
    stop = event("content_block_stop", {"type": "content_block_stop", "index": 0}) if text_started else b""
    delta = {"type": "message_delta", "delta": {"stop_reason": stop_reason(finish_reason), "stop_sequence": None},
             "usage": {"output_tokens": output_tokens}}
    return stop + event("message_delta", delta) + event("message_stop", {"type": "message_stop"})


def error_event(message_text: str) -> bytes:
    """A failure after the stream began: llama.cpp's error object under `event: error`."""
    return event("error", {"code": 500, "message": message_text, "type": "server_error"})
