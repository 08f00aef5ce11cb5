"""A short chaos smoke (~20 s of chaos, < 60 s in all): the core of scripts/chaos.py run against an
in-process gateway, two in-process fake GPUs (primary + standby) and a fake Telegram.

While sync / sse / async traffic runs, nodes are killed and revived, hang, drip, answer 500/503
storms; the notifier goes down; the config is reloaded (valid and invalid); clients hang up.
Then: every request accounted for, no slot leaked, and the process's asyncio tasks and file
descriptors back to their baseline (idle keep-alive sockets to the nodes and the notifier, and
the server tasks that serve them, are reported but not compared; see scripts/chaos.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from pathlib import Path

import yaml

from kilolined.core.config import parse_config
from kilolined.edge.server import Server
from kilolined.fakegpu import FakeGPU

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import benchlib as bl
import chaos

CHAOS_SECONDS = 20


def _tasks() -> list[str]:
    """asyncio tasks other than the per-connection server handlers (those follow the sockets),
    by their coroutine's name."""
    names = (getattr(t.get_coro(), "__qualname__", "?") for t in asyncio.all_tasks())
    return sorted(n for n in names if n != "RequestHandler.start")


async def test_chaos_smoke(tmp_path: Path) -> None:
    gpus = {n: FakeGPU("generic", steps=2, step_ms=20, vram_gb=1e6, job_vram_gb=0, crash_sec=0.5) for n in "ab"}
    tg = chaos.FakeTelegram()
    srv: Server | None = None
    try:
        for g in gpus.values():
            await g.start()
        await tg.start()
        port = bl.free_port()
        env = chaos.ChaosEnv(
            base=f"http://127.0.0.1:{port}", config_path=tmp_path / "kiloline.yaml", listen=f"127.0.0.1:{port}",
            nodes={n: chaos.InprocNode(n, g) for n, g in gpus.items()}, telegram=tg, resources=dict,
            request_timeout=2.0, queue_timeout=5.0,
        )
        text = yaml.safe_dump(chaos.chaos_config(env))
        env.config_path.write_text(text)
        srv = Server(parse_config(text, env={}), hashlib.sha256(text.encode()).hexdigest(), str(env.config_path),
                     watch=False)
        await srv.start()
        pool_ports = {g.port for g in gpus.values()} | {tg.port}
        server = srv

        seen: list[list[str]] = []  # the tasks of each reading, to name the difference when one stays

        def resources() -> dict[str, int]:
            conns = server.runner.server.connections if server.runner and server.runner.server else []
            seen.append(_tasks())
            return {**bl.fd_breakdown("self", pool_ports), "tasks": len(seen[-1]), "gateway_conns": len(conns)}

        env.resources = resources
        report = await chaos.run_chaos(env, CHAOS_SECONDS, seed=7, workers=10)
        chaos.print_report(report)
        assert not report.violations, "\n".join(report.violations[:20])
        assert report.ok, "; ".join(report.problems) + f"; tasks first {seen[0]}, last {seen[-1]}"
        assert report.total > 50, f"too little traffic to mean anything: {report.total}"
        assert report.actions.get("kill", 0) + report.actions.get("hang", 0) > 0
        assert report.notifier_messages > 0, "the notifier never got through"
    finally:
        if srv is not None:
            await srv.shutdown()
        for g in gpus.values():
            await g.stop()
        await tg.stop()
