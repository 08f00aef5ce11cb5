"""Held ComfyUI inputs shared through Redis (cluster mode, docs/CLUSTER.md): a file uploaded
through one gateway is there for a prompt that reaches another.

Each held input is one hash ``{prefix}comfy:{route}:{kind}:{subfolder}:{name}`` (the parts
percent-quoted) with its bytes, their sha256 and its owners, expiring ``jobs.result_ttl_sec``
after it was written or last used. Each gateway still keeps its own copy in memory (the route's
directory, comfy_files.py): Redis is asked only for a name the gateway does not hold. A Redis
that does not answer leaves each gateway with its own files (logged, never an error to clients).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import quote

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger("kilolined")

CALL_SEC = 5.0


@dataclass(frozen=True)
class SharedFile:
    data: bytes
    sha256: str
    owners: frozenset[str]


class SharedInputs:
    def __init__(self, redis: aioredis.Redis, prefix: str):
        self.redis, self.prefix = redis, prefix

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


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
