"""`kilolined check` for affinity (SPEC §13): the keys' file:line errors, and ``--probe`` comparing a
route's slots with llama.cpp's own (``GET /props`` ``total_slots``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from aiohttp import web

from kilolined.core.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k not in ("KILOLINE_CONFIG", "KILOLINE_ADMIN_KEY")}


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kilolined", "check", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)


def test_bad_affinity_keys_are_named_with_their_line(tmp_path: Path) -> None:
    f = tmp_path / "k.yaml"
    f.write_text("nodes: {gpu: {url: 'http://127.0.0.1:1'}}\n"
                 "routes:\n"
                 "  gen:\n"
                 "    path: /v1\n"
                 "    kind: openai\n"
                 "    nodes: [gpu]\n"
                 "    affinity: sticky\n"
                 "    affinity_block_bytes: 0\n")
    r = check("-c", str(f))
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"{f}:7: routes.gen.affinity: Input should be 'off', 'prefix' or 'session'"), lines
    want = f"{f}:8: routes.gen.affinity_block_bytes: Input should be greater than or equal to"
    assert lines[1].startswith(want), lines


def test_affinity_defaults_off_and_a_bare_yaml_off_is_off() -> None:
    base = "nodes: {gpu: {url: 'http://127.0.0.1:1'}}\nroutes:\n  gen: {path: /v1, kind: openai, nodes: [gpu]%s}\n"
    cfg = parse_config(base % "", env={})
    assert (cfg.routes["gen"].affinity, cfg.routes["gen"].affinity_block_bytes) == ("off", 256)
    assert parse_config(base % ", affinity: off", env={}).routes["gen"].affinity == "off"
    on = parse_config(base % ", affinity: prefix, affinity_block_bytes: 512", env={}).routes["gen"]
    assert (on.affinity, on.affinity_block_bytes) == ("prefix", 512)


def test_check_probe_warns_when_a_route_gives_a_node_more_slots_than_llama_cpp_has(tmp_path: Path) -> None:
    async def main() -> None:
        async def props(_r: web.Request) -> web.Response:
            return web.json_response({"total_slots": 2, "default_generation_settings": {"n_ctx": 4096}})

        async def root(_r: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_get("/props", props)
        app.router.add_get("/", root)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        f = tmp_path / "k.yaml"
        try:
            for slots, warned in ((2, False), (3, True)):
                f.write_text(f"nodes: {{llama: {{url: '{url}'}}}}\n"
                             "routes:\n"
                             f"  chat: {{path: /v1, kind: openai, nodes: [llama], max_concurrency: {slots}}}\n"
                             "  other: {path: /gen, nodes: [llama], max_concurrency: 5}\n")
                p = await asyncio.create_subprocess_exec(sys.executable, "-m", "kilolined", "check", "--probe", "-c",
                                                         str(f), cwd=ROOT, env=ENV, stdout=subprocess.PIPE)
                out, _ = await asyncio.wait_for(p.communicate(), 30)
                lines = out.decode().splitlines()
                assert p.returncode == 0, lines  # a warning: the config is still valid
                warnings = [ln for ln in lines if ln.startswith("warning: node llama:")]
                if warned:
                    assert len(warnings) == 1, lines
                    assert "3 requests at once (chat: 3)" in warnings[0] and "has 2 slots" in warnings[0]
                else:
                    assert warnings == [], lines
        finally:
            await runner.cleanup()

    asyncio.run(main())
