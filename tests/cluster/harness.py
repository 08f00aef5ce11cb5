"""Real parts for the cluster tests (their fixtures are in conftest.py): a redis-server on a loopback
port (no persistence), a relay that cuts one gateway off it, gateway processes (``python -m kilolined
run``) in front of in-process fake GPUs, a Runtime whose leases live in Redis, and ``until``, the one
polling helper."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
import yaml
from conftest import ADMIN, ADMIN_KEY, KEYS, sha
from lease_props import config

from kilolined.cluster.leases import ClusterLeases
from kilolined.core.config import parse_config
from kilolined.ops.runtime import Runtime, Wiring


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; ``kill`` and ``start`` again on the same port (empty, as a
    Redis without persistence comes back)."""

    def __init__(self, tmp: Path, persistence: tuple[str, ...] = ("--save", "", "--appendonly", "no")):
        self.port = free_port()
        self.dir = tmp
        self.persistence = persistence  # `kilolined check` warns when a test turns it on
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", *self.persistence,
             "--dir", str(self.dir), "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (with requirepass: asks for it)
                        return
            except OSError:
                pass
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def freeze(self) -> None:
        """SIGSTOP: Redis keeps its sockets and its data but answers nothing (a stall)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def client(self) -> aioredis.Redis:
        return aioredis.from_url(self.url, decode_responses=True)


class Relay:
    """A TCP relay between one gateway and Redis: ``sever`` cuts that gateway alone off (its
    connections reset, new ones closed at once) while the others still reach Redis — a partial
    partition; ``heal`` lets it through again. Runs in the test's event loop."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = 0
        self.cut = False
        #: set: bytes are held until it is set again (a black hole, not a reset: SilentRelay)
        self.gate: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.sever()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def sever(self) -> None:
        self.cut = True
        for w in list(self._open):
            w.transport.abort()
        self._open.clear()

    def heal(self) -> None:
        self.cut = False

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._open |= {writer, up_w}
        try:
            await asyncio.gather(_pipe(reader, up_w, self.gate), _pipe(up_r, writer, self.gate))
        finally:
            self._open -= {writer, up_w}


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, gate: asyncio.Event | None = None) -> None:
    try:
        while data := await r.read(65536):
            if gate is not None:
                await gate.wait()
            w.write(data)
            await w.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        w.transport.abort()


