"""A ComfyUI route's history, queue and jobs lists shared through Redis (cluster mode,
docs/CLUSTER.md): any gateway answers ``/history``, ``/queue``, ``/api/jobs`` and acts on a
prompt (``/interrupt``, ``POST /queue``, cancel) whichever gateway admitted it.

One writer per prompt: the gateway that sent it to a node writes its state here; the others
only read it, and mark it deleted or delete its entry when a client asks them to.
Per route (its name and every other part percent-quoted):

- ``{prefix}comfywait:{route}``: hash prompt id → the prompt's waiting record (who sent it, the
  node that has it, the number and client id its client was given), with
  ``{prefix}comfywait:{route}:at`` (zset: prompt id → when written, ms): written when a node
  takes the prompt or it moves to another, dropped when it ends. A record is forgotten
  ``max_age`` after it was written (the route's request timeout, twice: a prompt is stopped by
  then) and at most ``WAITING_MAX`` are kept, so a gateway that died leaves nothing for long.
  Which of them run and which wait is asked of their nodes, as ComfyUI's own queue says. A
  prompt in its gateway's own queue has a record too, on no node (``node`` "") with its queue
  item, from when it is queued there until a node takes it or it ends.
- ``{prefix}comfyhist:{route}:{prompt_id}``: a prompt's history entry as its client was given it
  (the route's file names, its number and client id, no traceback) with the key that sent it,
  for ``jobs.result_ttl_sec``.
- ``{prefix}comfyended:{route}`` and ``{prefix}comfyended:{route}:{key}``: zsets of the ended
  prompts (everyone's, one key's) scored by when they ended, ComfyUI's history order; and
  ``{prefix}comfysum:{route}``: hash prompt id → its ``/api/jobs`` record (no outputs), so a jobs
  list reads no entries. Each is capped at ``entries_max`` and forgets what is older than the TTL.
- ``{prefix}comfydrop:{route}:{prompt_id}``: the prompt was deleted from its node's queue by a
  client through some gateway (``POST /queue``, a cancel), written before the node is told: the
  gateway that holds it reads it when the prompt vanishes from the node, and ends it there
  instead of re-queueing it. Kept ``max_age``.

The writes of one gateway go through one queue in the order they were made (a prompt's record
is never written after its entry dropped it). The history keys (entries, ended lists, jobs
records) are written by this module's scripts only, through ``_history_write``: a prompt's entry
by the gateway that ran it, a delete (``POST /history``) by whichever gateway the client asked.
A Redis that does not answer leaves each gateway with its own prompts (logged, never an error
to clients).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any
from urllib.parse import quote

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger("kilolined")

REDIS_ERRORS = (RedisError, OSError, TimeoutError)
WAITING_MAX = 10_000  # waiting records per route (more than any route has slots)
WRITES_MAX = 10_000  # writes queued while Redis is slow: more are dropped (logged)

# KEYS: the waiting hash, its zset of write times. ARGV: max age ms, cap, then (prompt id,
# record or "" to drop it) pairs. The records older than max age, then the oldest beyond the
# cap, are forgotten.
PUT_WAITING = """
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local age, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 3, #ARGV, 2 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
  else
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    redis.call('ZADD', KEYS[2], now, ARGV[i])
  end
end
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - age)
local n = redis.call('ZCARD', KEYS[2])
if n > cap then
  for _, k in ipairs(redis.call('ZRANGE', KEYS[2], 0, n - cap - 1)) do table.insert(old, k) end
end
for _, k in ipairs(old) do
  redis.call('HDEL', KEYS[1], k)
  redis.call('ZREM', KEYS[2], k)
end
redis.call('PEXPIRE', KEYS[1], age)
redis.call('PEXPIRE', KEYS[2], age)
return 1
"""

# KEYS: the entry, the route's ended zset, the key's ended zset, the jobs records hash, the
# waiting hash and zset. ARGV: the entry doc, its jobs record, ttl ms, cap, prompt id.
# The entry and its place in both lists, and the prompt out of the waiting ones, at once: no
# reader sees it in neither (nor in both).
PUT_ENTRY = """
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl, cap, pid = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('HDEL', KEYS[5], pid)
redis.call('ZREM', KEYS[6], pid)
for i = 2, 3 do
  redis.call('ZADD', KEYS[i], now, pid)
  local old = redis.call('ZRANGEBYSCORE', KEYS[i], '-inf', now - ttl)
  local n = redis.call('ZCARD', KEYS[i])
  if n > cap then
    for _, k in ipairs(redis.call('ZRANGE', KEYS[i], 0, n - cap - 1)) do table.insert(old, k) end
  end
  for _, k in ipairs(old) do
    redis.call('ZREM', KEYS[i], k)
    if i == 2 then redis.call('HDEL', KEYS[4], k) end
  end
  redis.call('PEXPIRE', KEYS[i], ttl)
