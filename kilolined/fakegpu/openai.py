"""`--kind openai` of the simulated GPU: an OpenAI-compatible chat server.

Each completion token costs one `step_ms` of GPU time, so a stream shows real pacing and a
gateway can measure time-to-first-token; usage numbers are exact so token budgets can be tested.
It behaves like the servers a gateway really meets: every API path is under `/v1` (vLLM serves
no `/chat/completions` without it), `usage` is streamed only when `stream_options.include_usage`
asks for it (one extra chunk with empty `choices`, as OpenAI and vLLM do), and it answers as
llama.cpp's `llama-server` does when started with `--api-key` (401 "Invalid API Key", the health
and model list stay public) or given a prompt as long as its context (400
`exceed_context_size_error` with `n_prompt_tokens` and `n_ctx`, streaming or not).

With `models` it is a multi-model server as llama-swap and Ollama are: it holds `warm_models` of
them loaded (the first at start), a request for another one waits `swap_ms` before its first byte
while that model replaces the least recently used, and `GET /running` answers as llama-swap's
does. A model it does not list is a 404, as Ollama answers.

It also serves Anthropic's `POST /v1/messages` as llama-server does (shapes in `anthropic.py`),
with the same GPU work, cache and usage as a chat completion, and OpenAI's
`POST /v1/audio/transcriptions` (a multipart form with `file` and `model`) as vLLM does.

It answers greedily, as a server with temperature 0 does: its model writes `WORDS` in turn, and
the next word depends only on how many words the answer already holds, so an answer cut after k
words and continued from them is the uninterrupted answer. It continues a final assistant message
as llama.cpp and vLLM do (`continue_final_message: true, add_generation_prompt: false`, only the
new text streamed; the two both true is a 400) and, like llama.cpp, also without them, when its
first delta repeats the whole prefix. `POST /v1/completions` continues its prompt the same way
(the prompt's words count) and writes 16 tokens unless `max_tokens` says otherwise, as OpenAI's
legacy API does.

It caches prompts as llama.cpp does (`prompt_cache.py`): the part of a prompt it has not seen
costs `prefill_ms_per_1k` of GPU time per 1000 tokens before the first token, and every answer
reports what was reused as llama-server reports it: `usage.prompt_tokens_details.cached_tokens`
and a `timings` object (`cache_n`, `prompt_n`, `prompt_ms`, …, `predicted_per_second`) at the top
level of a completion, on the last chunk of a stream (the usage chunk when there is one, else the
finish chunk). A crash empties the cache; a swapped-out model loses its entries.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from kilolined.fakegpu import anthropic
from kilolined.fakegpu.base import is_int, read_json, sse_headers
from kilolined.fakegpu.card import Backend, Card
from kilolined.fakegpu.prompt_cache import Hit, PromptCache, message_tokens, prompt_tokens

if TYPE_CHECKING:
    from kilolined.fakegpu.base import Job

MODEL_ID = "fake-llm"
KV_GB_PER_TOKEN = 0.00032  # capacity_mode="request": Llama-3.3-70B's ~320 KB of KV cache per token
WORDS = ("The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".")
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "unavailable_error",
}
# llama.cpp answers these without a key even when it was started with --api-key.
# vLLM serves /metrics outside its --api-key too.
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/running", "/metrics"})


def openai_error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = ERROR_TYPES.get(status, "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return web.json_response(body, status=status)


def llama_error(status: int, message: str, kind: str, **extra: Any) -> web.Response:
    """llama.cpp's error body: an integer `code`, no `param`; extra fields after `type`."""
    return web.json_response({"error": {"code": status, "message": message, "type": kind, **extra}}, status=status)


def context_exceeded(n_prompt_tokens: int, n_ctx: int) -> web.Response:
    """What llama-server answers when the prompt alone fills the slot's context (HTTP 400)."""
    message = (f"request ({n_prompt_tokens} tokens) exceeds the available context size ({n_ctx} tokens), "
               "try increasing it")
    return llama_error(400, message, "exceed_context_size_error", n_prompt_tokens=n_prompt_tokens, n_ctx=n_ctx)


def presented_key(request: web.Request) -> str | None:
    """The key in `Authorization: Bearer …` or `X-Api-Key`, as llama-server reads them."""
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer "):]
    return request.headers.get("X-Api-Key")


