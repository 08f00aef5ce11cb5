"""`kilolined fakegpu --kind generic`: POST /generate (JSON or a stream of steps), GET /health,
GET /blob (N bytes, streamed)."""

from __future__ import annotations

import json

from aiohttp import web

from kilolined.fakegpu.base import BLOB_CHUNK, BLOB_PATTERN, Job, is_int, is_number, read_json, sse_headers
from kilolined.fakegpu.card import Backend


class GenericBackend(Backend):
    """`--kind generic`: POST /generate, GET /health, GET /blob."""

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/generate", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/blob", self.blob)

    async def health(self, request: web.Request) -> web.Response:
        return await self.gpu.health(request, lambda: web.json_response({"status": "ok"}))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        gpu = self.gpu
        gated = await gpu.gate(request)
        if gated is not None:
            return gated
        try:
            body = await read_json(request)
        except ValueError:
            return self.error_response(400, "body is not valid JSON")
        body = {} if body is None else body
        if not isinstance(body, dict):
            return self.error_response(400, "body must be a JSON object")
        steps, step_ms = body.get("steps", gpu.steps), body.get("step_ms", gpu.step_ms)
        if not (is_int(steps) and steps >= 0 and is_number(step_ms) and step_ms >= 0):
            return self.error_response(400, "steps must be an int >= 0 and step_ms a number >= 0")
        vram = body.get("vram_gb")
        job = gpu.begin_job(float(vram) if is_number(vram) and vram >= 0 else None)
        outcome: str | None = None
        try:
            if body.get("stream") is True:
                resp, delivered = await self._stream(request, job, steps, step_ms / 1000)
            else:
                for _ in range(steps):
                    if not await gpu.work(job, step_ms / 1000):
                        break
                if job.failed:
                    resp = self.error_response(500, gpu.oom_message())
                else:
                    answer = {"ok": True, "steps": steps, "echo": body.get("echo"), "node": str(gpu.port)}
                    resp = web.json_response(answer)
                delivered = await gpu.respond(request, resp)
            outcome = "ok" if delivered else None
            return resp
        finally:
            gpu.end_job(job, outcome)

    async def _stream(
        self, request: web.Request, job: Job, steps: int, step_sec: float
    ) -> tuple[web.StreamResponse, bool]:
        gpu = self.gpu
        if job.failed:  # OOM at admission: nothing was streamed yet, so a plain 500
            resp: web.StreamResponse = self.error_response(500, gpu.oom_message())
            return resp, await gpu.respond(request, resp)
        resp = web.StreamResponse(headers=sse_headers())
        try:
            await resp.prepare(request)
            for step in range(1, steps + 1):
                if not await gpu.work(job, step_sec):
                    break
                await gpu.drip()
                await resp.write(f"data: {json.dumps({'step': step, 'total': steps})}\n\n".encode())
            if job.failed:
                await resp.write(f"data: {json.dumps({'error': gpu.oom_message()})}\n\n".encode())
            else:
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            return resp, False
        return resp, True

    async def blob(self, request: web.Request) -> web.StreamResponse:
        """N bytes of a fixed pattern, written in 64 KiB pieces, never held whole."""
        raw = request.query.get("bytes", "0")
        if not raw.isdigit():
            return self.error_response(400, "bytes must be a non-negative integer")
        left = int(raw)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        resp.content_length = left
        try:
            await resp.prepare(request)
            while left > 0 and request.method != "HEAD":  # HEAD: the length, never the bytes
                await self.gpu.drip()
                piece = BLOB_PATTERN[: min(left, BLOB_CHUNK)]
                await resp.write(piece)
                left -= len(piece)
            await resp.write_eof()
        except ConnectionResetError:
            pass
        return resp
