"""Reaped slots in doubt: the leader asks their nodes whether they are free (docs/CLUSTER.md).

A gateway frozen past ``lease_ttl_sec`` is reaped, but its requests may still run on the nodes.
Its leases stay counted in Redis, *in doubt* (kilolined/cluster/scripts.py ``doubt``), until
their route's ``request_timeout_sec`` since the grant has passed (the scripts' ``reap``) or the
node itself shows the slots free, which this check asks where the kind can tell:

- ComfyUI ``GET /queue``: every prompt in ``queue_running`` and ``queue_pending`` holds a slot
  (a pending one runs next);
- llama.cpp ``GET /slots``: the slots with ``is_processing`` (older builds: ``state`` != 0).

Anything else (generic, vLLM, a llama.cpp started with ``--no-slots``) cannot tell, so its slots
wait for the timeout. ``busy_of`` is the pure part; ``DoubtCheck`` runs one round every
``lease_ttl_sec / 3`` on the leader.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError

from kilolined.cluster.leases import ClusterLeases
from kilolined.wire.tasks import cancel_until_done

log = logging.getLogger("kilolined")

#: where each kind shows what it runs
PATHS = {"comfyui": "/queue", "openai": "/slots"}


def busy_of(kind: str, body: Any) -> int | None:
    """The requests the node says it runs or holds (None: it cannot tell, or said nothing usable)."""
    if kind == "comfyui" and isinstance(body, dict):
        running, pending = body.get("queue_running"), body.get("queue_pending")
        if not isinstance(running, list) or not isinstance(pending, list):
            return None
        return len(running) + len(pending)
    if kind == "openai" and isinstance(body, list):
        busy = 0
        for slot in body:
            if not isinstance(slot, dict):
                return None
            if "is_processing" in slot:
                busy += bool(slot["is_processing"])
            elif "state" in slot:
                busy += slot["state"] != 0
            else:
                return None
        return busy
    return None


class DoubtCheck:
    """The leader's round: the nodes with leases in doubt are asked what they run."""

    def __init__(self, leases: ClusterLeases, *, kind_of: Callable[[str], str | None],
                 fetch: Callable[[str, str], Awaitable[Any]], leader: Callable[[], bool], every_sec: float):
        self.leases = leases
        self.kind_of = kind_of  # node -> the kind of the first route it serves (None: gone)
        self.fetch = fetch  # (node, path) -> its JSON; raises when it does not answer
        self.leader = leader
        self.every_sec = every_sec
        # The lease id counter read one round ago: the live leases granted by then have had a
        # round to reach their node, so the node's count includes them.
        self._upto: int | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kiloline-doubt")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_until_done(self._task)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_sec)
            try:
                await self.round()
            except (RedisError, OSError):
                self._upto = None  # the heartbeat notices a lost Redis
            except Exception:
                log.exception("cluster: node check of slots in doubt")

    async def round(self) -> None:
        if not self.leader() or not self.leases.view.redis_up:
            self._upto = None  # a counter from another leader's time (or another epoch) is no guide
            return
        seq, nodes = await self.leases.in_doubt()
        upto, self._upto = self._upto, seq
        if upto is None:
            return
        for node in nodes:
            busy = await self._busy(node)
            if busy is None:
                continue
            freed = await self.leases.free_doubt(node, busy, upto)
            if freed:
                log.info("cluster: node %s shows %d reaped slot(s) free: granted again", node, freed)

    async def _busy(self, node: str) -> int | None:
        kind = self.kind_of(node)
        path = PATHS.get(kind or "")
        if path is None:
            return None
        try:
            body = await self.fetch(node, path)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a node that does not answer shows nothing free
            log.debug("cluster: %s %s unreadable (%s)", node, path, type(e).__name__)
            return None
        return busy_of(kind or "", body)
