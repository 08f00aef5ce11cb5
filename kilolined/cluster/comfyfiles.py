"""ComfyUI files shared through Redis (cluster mode, docs/CLUSTER.md): a file uploaded through
one gateway is there for a prompt that reaches another, and an output copied through one is
served by every other.

Each held input is one hash ``{prefix}comfy:{route}:{kind}:{subfolder}:{name}`` (the parts
percent-quoted) with its bytes, their sha256 and its owners, expiring ``jobs.result_ttl_sec``
after it was written or last used. Each gateway still keeps its own copy in memory (the route's
directory, comfy_files.py): Redis is asked only for a name the gateway does not hold. A Redis
that does not answer leaves each gateway with its own files (logged, never an error to clients).

Outputs (the route's store when no bucket is configured) live only in Redis: each one hash
``{prefix}comfyout:{route}:{subfolder}:{name}`` (bytes, sha256, owners, content type), listed
oldest first in the route's index ``{prefix}comfyout:{route}`` with its size beside it, so one
script keeps the route's outputs within ``comfy.max_files_mb`` cluster-wide (the least recently
used dropped first) and forgets those unused for ``jobs.result_ttl_sec``. A name is reserved
cluster-wide before a gateway gives it (``{prefix}comfyname:{route}:{kind}:{subfolder}:{name}``,
SET NX), so two gateways never store two files under one name.

The route's history, queue and jobs lists are cluster/comfylists.py's.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from urllib.parse import quote

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger("kilolined")

CALL_SEC = 5.0
REDIS_ERRORS = (RedisError, OSError, TimeoutError)

# KEYS: the file's hash, the route's index (zset: key -> last use, ms), its sizes (hash: key ->
# bytes), its byte total. ARGV: data, sha256, owners (JSON), content type, ttl ms, max bytes.
# Forgets the index entries that expired, then drops the least recently used while the route
# would be over its bound. Returns 0 when the file alone is over the bound.
PUT_OUTPUT = """
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl, max, size = tonumber(ARGV[5]), tonumber(ARGV[6]), string.len(ARGV[1])
if size > max then return 0 end
local function forget(k)
  local n = tonumber(redis.call('HGET', KEYS[3], k) or '0')
  redis.call('ZREM', KEYS[2], k)
  redis.call('HDEL', KEYS[3], k)
  redis.call('DECRBY', KEYS[4], n)
  return n
end
for _, k in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)) do forget(k) end
if redis.call('ZSCORE', KEYS[2], KEYS[1]) then forget(KEYS[1]) end
local total = tonumber(redis.call('GET', KEYS[4]) or '0')
while total + size > max do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  total = total - forget(oldest[1])
  redis.call('DEL', oldest[1])
end
redis.call('HSET', KEYS[1], 'data', ARGV[1], 'sha256', ARGV[2], 'owners', ARGV[3], 'ctype', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
redis.call('INCRBY', KEYS[4], size)
for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], ttl) end
return 1
"""

# KEYS: the file's hash, the route's index, its sizes, its byte total, the file's name reservation.
# ARGV: ttl ms. A use: it lives ttl from now, dropped last, and keeps its name (and the route's
# index, which counts it) as long.
USE_OUTPUT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
for i = 1, 5 do redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[1])) end
redis.call('ZADD', KEYS[2], 'XX', now, KEYS[1])
return 1
"""


@dataclass(frozen=True)
class SharedFile:
    data: bytes
    sha256: str
    owners: frozenset[str]


@dataclass(frozen=True)
class SharedOutput:
    """An output in Redis: who may read it, its size, and its bytes when they were asked for."""

    owners: frozenset[str]
    size: int
    ctype: str
    data: bytes | None = None