async def until(pred: Callable[[], Awaitable[bool]], what: str, timeout: float = 20) -> None:
    """Poll an async condition until it holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def cluster_config(redis_url: str, gpu_url: str, port: int, gid: str, *, ttl: float = 2, prefix: str = "kl-test:",
                   **route: Any) -> dict[str, Any]:
    r = {"path": "/gen", "nodes": ["gpu"], "max_concurrency": 2, "queue_timeout_sec": 60,
         "request_timeout_sec": 30, "max_queue_depth": 10000}
    r.update(route)
    return {
        "server": {"listen": f"127.0.0.1:{port}", "heartbeat_sec": 1, "shutdown_grace_sec": 2, "access_log": False},
        "admin": {"key_sha256": sha(ADMIN_KEY)},
        "keys": {k: {"key_sha256": sha(v), "routes": ["*"]} for k, v in KEYS.items()},
        "nodes": {"gpu": {"url": gpu_url}},
        "routes": {"gen": r},
        "cluster": {"redis_url": redis_url, "gateway_id": gid, "lease_ttl_sec": ttl, "key_prefix": prefix},
    }


class GatewayProc:
    """One ``kilolined run`` process on its own loopback port."""

    def __init__(self, cfg: dict[str, Any], path: Path):
        self.cfg = cfg
        self.path = path
        self.port = int(cfg["server"]["listen"].rsplit(":", 1)[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = path.with_suffix(".log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.path.write_text(yaml.safe_dump(self.cfg))
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kilolined", "run", "-c", str(self.path)],
                                         stdout=log, stderr=log, env=env)

    async def ready(self, timeout: float = 60) -> None:
        # Generous: a loaded 2-core box starts a Python process slowly; a gateway that is up
        # answers at once, so this costs nothing when all is well.
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as s:
            while True:
                assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
                try:
                    async with s.get(self.url + "/healthz") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "gateway did not start:\n" + self.log.read_text()[-3000:]
                await asyncio.sleep(0.1)

    async def state(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/admin/state", headers=ADMIN) as r:
            assert r.status == 200
            return await r.json()

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def start_all(procs: list[GatewayProc]) -> None:
    """Start them and wait until each sees all the others (its split is right from then on)."""
    for p in procs:
        p.start()
    await asyncio.gather(*(p.ready() for p in procs))
    deadline = time.monotonic() + 30
    while True:
        states = await asyncio.gather(*(p.state() for p in procs))
        if all(len(st["cluster"]["peers"]) == len(procs) - 1 for st in states):
            return
        assert time.monotonic() < deadline, states
        await asyncio.sleep(0.1)


async def forget(alive: GatewayProc, gateway_id: str) -> None:
    """What an operator does for a gateway gone for good: once ``alive`` shows it lost (its share
    reserved, docs/CLUSTER.md "Partitions"), POST /admin/cluster/forget/{id} frees that share."""
    async def lost() -> bool:
        return gateway_id in [g["id"] for g in (await alive.state())["cluster"]["lost"]]
    await until(lost, f"{gateway_id} was never shown lost")
    async with aiohttp.ClientSession() as s, s.post(f"{alive.url}/admin/cluster/forget/{gateway_id}",
                                                    headers=ADMIN) as r:
        assert r.status == 200, await r.text()


def make_gateways(n: int, tmp: Path, redis_url: str, gpu_url: str, **kw: Any) -> list[GatewayProc]:
    out = []
    for i in range(n):
        port = free_port()
        out.append(GatewayProc(cluster_config(redis_url, gpu_url, port, f"gw{i}", **kw), tmp / f"gw{i}.yaml"))
    return out


TTL = 1.0  # the smallest lease_ttl_sec: the heartbeat (TTL / 3) notices a lost Redis fast


@asynccontextmanager
async def cluster_runtime(redis: RedisServer, slots: int, cfg: dict[str, Any] | None = None, ttl: float = TTL,
                          ahead: Callable[[], float] = lambda: 0.0) -> AsyncIterator[tuple[Runtime, ClusterLeases]]:
    """A started Runtime whose leases live in Redis, wired as kilolined/cluster/build.py wires
    them (the lease store alone: the property is about leases); stopped in the server's order.
    ``cfg``: lease_props.config's, changed (default: as it is, with ``slots``); ``ahead``: how far
    the store's clock runs ahead of the Runtime's (a freeze, as the store would live it)."""
    cfg = config(slots) if cfg is None else cfg
    # A prefix of its own: nothing an earlier example left in Redis is counted in this one.
    cfg["cluster"] = {"redis_url": redis.url, "gateway_id": "prop", "lease_ttl_sec": ttl,
                      "key_prefix": f"prop-{os.urandom(4).hex()}:"}
    made: list[ClusterLeases] = []

    def wire(rt: Runtime) -> Wiring:
        assert rt.cfg.cluster is not None
        made.append(ClusterLeases(rt.scheduler, rt.cfg.cluster, "prop", clock=lambda: rt.clock() + ahead(),
                                  version=lambda: rt.version, alert=rt.notify))
        return Wiring(leases=made[0], settle=made[0].settle, cluster=made[0].view)

    rt = Runtime(parse_config(yaml.safe_dump(cfg)), "test", wire=wire)
    leases = made[0]
    await rt.start()
    try:
        await leases.start()
        try:
            yield rt, leases
        finally:
            await asyncio.wait_for(leases.stop(), 10)  # a stop that hangs fails the example
    finally:
        await asyncio.wait_for(rt.stop(), 10)