COMPLETION_TOKENS = 16  # what OpenAI's legacy completions write without max_tokens
# The fake's words, as it counts them to know where an answer stands: a word with the blanks
# before it, or one mark.
_WORD = re.compile(r"\s*\w+|\s*[^\w\s]")


def reply_text(tokens: int, start: int = 0) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(start, start + tokens))


def words_in(text: str) -> int:
    """How many of the fake's words ``text`` holds: where an answer that begins with it stands."""
    return len(_WORD.findall(text))


def continued(body: dict[str, Any], messages: list[Any]) -> tuple[str | None, bool] | web.Response:
    """The final assistant message to continue (None: a new answer) and whether the first delta
    repeats it; or llama.cpp's 400 for a body it refuses."""
    flag = body.get("continue_final_message") is True
    if flag and body.get("add_generation_prompt", True) is True:
        return openai_error(400, "Cannot set both add_generation_prompt and continue_final_message to true.")
    last = messages[-1] if isinstance(messages[-1], dict) else {}
    if last.get("role") != "assistant":
        return None, False
    if last.get("tool_calls"):
        return openai_error(400, "Cannot continue an assistant message that contains tool calls.")
    if not flag and len(messages) >= 2 and isinstance(messages[-2], dict) and messages[-2].get("role") == "assistant":
        return openai_error(400, "Cannot have 2 or more assistant messages at the end of the list.")
    content = last.get("content")
    # llama.cpp prefills a trailing assistant message even when not asked to; only the flag keeps
    # its first delta from repeating it.
    return (content if isinstance(content, str) else ""), not flag