class SharedInputs:
    def __init__(self, redis: aioredis.Redis, prefix: str):
        self.redis, self.prefix = redis, prefix
        self.gateway = secrets.token_hex(8)  # this process, in the names it reserves
        self._put_output = redis.register_script(PUT_OUTPUT)
        self._use_output = redis.register_script(USE_OUTPUT)

    def key(self, route: str, kind: str, subfolder: str, name: str) -> str:
        parts = (quote(p, safe="") for p in (route, kind, subfolder, name))
        return f"{self.prefix}comfy:" + ":".join(parts)

    async def get(self, route: str, kind: str, subfolder: str, name: str) -> SharedFile | None:
        try:
            got = await self.redis.hmget(self.key(route, kind, subfolder, name), ["data", "sha256", "owners"])
        except (RedisError, OSError, TimeoutError) as e:
            log.warning("comfy files: Redis did not answer (%s): this gateway's own files only", type(e).__name__)
            return None
        data, digest, owners = got
        if data is None or digest is None or owners is None:
            return None
        return SharedFile(data if isinstance(data, bytes) else data.encode(), _text(digest),
                          frozenset(orjson.loads(owners)))

    async def put(self, route: str, kind: str, subfolder: str, name: str, f: SharedFile, ttl: float) -> None:
        key = self.key(route, kind, subfolder, name)
        try:
            async with self.redis.pipeline(transaction=True) as p:
                p.hset(key, mapping={"data": f.data, "sha256": f.sha256, "owners": orjson.dumps(sorted(f.owners))})
                p.pexpire(key, max(1, int(ttl * 1000)))
                await p.execute()
        except (RedisError, OSError, TimeoutError) as e:
            log.warning("comfy files: Redis did not take an upload (%s): held by this gateway only",
                        type(e).__name__)


    # --- outputs (the route's store when it has no bucket) ------------------------------------------
    def output_key(self, route: str, subfolder: str, name: str) -> str:
        return f"{self.prefix}comfyout:" + ":".join(quote(p, safe="") for p in (route, subfolder, name))

    def _index(self, route: str) -> list[str]:
        index = f"{self.prefix}comfyout:{quote(route, safe='')}"
        return [index, index + ":sizes", index + ":bytes"]

    async def put_output(self, route: str, subfolder: str, name: str, f: SharedFile, ctype: str, ttl: float,
                         max_bytes: int) -> bool:
        """Stored (older outputs of the route dropped to make room); False when over the bound.
        Raises RedisError/OSError/TimeoutError when Redis does not answer."""
        keys = [self.output_key(route, subfolder, name), *self._index(route)]
        done = await self._put_output(keys=keys, args=[f.data, f.sha256, orjson.dumps(sorted(f.owners)), ctype,
                                                       max(1, int(ttl * 1000)), max_bytes])
        return bool(done)

    async def output(self, route: str, subfolder: str, name: str, ttl: float, with_data: bool) -> SharedOutput | None:
        """An output by name (its bytes only ``with_data``), its TTL renewed; None when Redis has
        none or does not answer."""
        key = self.output_key(route, subfolder, name)
        fields = ["owners", "sha256", "ctype"] + (["data"] if with_data else [])
        try:
            async with self.redis.pipeline(transaction=False) as p:
                p.hmget(key, fields)
                p.hstrlen(key, "data")
                got, size = await p.execute()
            if got[0] is not None:
                named = self.name_key(route, "output", subfolder, name)
                await self._use_output(keys=[key, *self._index(route), named], args=[max(1, int(ttl * 1000))])
        except REDIS_ERRORS as e:
            log.warning("comfy files: Redis did not answer (%s): an output not served", type(e).__name__)
            return None
        if got[0] is None:
            return None
        data = got[3] if with_data else None
        if with_data and data is None:
            return None  # dropped between the two calls
        return SharedOutput(frozenset(orjson.loads(got[0])), int(size), _text(got[2] or b"application/octet-stream"),
                            data if isinstance(data, bytes) or data is None else data.encode())

    def name_key(self, route: str, kind: str, subfolder: str, name: str) -> str:
        return f"{self.prefix}comfyname:" + ":".join(quote(p, safe="") for p in (route, kind, subfolder, name))

    async def reserve(self, route: str, kind: str, subfolder: str, name: str, file: str, ttl: float) -> bool:
        """The route's name ``name`` for this gateway's ``file``, cluster-wide: True when it was
        free (or is already this file's). Raises RedisError/OSError/TimeoutError when Redis does
        not answer."""
        key = self.name_key(route, kind, subfolder, name)
        holder = f"{self.gateway}/{file}"
        ms = max(1, int(ttl * 1000))
        if await self.redis.set(key, holder, nx=True, px=ms):
            return True
        if _text(await self.redis.get(key) or b"") == holder:
            await self.redis.pexpire(key, ms)
            return True
        return False


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
