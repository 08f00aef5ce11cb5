"""The small ComfyUI client the adapter needs: JSON calls, queue lookups, stopping a prompt.

Errors never carry the node's address (they reach clients and logs).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from kilolined.ops.runtime import Runtime
from kilolined.scheduling.queue import Lease

log = logging.getLogger("kilolined")

CALL_SEC = 5.0  # one history/queue/interrupt call
STOP_SEC = 2.0  # cancel: interrupt / queue delete, best-effort (DELETE /v1/jobs waits 5 s for us)


class NodeError(Exception):
    """A call to the node failed (connection, timeout, status, or not JSON)."""

    def __init__(self, reason: str, refused: bool = False):
        super().__init__(reason)
        self.reason = reason
        #: the node is not there at all (connection refused): it died or restarts
        self.refused = refused


@dataclass
class NodeAPI:
    session: aiohttp.ClientSession
    url: str
    headers: dict[str, str]

    async def get_json(self, path: str) -> Any:
        try:
            async with self.session.get(self.url + path, headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=CALL_SEC)) as r:
                if r.status != 200:
                    raise NodeError(f"GET {path.split('/')[1]} answered HTTP {r.status}")
                return orjson.loads(await r.read())
        except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as e:
            raise NodeError(f"GET {path.split('/')[1]} failed ({type(e).__name__})",
                            refused=isinstance(e, aiohttp.ClientConnectorError))

    async def post(self, path: str, body: Any) -> tuple[int, bytes, str]:
        """(status, body, content type) of a JSON POST."""
        headers = {**self.headers, "Content-Type": "application/json"}
        try:
            async with self.session.post(self.url + path, data=orjson.dumps(body), headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=CALL_SEC)) as r:
                return r.status, await r.read(), r.headers.get("Content-Type", "application/octet-stream")
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise NodeError(f"POST {path} failed ({type(e).__name__})")

    async def post_json(self, path: str, body: Any) -> None:
        await self.post(path, body)


def node_api(rt: Runtime, node: str, request_id: str) -> NodeAPI:
    ncfg = rt.scheduler.nodes[node].cfg
    return NodeAPI(rt.session(node), ncfg.url, {"X-Request-Id": request_id, **ncfg.headers})


def lease_api(rt: Runtime, lease: Lease, request_id: str) -> NodeAPI:
    """The node of a lease as its grant resolved it (queue.Target)."""
    return NodeAPI(rt.session(lease.node), lease.target.url, {"X-Request-Id": request_id, **lease.target.headers})


def queue_ids(items: Any, prompt_id: str | None, client_id: str | None) -> list[str]:
    """Prompt ids in a queue list (``[number, id, prompt, extra_data, outputs]`` items) that are ours."""
    out = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, list) or len(item) < 2 or not isinstance(item[1], str):
            continue
        extra = item[3] if len(item) > 3 and isinstance(item[3], dict) else {}
        if item[1] == prompt_id or (client_id is not None and extra.get("client_id") == client_id):
            out.append(item[1])
    return out


def all_ids(items: Any) -> list[str]:
    return [item[1] for item in items if isinstance(item, list) and len(item) > 1 and isinstance(item[1], str)] \
        if isinstance(items, list) else []


def on_queue(queue: Any, prompt_id: str, client_id: str | None) -> bool:
    if not isinstance(queue, dict):
        return True  # unreadable: do not call it lost
    return bool(queue_ids(queue.get("queue_running"), prompt_id, client_id)
                or queue_ids(queue.get("queue_pending"), prompt_id, client_id))


def find_entry(data: Any, prompt_id: str, number: float | None) -> dict[str, Any] | None:
    """The history entry of *this* submission: ComfyUI keeps an older run's entry under a reused
    prompt_id until the new run ends, and only ``prompt[0]`` (the queue number the POST answered)
    tells them apart. Without a number (an old build) any entry will do."""
    entry = data.get(prompt_id) if isinstance(data, dict) else None
    if not isinstance(entry, dict):
        return None
    if number is None:
        return entry
    prompt = entry.get("prompt")
    if isinstance(prompt, list) and prompt and prompt[0] == number:
        return entry
    return None


async def stop_prompt(node: NodeAPI, prompt_id: str | None, client_id: str | None) -> bool:
    """Best effort: interrupt our prompt if it runs, delete it if it still waits in the node's queue.

    Finds it by id, or by our client_id when the POST went out but its answer never came back.
    Returns whether a running prompt was interrupted. Never raises (except CancelledError).
    """
    interrupted = False
    try:
        async with asyncio.timeout(STOP_SEC):
            for _ in range(2):
                try:
                    queue = await node.get_json("/queue")
                except NodeError:
                    if prompt_id is not None:
                        # Without a queue view: newer builds interrupt only this id (a no-op if it
                        # is not running); deleting a prompt that is not pending is a no-op too.
                        await node.post_json("/queue", {"delete": [prompt_id]})
                        await node.post_json("/interrupt", {"prompt_id": prompt_id})
                        interrupted = True
                    return interrupted
                queue = queue if isinstance(queue, dict) else {}
                running = queue_ids(queue.get("queue_running"), prompt_id, client_id)
                pending = queue_ids(queue.get("queue_pending"), prompt_id, client_id)
                if pending:
                    await node.post_json("/queue", {"delete": pending})
                for pid in running:
                    await node.post_json("/interrupt", {"prompt_id": pid})
                    interrupted = True
                if not pending:
                    return interrupted
                # A pending prompt may have started between the two calls: look once more.
    except (TimeoutError, NodeError):
        pass
    except Exception:
        log.exception("stopping a ComfyUI prompt")
    return interrupted