end
if redis.call('ZSCORE', KEYS[2], pid) then redis.call('HSET', KEYS[4], pid, ARGV[2]) end
redis.call('PEXPIRE', KEYS[4], ttl)
return 1
"""

# KEYS: the route's ended zset, the jobs records hash, then each prompt's entry. ARGV: the key
# ended zsets' common prefix, then the prompt ids (in KEYS' order). Each entry, its place in both
# lists and its jobs record go at once; the key that sent it is read from its entry, its list's
# name quoted as ``_q`` quotes it.
FORGET_ENTRIES = """
local function q(s)
  return (string.gsub(s, '[^%w_%.%-~]', function(c) return string.format('%%%02X', string.byte(c)) end))
end
for i = 3, #KEYS do
  local pid = ARGV[i - 1]
  local doc = redis.call('GET', KEYS[i])
  if doc then
    local subject = cjson.decode(doc)['subject']
    if type(subject) == 'string' then redis.call('ZREM', ARGV[1] .. q(subject), pid) end
    redis.call('DEL', KEYS[i])
  end
  redis.call('ZREM', KEYS[1], pid)
  redis.call('HDEL', KEYS[2], pid)
end
return 1
"""


def _q(part: str) -> str:
    return quote(part, safe="")


class Writes:
    """One gateway's writes, made one after another in the order they were asked for."""

    def __init__(self, spawn: Callable[[Coroutine[Any, Any, Any]], object]):
        self.spawn = spawn
        self._ops: deque[tuple[Callable[[], Awaitable[bool]], asyncio.Future[bool]]] = deque()
        self._running = False

    def submit(self, op: Callable[[], Awaitable[bool]]) -> asyncio.Future[bool]:
        """Queue ``op`` (it logs its own Redis errors); the future says, once it ran, whether
        Redis took it."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        if len(self._ops) >= WRITES_MAX:
            log.warning("comfy lists: Redis is behind (%d writes queued): a write dropped", len(self._ops))
            done.set_result(False)
            return done
        self._ops.append((op, done))
        if not self._running:
            self._running = True
            self.spawn(self._drain())
        return done

    async def _drain(self) -> None:
        try:
            while self._ops:
                op, done = self._ops[0]
                took = False
                try:
                    took = await op()
                finally:
                    self._ops.popleft()
                    if not done.done():
                        done.set_result(took)
        finally:
            self._running = False
            while self._ops:  # stopped (the gateway stops): nobody waits for what was left
                _, done = self._ops.popleft()
                if not done.done():
                    done.set_result(False)


class SharedLists:
    def __init__(self, redis: aioredis.Redis, prefix: str, spawn: Callable[[Coroutine[Any, Any, Any]], object]):
        self.redis, self.prefix = redis, prefix
        self.writes = Writes(spawn)
        self._put_waiting = redis.register_script(PUT_WAITING)
        self._put_entry = redis.register_script(PUT_ENTRY)
        self._forget_entries = redis.register_script(FORGET_ENTRIES)

    # --- keys ------------------------------------------------------------------------------------
    def _waiting_keys(self, route: str) -> list[str]:
        key = f"{self.prefix}comfywait:{_q(route)}"
        return [key, key + ":at"]

    def entry_key(self, route: str, prompt_id: str) -> str:
        return f"{self.prefix}comfyhist:{_q(route)}:{_q(prompt_id)}"

    def _ended_key(self, route: str, subject: str | None) -> str:
        key = f"{self.prefix}comfyended:{_q(route)}"
        return key if subject is None else f"{key}:{_q(subject)}"

    def _jobs_key(self, route: str) -> str:
        return f"{self.prefix}comfysum:{_q(route)}"

    def _drop_key(self, route: str, prompt_id: str) -> str:
        return f"{self.prefix}comfydrop:{_q(route)}:{_q(prompt_id)}"

    # --- the writer's side -------------------------------------------------------------------------
    def waiting_now(self, route: str, prompt_id: str, record: dict[str, Any] | None, max_age: float) -> None:
        """The prompt waits or runs on a node (``record``), or ended without an entry (None)."""
        args: list[bytes | str | int] = [max(1, int(max_age * 1000)), WAITING_MAX, prompt_id,
                                         b"" if record is None else orjson.dumps(record)]

        async def write() -> bool:
            try:
                await self._put_waiting(keys=self._waiting_keys(route), args=args)
            except REDIS_ERRORS as e:
                log.warning("comfy lists: Redis did not take a queue change (%s): this gateway's own only",
                            type(e).__name__)
                return False
            return True

        self.writes.submit(write)

    async def put_entry(self, route: str, prompt_id: str, subject: str, entry: dict[str, Any],
                        job: dict[str, Any], ttl: float, cap: int) -> bool:
        """The prompt ended: its entry as given and its jobs record, out of the waiting ones.
        False when Redis did not take it."""
        keys = [self.entry_key(route, prompt_id), self._ended_key(route, None), self._ended_key(route, subject),
                self._jobs_key(route), *self._waiting_keys(route)]
        args: list[bytes | str | int] = [orjson.dumps({"subject": subject, "entry": entry}), orjson.dumps(job),
                                         max(1, int(ttl * 1000)), cap, prompt_id]
        return await self._history_write(self._put_entry, keys, args, "did not take an entry")

    async def forget_entries(self, route: str, prompt_ids: list[str]) -> bool:
        """Out of every gateway's history (``POST /history`` delete or clear, through any
        gateway: ComfyUI's history is everyone's who may see it). False when Redis did not take it."""
        if not prompt_ids:
            return True
        keys = [self._ended_key(route, None), self._jobs_key(route),
                *(self.entry_key(route, pid) for pid in prompt_ids)]
        args: list[bytes | str | int] = [self._ended_key(route, None) + ":", *prompt_ids]
        return await self._history_write(self._forget_entries, keys, args, "did not take a delete")

    async def _history_write(self, script: Any, keys: list[str], args: list[bytes | str | int], what: str) -> bool:
        """The one writer of the route's history keys (entries, ended lists, jobs records): a
        script of this module, in this gateway's order of writes (a delete never lands before
        the entry it deletes). False when Redis did not take it."""

        async def write() -> bool:
            try:
                await script(keys=keys, args=args)
            except REDIS_ERRORS as e:
                log.warning("comfy history: Redis %s (%s): this gateway's own only", what, type(e).__name__)
                return False
            return True

        return await self.writes.submit(write)

    async def drop(self, route: str, prompt_ids: list[str], max_age: float) -> bool:
        """The prompts are about to be deleted from their nodes' queues by a client (whichever
        gateway holds them). False when Redis did not take it."""
        if not prompt_ids:
            return True
        px = max(1, int(max_age * 1000))
        try:
            async with self.redis.pipeline(transaction=False) as p:
                for pid in prompt_ids:
                    p.set(self._drop_key(route, pid), b"1", px=px)
                await p.execute()
        except REDIS_ERRORS as e:
            log.warning("comfy lists: Redis did not take a queue delete (%s): the gateway holding the prompt "
                        "may take it for lost", type(e).__name__)
            return False
        return True

    async def dropped(self, route: str, prompt_id: str) -> bool:
        """Whether a client deleted the prompt from its node's queue through any gateway."""
        try:
            return bool(await self.redis.exists(self._drop_key(route, prompt_id)))
        except REDIS_ERRORS as e:
            log.warning("comfy lists: Redis did not answer (%s): a vanished prompt counts as lost", type(e).__name__)
            return False

    # --- the readers' side ---------------------------------------------------------------------------
    async def waiting(self, route: str) -> dict[str, dict[str, Any]]:
        """Every gateway's prompts of the route on a node now (their waiting records)."""
        try:
            got = await self.redis.hgetall(self._waiting_keys(route)[0])
        except REDIS_ERRORS as e:
            log.warning("comfy lists: Redis did not answer (%s): this gateway's own queue only", type(e).__name__)
            return {}
        return {_text(k): dict(orjson.loads(v)) for k, v in got.items()}

    async def ended(self, route: str, subject: str | None) -> list[str] | None:
        """The ended prompts of ``subject`` (None: everyone's) in the order they ended; None when
        Redis does not answer."""
        try:
            got = await self.redis.zrange(self._ended_key(route, subject), 0, -1)
        except REDIS_ERRORS as e:
            log.warning("comfy history: Redis did not answer (%s): this gateway's own history only",
                        type(e).__name__)
            return None
        return [_text(pid) for pid in got if isinstance(pid, (bytes, str))]

    async def entries(self, route: str, prompt_ids: list[str]) -> dict[str, tuple[str, dict[str, Any]]] | None:
        """(the key that sent it, the entry as given) of each prompt that still has one; None
        when Redis does not answer."""
        if not prompt_ids:
            return {}
        try:
            got = await self.redis.mget([self.entry_key(route, pid) for pid in prompt_ids])
        except REDIS_ERRORS as e:
            log.warning("comfy history: Redis did not answer (%s)", type(e).__name__)
            return None
        out = {}
        for pid, doc in zip(prompt_ids, got, strict=True):
            if doc is not None:
                d = orjson.loads(doc)
                out[pid] = (str(d["subject"]), dict(d["entry"]))
        return out

    async def entry(self, route: str, prompt_id: str) -> tuple[str, dict[str, Any]] | None:
        return (await self.entries(route, [prompt_id]) or {}).get(prompt_id)

    async def jobs(self, route: str, prompt_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The ``/api/jobs`` record of each ended prompt that still has one."""
        if not prompt_ids:
            return {}
        try:
            got = await self.redis.hmget(self._jobs_key(route), prompt_ids)
        except REDIS_ERRORS as e:
            log.warning("comfy history: Redis did not answer (%s)", type(e).__name__)
            return {}
        return {pid: dict(orjson.loads(doc)) for pid, doc in zip(prompt_ids, got, strict=True) if doc is not None}


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