class OpenAIBackend(Backend):
    def __init__(self, gpu: Card) -> None:
        super().__init__(gpu)
        models = gpu.models or []
        self.warm: list[str] = models[:1]  # loaded, least recently used first
        self.loading: set[str] = set()
        self.swaps = 0
        self.asked: list[str] = []  # the model of each completion, in the order they came (tests read it)
        self.bodies: list[dict[str, Any]] = []  # each chat completion's body as it came (tests read it)
        self._swap_lock = asyncio.Lock()  # one model loads at a time, as on one card
        self.prompt_cache = PromptCache(gpu.prompt_cache_tokens)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/audio/transcriptions", self.transcribe)
        app.router.add_get("/running", self.running)
        if self.gpu.server == "vllm":
            app.router.add_get("/metrics", self.metrics)  # and no /slots: vLLM has none
        else:
            app.router.add_get("/slots", self.slots)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/health", self.health)

    def error_response(self, status: int, message: str) -> web.Response:
        return openai_error(status, message)

    def extra_stats(self) -> dict[str, Any]:
        cache = {"prompt_cache_entries": len(self.prompt_cache), "prompt_cache_tokens": self.prompt_cache.tokens}
        return {"swaps": self.swaps, "warm": list(self.warm), **cache} if self.gpu.models else {"swaps": 0, **cache}

    async def on_down(self) -> None:
        self.prompt_cache.forget()  # the KV cache lived in the process that died

    async def running(self, request: web.Request) -> web.Response:
        """llama-swap's `GET /running`: every process not stopped, sorted by model id."""
        states = {m: "ready" for m in self.warm} | {m: "starting" for m in self.loading}
        entries = [{"model": m, "state": st, "cmd": "", "proxy": "", "ttl": 0, "name": "", "description": ""}
                   for m, st in sorted(states.items())]
        return web.json_response({"running": entries})

    async def slots(self, request: web.Request) -> web.Response:
        """llama.cpp's `GET /slots` (behind its --api-key, as there): one entry per slot (`-np`,
        here `parallel`; as many as run when it is 0), `is_processing` on those that run a task."""
        running = self.gpu.stats["running"]
        n = max(self.gpu.parallel, running, 1)
        return web.json_response([
            {"id": i, "id_task": i if i < running else -1, "n_ctx": self.gpu.ctx_size, "speculative": False,
             "is_processing": i < running}
            for i in range(n)])

    async def metrics(self, request: web.Request) -> web.Response:
        """vLLM's `GET /metrics`, the scheduler gauges as its v1 engine registers them (Prometheus
        client, labels model_name and engine; vllm/v1/metrics/loggers.py PrometheusStatLogger):
        the requests running, and those waiting (none here: the card runs every request at once)."""
        registry = CollectorRegistry()
        labels = ("model_name", "engine")
        running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
                        registry=registry, multiprocess_mode="mostrecent")
        waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                        registry=registry, multiprocess_mode="mostrecent")
        model = (self.gpu.models or [MODEL_ID])[0]
        running.labels(model, "0").set(self.gpu.stats["running"])
        waiting.labels(model, "0").set(0)
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def load(self, model: str) -> bool:
        """Make `model` warm; returns whether that was a swap (it took `swap_ms`)."""
        async with self._swap_lock:
            if model in self.warm:
                self.warm.remove(model)
                self.warm.append(model)
                return False
            self.loading.add(model)
            try:
                await asyncio.sleep(self.gpu.swap_ms / 1000)
            finally:
                self.loading.discard(model)
            loaded = [*self.warm, model]
            self.warm = loaded[-self.gpu.warm_models:]
            for unloaded in loaded[:-self.gpu.warm_models]:
                self.prompt_cache.forget(unloaded)
            self.swaps += 1
            return True

    def screen(self, request: web.Request) -> web.Response | None:
        key = self.gpu.api_key
        if key is None or request.path in PUBLIC_PATHS or request.method == "OPTIONS":
            return None
        if presented_key(request) == key:
            return None
        self.gpu.count("auth_rejects")
        return llama_error(401, "Invalid API Key", "authentication_error")

    @property
    def model_ids(self) -> list[str]:
        return self.gpu.models or [MODEL_ID]

    def _model_card(self, model_id: str = MODEL_ID) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": self.gpu.started_at, "owned_by": "kiloline"}

    async def health(self, request: web.Request) -> web.Response:
        return await self.gpu.health(request, lambda: web.json_response({"status": "ok"}))

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card(m) for m in self.model_ids]})

    async def model(self, request: web.Request) -> web.Response:
        """`GET /v1/models/{id}` (the SDK's `models.retrieve`); answered at once, no GPU work."""
        model_id = request.match_info["model_id"]
        if model_id not in self.model_ids:
            return openai_error(404, f"The model '{model_id}' does not exist", "model")
        return web.json_response(self._model_card(model_id))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        gpu = self.gpu
        gated = await gpu.gate(request)
        if gated is not None:
            return gated
        try:
            body = await read_json(request)
        except ValueError:
            return openai_error(400, "We could not parse the JSON body of your request.")
        if not isinstance(body, dict):
            return openai_error(400, "The request body must be a JSON object.")
        self.bodies.append(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return openai_error(400, "'messages' is a required property and must be a non-empty array.",
                                "messages")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and not (is_int(max_tokens) and max_tokens >= 1):
            return openai_error(400, "max_tokens must be an integer >= 1.", "max_tokens")
        cont = continued(body, messages)
        if isinstance(cont, web.Response):
            return cont
        prefix, echo = cont
        start = words_in(prefix) if prefix is not None else 0
        tokens = prompt_tokens(messages)
        if len(tokens) >= gpu.ctx_size:  # llama.cpp compares the prompt alone, `>=`
            return context_exceeded(len(tokens), gpu.ctx_size)
        if gpu.models:
            model = body.get("model")
            if not isinstance(model, str) or model not in gpu.models:
                return openai_error(404, f"model '{model}' not found", "model")
            self.asked.append(model)
            await self.load(model)  # before the first byte, as llama-swap starts the model's server
        stream_options = body.get("stream_options")
        call = _Call(
            id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
            model=body["model"] if isinstance(body.get("model"), str) else MODEL_ID,
            # Without max_tokens the answer ends on its own after `steps` words, however many of
            # them a continued message already held.
            tokens=max_tokens if max_tokens is not None else max(0, gpu.steps - start),
            prompt_tokens=len(tokens), start=start, echo=prefix if echo and prefix else "",
            # Hitting max_tokens is what "length" means; without it the fake stops on its own.
            finish_reason="length" if max_tokens is not None else "stop",
            include_usage=isinstance(stream_options, dict) and stream_options.get("include_usage") is True,
            prefill_ms_per_1k=gpu.prefill_ms_per_1k,
        )
        job = gpu.begin_job(KV_GB_PER_TOKEN * (len(tokens) + call.tokens))
        # One model per process unless it swaps: llama-server ignores the request's `model`.
        cache_model = call.model if gpu.models else MODEL_ID
        hit = self.prompt_cache.lookup(cache_model, tokens)
        call.cache_n = hit.cached
        outcome: str | None = None
        try:
            await self._prefill(job, call)
            if body.get("stream") is True:
                resp, delivered = await self._stream(request, job, call)
            else:
                for _ in range(call.tokens):
                    if not await gpu.work(job, gpu.step_ms / 1000):
                        break
                    call.generated += 1
                resp = openai_error(500, gpu.oom_message()) if job.failed else web.json_response(call.completion())
                delivered = await gpu.respond(request, resp)
            outcome = "ok" if delivered else None
            return resp
        finally:
            gpu.end_job(job, outcome)
            self._keep(cache_model, call, tokens, hit)

    async def complete(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's legacy `POST /v1/completions` (llama.cpp and vLLM serve it): the prompt goes on,
        from as many words as it holds."""
        gpu = self.gpu
        gated = await gpu.gate(request)
        if gated is not None:
            return gated
        try:
            body = await read_json(request)
        except ValueError:
            return openai_error(400, "We could not parse the JSON body of your request.")
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(body, dict) or not isinstance(prompt, str):
            return openai_error(400, "'prompt' must be a string.", "prompt")
        max_tokens = body.get("max_tokens", COMPLETION_TOKENS)
        if not (is_int(max_tokens) and max_tokens >= 1):
            return openai_error(400, "max_tokens must be an integer >= 1.", "max_tokens")
        tokens = message_tokens("", prompt)
        if len(tokens) >= gpu.ctx_size:
            return context_exceeded(len(tokens), gpu.ctx_size)
        stream_options = body.get("stream_options")
        call = _Call(id=f"cmpl-{uuid.uuid4().hex[:24]}",
                     model=body["model"] if isinstance(body.get("model"), str) else MODEL_ID,
                     tokens=max_tokens, prompt_tokens=len(tokens), finish_reason="length",
                     include_usage=isinstance(stream_options, dict) and stream_options.get("include_usage") is True,
                     prefill_ms_per_1k=gpu.prefill_ms_per_1k, start=words_in(prompt), legacy=True)
        job = gpu.begin_job(KV_GB_PER_TOKEN * (len(tokens) + call.tokens))
        hit = self.prompt_cache.lookup(MODEL_ID, tokens)
        call.cache_n = hit.cached
        outcome: str | None = None
        try:
            await self._prefill(job, call)
            if body.get("stream") is True:
                resp, delivered = await self._stream(request, job, call)
            else:
                for _ in range(call.tokens):
                    if not await gpu.work(job, gpu.step_ms / 1000):
                        break
                    call.generated += 1
                resp = openai_error(500, gpu.oom_message()) if job.failed else web.json_response(call.completion())
                delivered = await gpu.respond(request, resp)
            outcome = "ok" if delivered else None
            return resp
        finally:
            gpu.end_job(job, outcome)
            self.prompt_cache.release(hit)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's `POST /v1/messages` as llama-server answers it (fakegpu/anthropic.py): the
        same GPU work as a chat completion, in Anthropic's shapes."""
        gpu = self.gpu
        gated = await gpu.gate(request)
        if gated is not None:
            return gated
        try:
            body = await read_json(request)
        except ValueError:
            return llama_error(400, "Failed to parse the JSON body of the request", "invalid_request_error")
        chat = anthropic.chat_messages(body) if isinstance(body, dict) else None
        if not isinstance(body, dict) or chat is None:
            return llama_error(400, "'messages' is required and must be a non-empty array", "invalid_request_error")
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and not (is_int(max_tokens) and max_tokens >= 1):
            return llama_error(400, "max_tokens must be an integer >= 1", "invalid_request_error")
        tokens = prompt_tokens(chat)
        if len(tokens) >= gpu.ctx_size:
            return context_exceeded(len(tokens), gpu.ctx_size)
        call = _Call(id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
                     model=body["model"] if isinstance(body.get("model"), str) else MODEL_ID,
                     tokens=max_tokens if max_tokens is not None else gpu.steps, prompt_tokens=len(tokens),
                     finish_reason="length" if max_tokens is not None else "stop", include_usage=False,
                     prefill_ms_per_1k=gpu.prefill_ms_per_1k)
        last = chat[-1] if isinstance(chat[-1], dict) else {}
        if last.get("role") == "assistant" and isinstance(last.get("content"), str):
            # A final assistant message is prefilled: the answer goes on from it, and the first
            # delta repeats it before the new word (llama-server's Messages endpoint does).
            call.echo, call.start = last["content"], words_in(last["content"])
        job = gpu.begin_job(KV_GB_PER_TOKEN * (len(tokens) + call.tokens))
        hit = self.prompt_cache.lookup(MODEL_ID, tokens)
        call.cache_n = hit.cached
        outcome: str | None = None
        try:
            await self._prefill(job, call)
            if body.get("stream") is True:
                resp, delivered = await self._stream_messages(request, job, call)
            else:
                for _ in range(call.tokens):
                    if not await gpu.work(job, gpu.step_ms / 1000):
                        break
                    call.generated += 1
                resp = (llama_error(500, gpu.oom_message(), "server_error") if job.failed else
                        web.json_response(anthropic.message(call.id, call.model,
                                                            call.echo + reply_text(call.generated, call.start),
                                                            call.finish_reason, call.prompt_tokens, call.generated)))
                delivered = await gpu.respond(request, resp)
            outcome = "ok" if delivered else None
            return resp
        finally:
            gpu.end_job(job, outcome)
            self._keep(MODEL_ID, call, tokens, hit)

    async def transcribe(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's `POST /v1/audio/transcriptions` as vLLM serves it: a multipart form with `file`
        and `model` (required); `{"text"}` after `steps` steps of GPU work."""
        gpu = self.gpu
        gated = await gpu.gate(request)
        if gated is not None:
            return gated
        form = await request.post()
        model, audio = form.get("model"), form.get("file")
        if not isinstance(model, str) or audio is None:
            return openai_error(400, "a multipart form with 'file' and 'model' is required", "model")
        if gpu.models:
            if model not in gpu.models:
                return openai_error(404, f"model '{model}' not found", "model")
            await self.load(model)
        self.asked.append(model)
        job = gpu.begin_job()
        outcome: str | None = None
        try:
            for _ in range(gpu.steps):
                if not await gpu.work(job, gpu.step_ms / 1000):
                    break
            resp = openai_error(500, gpu.oom_message()) if job.failed else web.json_response({"text": reply_text(3)})
            outcome = "ok" if await gpu.respond(request, resp) else None
            return resp
        finally:
            gpu.end_job(job, outcome)

    async def _stream_messages(self, request: web.Request, job: Job, call: _Call) -> tuple[web.StreamResponse, bool]:
        gpu = self.gpu
        if job.failed:
            resp: web.StreamResponse = llama_error(500, gpu.oom_message(), "server_error")
            return resp, await gpu.respond(request, resp)
        resp = web.StreamResponse(headers=sse_headers())
        try:
            await resp.prepare(request)
            for index in range(call.tokens):
                if not await gpu.work(job, gpu.step_ms / 1000):
                    break
                call.generated += 1
                await gpu.drip()
                first = anthropic.first_events(call.id, call.model, call.prompt_tokens) if index == 0 else b""
                word = WORDS[(call.start + index) % len(WORDS)]
                await resp.write(first + anthropic.text_delta(call.echo + word if index == 0 else word))
            if job.failed:
                await resp.write(anthropic.error_event(gpu.oom_message()))
            else:
                await resp.write(anthropic.last_events(call.finish_reason, call.generated, call.generated > 0))
            await resp.write_eof()
        except ConnectionResetError:
            return resp, False
        return resp, True

    async def _prefill(self, job: Job, call: _Call) -> None:
        """Spend the GPU time of the prompt's uncached tokens, before the first token."""
        seconds = call.prompt_ms / 1000
        if seconds > 0 and not await self.gpu.work(job, seconds):
            return
        call.prefilled = True
        call.gen_started = time.monotonic()

    def _keep(self, model: str, call: _Call, tokens: list[str], hit: Hit) -> None:
        """What the slot now holds goes to the cache: the prompt and the reply so far, once prefilled."""
        if not call.prefilled:
            self.prompt_cache.release(hit)
            return
        said = message_tokens("assistant", reply_text(call.generated, call.start))
        self.prompt_cache.save(model, tokens + said, hit)

    async def _stream(self, request: web.Request, job: Job, call: _Call) -> tuple[web.StreamResponse, bool]:
        gpu = self.gpu
        if job.failed:  # OOM before the first token: a plain 500, as vLLM does
            resp: web.StreamResponse = openai_error(500, gpu.oom_message())
            return resp, await gpu.respond(request, resp)
        resp = web.StreamResponse(headers=sse_headers())

        async def send(payload: Any) -> None:
            await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

        try:
            await resp.prepare(request)
            for index in range(call.tokens):
                if not await gpu.work(job, gpu.step_ms / 1000):
                    break
                call.generated += 1
                await gpu.drip()
                await send(call.piece(index))
            if job.failed:
                # vLLM reports a mid-stream failure as an error object in a data line.
                await send({"error": {"message": gpu.oom_message(), "type": "server_error", "param": None,
                                      "code": None}})
            else:
                # llama.cpp puts `timings` on the last chunk only: the usage chunk when asked for.
                timings = {"timings": call.timings()}
                await send({**call.last(), **({} if call.include_usage else timings)})
                if call.include_usage:
                    await send({**call.base(call.chunk_object), "choices": [], "usage": call.usage(), **timings})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            return resp, False
        return resp, True


@dataclass
class _Call:
    """One chat completion's identity and numbers, shared by its chunks."""

    id: str
    model: str
    tokens: int
    prompt_tokens: int
    finish_reason: str
    include_usage: bool
    prefill_ms_per_1k: float = 0.0
    start: int = 0  # words the answer already held (a continued message, a completion's prompt)
    echo: str = ""  # what the first delta repeats (llama.cpp's prefill without continue_final_message)
    legacy: bool = False  # a legacy completion (`text` choices), not a chat
    cache_n: int = 0  # prompt tokens reused from the prompt cache
    generated: int = 0  # completion tokens made so far
    prefilled: bool = False
    gen_started: float = 0.0  # monotonic time the prefill ended
    created: int = field(default_factory=lambda: int(time.time()))

    def base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @property
    def prompt_n(self) -> int:
        return self.prompt_tokens - self.cache_n

    @property
    def prompt_ms(self) -> float:
        """The modelled prefill time (what the card spends on it, not wall time: it is exact)."""
        return self.prompt_n * self.prefill_ms_per_1k / 1000

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens,
                "prompt_tokens_details": {"cached_tokens": self.cache_n}}

    def timings(self) -> dict[str, float | int]:
        """llama-server's `timings`, same names and order; decode speeds count `predicted_n - 1`
        steps as it does (the first token comes with the prompt's last batch)."""
        prompt_ms = round(self.prompt_ms, 3)
        predicted_ms = round((time.monotonic() - self.gen_started) * 1000, 3) if self.generated else 0.0
        steps = max(self.generated - 1, 0)
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": round(prompt_ms / self.prompt_n, 6) if self.prompt_n else 0.0,
            "prompt_per_second": round(1000 * self.prompt_n / prompt_ms, 3) if prompt_ms > 0 else 0.0,
            "predicted_n": self.generated,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": round(predicted_ms / steps, 6) if steps else 0.0,
            "predicted_per_second": round(1000 * steps / predicted_ms, 3) if steps and predicted_ms > 0 else 0.0,
        }

    @property
    def chunk_object(self) -> str:
        return "text_completion" if self.legacy else "chat.completion.chunk"

    def chunk(self, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        if self.legacy:
            choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        out = {**self.base(self.chunk_object), "choices": [choice]}
        if self.include_usage:  # the spec: every other chunk carries "usage": null
            out["usage"] = None
        return out

    def piece(self, index: int) -> dict[str, Any]:
        """The chunk of the ``index``-th word this call writes."""
        delta = {"content": WORDS[(self.start + index) % len(WORDS)]}
        if index == 0:
            delta = {"role": "assistant", "content": self.echo + delta["content"]}
        return self.chunk(delta, None)

    def last(self) -> dict[str, Any]:
        return self.chunk({}, self.finish_reason)

    def completion(self) -> dict[str, Any]:
        text = reply_text(self.tokens, self.start)
        if self.legacy:
            choice = {"index": 0, "text": text, "finish_reason": self.finish_reason, "logprobs": None}
            return {**self.base("text_completion"), "choices": [choice], "usage": self.usage()}
        choice = {"index": 0, "message": {"role": "assistant", "content": self.echo + text},
                  "finish_reason": self.finish_reason, "logprobs": None}
        return {**self.base("chat.completion"), "choices": [choice], "usage": self.usage(),
                "timings": self.timings()}
