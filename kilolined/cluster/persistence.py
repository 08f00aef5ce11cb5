"""``kilolined check`` in cluster mode: does the Redis it can reach write its memory to disk?

Payloads and job results live in Redis' memory in cluster mode; with RDB snapshots (``save``)
or the append-only file on, they would reach Redis' disk, and KiloLine promises no payload on
disk. A warning, not an error: the config is valid either way (docs/CLUSTER.md).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from yarl import URL

TIMEOUT_SEC = 3.0
FIX = 'set `save ""` and `appendonly no` in redis.conf (docs/CLUSTER.md)'


def persistence(save: str, appendonly: str) -> list[str]:
    """What writes to disk, from ``CONFIG GET save`` and ``CONFIG GET appendonly``."""
    on = []
    if save.strip():
        on.append(f'save "{save.strip()}"')
    if appendonly.strip().lower() == "yes":
        on.append("appendonly yes")
    return on


def shown(url: str) -> str:
    """The URL without its password."""
    try:
        return str(URL(url).with_password(None).with_user(None))
    except ValueError:
        return "the configured Redis"


async def warnings(url: str, timeout: float = TIMEOUT_SEC) -> list[str]:
    """``warning:`` lines for the Redis at ``url`` (none when it keeps nothing on disk)."""
    where = f"cluster.redis_url: Redis at {shown(url)}"
    r = aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True)
    try:
        save = (await r.config_get("save")).get("save", "")
        aof = (await r.config_get("appendonly")).get("appendonly", "")
    except (RedisError, OSError) as e:
        msg = str(e) or type(e).__name__
        return [f"warning: {where}: cannot read its persistence settings ({msg})"]
    finally:
        await r.aclose()
    on = persistence(save, aof)
    if not on:
        return []
    return [f"warning: {where} has persistence on ({', '.join(on)}): payloads and results it holds "
            f"reach its disk; {FIX}"]
