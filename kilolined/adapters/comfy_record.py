"""The gateway's own record of a ComfyUI route's prompts: who sent each one, where it runs, what
the client was told, and its history entry once it ended (no I/O).

Every prompt that reaches a node through the gateway is written here when the node accepts it.
The route's history, queue, jobs and websocket are answered from this record, merged over its
nodes, in ComfyUI's shapes, as the client knows its prompts: under the ``number`` and the
``client_id`` it sent (the node was sent the gateway's own client id: comfy_hub.py).

Who sees what (``Viewer``): a key its own prompts, the admin key and a ``comfy.shared`` route
everyone's. A prompt of another key is answered as ComfyUI answers a prompt that is not there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

OWNERS_MAX = 10_000  # prompts remembered per route (the oldest are forgotten first)
ENTRIES_MAX = 2_000  # history entries kept per route (ComfyUI's own cap is 10,000, of small entries)
ABSENT: Any = object()  # the client sent no client_id
SENSITIVE_EXTRA_DATA_KEYS = ("auth_token_comfy_org", "api_key_comfy_org")  # ComfyUI keeps these out of its queue


@dataclass(slots=True)
class Prompt:
    subject: str
    node: str
    number: float | None = None  # the queue number the client was given
    client_id: Any = ABSENT  # the client's own client_id (the node was sent the gateway's)
    entry: dict[str, Any] | None = None  # its history entry as the node wrote it, once ended
    ended: bool = False
    output_seen: bool = False  # an output node ran (``executed``): it cannot be re-run elsewhere for free
    stopped: bool = False  # its client asked to stop it (interrupt, cancel, dequeue): lost, it is not re-run
    node_number: float | None = None  # the number its node gave it (another after a re-queue)
    shared: bool = False  # cluster mode: its entry is in Redis, whose history is the route's from then on
    dropped: bool = False  # deleted from its node's queue by a client: it ends there, is never re-queued

    def __post_init__(self) -> None:
        if self.node_number is None:
            self.node_number = self.number

    def target(self) -> str | None:
        """The client socket ComfyUI would send this prompt's events to ("" names none); None
        when ComfyUI would broadcast them (no client_id, or null)."""
        if self.client_id is ABSENT or self.client_id is None:
            return None
        return self.client_id if isinstance(self.client_id, str) else ""


@dataclass(frozen=True, slots=True)
class Viewer:
    """Whose prompts a request sees: one subject's, or (``subject`` None) everyone's."""

    subject: str | None

    def sees(self, p: Prompt) -> bool:
        return self.subject is None or p.subject == self.subject


EVERYONE = Viewer(None)


def _always() -> bool:
    return True


@dataclass(slots=True)
class Queued:
    """A prompt in the gateway's own queue, not yet sent to any node: a client removes it by its
    key (``POST /queue`` clear, or delete or cancel by its ``prompt_id``), as from ComfyUI's own
    queue. ``remove`` takes it out of the queue (False: it left already). One with an ``item``
    is listed in ``GET /queue`` while ``waiting`` says it still waits there."""

    subject: str
    prompt_id: str | None  # the prompt_id its client gave (or the gateway made), if any
    remove: Callable[[], bool]
    removed: bool = False
    item: list[Any] | None = None  # ``[number, id, prompt, extra_data, outputs]`` as GET /queue lists it
    seq: int = 0  # its request's place in the scheduler's order (``positions``)
    waiting: Callable[[], bool] = _always

    def take(self) -> bool:
        """Remove it now; True when it was still waiting."""
        if not self.removed and self.remove():
            self.removed = True
        return self.removed

    def listed(self) -> bool:
        return self.item is not None and not self.removed and self.waiting()


def queue_item(number: float, prompt_id: str, body: dict[str, Any], now_ms: int) -> list[Any]:
    """A prompt the gateway holds as ComfyUI lists a queued one: its ``extra_data`` with the
    client's ``client_id`` and ``create_time``, without the keys ComfyUI keeps out of it. Its
    outputs to execute are the node's to say (validation): none yet."""
    extra = dict(body["extra_data"]) if isinstance(body.get("extra_data"), dict) else {}
    if "client_id" in body:
        extra["client_id"] = body["client_id"]
    extra["create_time"] = now_ms
    for key in SENSITIVE_EXTRA_DATA_KEYS:
        extra.pop(key, None)
    return [number, prompt_id, body.get("prompt"), extra, []]


def pending_of(queued: dict[int, Queued], viewer: Viewer, order: dict[int, int]) -> list[list[Any]]:
    """The viewer's listed prompts of ``queued``, in the order they will run (``order``: seq →
    place; the number breaks ties and orders what the scheduler does not place)."""
    mine = [q for q in queued.values() if (viewer.subject is None or q.subject == viewer.subject) and q.listed()]
    mine.sort(key=lambda q: (order.get(q.seq, len(order) + 1), q.item[0] if q.item else 0))
    return [q.item for q in mine if q.item is not None]


def removable(queued: dict[int, Queued], viewer: Viewer, ids: set[str] | None) -> list[Queued]:
    """The viewer's prompts of ``queued`` that ``ids`` name (None: all of them)."""
    return [q for q in queued.values() if (viewer.subject is None or q.subject == viewer.subject)
            and (ids is None or (q.prompt_id is not None and q.prompt_id in ids))]


@dataclass
class PromptOwners:
    """prompt_id → Prompt of one route, bounded, most recent last; ``ended`` in the order they ended."""

    cap: int = OWNERS_MAX
    entries_cap: int = ENTRIES_MAX
    #: told of each prompt a node took, moved or ended (cluster mode: for every gateway's lists)
    listen: Callable[[str, Prompt], None] | None = None
    #: the highest number a client of the route was given (the gateway numbers on from it)
    top: float = -1
    _by_id: OrderedDict[str, Prompt] = field(default_factory=OrderedDict)
    _ended: OrderedDict[str, None] = field(default_factory=OrderedDict)

    def add(self, prompt_id: str, subject: str, node: str, number: float | None = None,
            client_id: Any = ABSENT, node_number: float | None = None) -> Prompt:
        p = self._by_id[prompt_id] = Prompt(subject, node, number, client_id, node_number=node_number)
        if number is not None:
            self.top = max(self.top, number)
        self._by_id.move_to_end(prompt_id)
        self._ended.pop(prompt_id, None)  # a reused id runs again
        while len(self._by_id) > self.cap:
            old, _ = self._by_id.popitem(last=False)
            self._ended.pop(old, None)
        self._told(prompt_id, p)
        return p

    def _told(self, prompt_id: str, p: Prompt) -> None:
        if self.listen is not None:
            self.listen(prompt_id, p)

    def moved(self, prompt_id: str, node: str, node_number: float | None) -> None:
        """A re-queued prompt runs on ``node`` now (``node_number`` in its queue), under the id,
        number and client id the client was given."""
        p = self._by_id.get(prompt_id)
        if p is not None:
            p.node, p.node_number, p.ended, p.entry, p.shared = node, node_number, False, None, False
            self._told(prompt_id, p)

    def drop(self, prompt_id: str) -> None:
        """A client deleted the prompt from its node's queue (``POST /queue``, a cancel): when
        it vanishes from the node it ended there, as ComfyUI ends it (no history entry)."""
        p = self._by_id.get(prompt_id)
        if p is not None and not p.ended:
            p.dropped = True

    def get(self, prompt_id: Any) -> Prompt | None:
        return self._by_id.get(prompt_id) if isinstance(prompt_id, str) else None

    def mine(self, subject: str | None) -> dict[str, str]:
        viewer = Viewer(subject)
        return {pid: p.node for pid, p in self._by_id.items() if viewer.sees(p)}

    def end(self, prompt_id: str, entry: dict[str, Any] | None) -> None:
        """The prompt ended (with its history entry, when there is one)."""
        p = self._by_id.get(prompt_id)
        if p is None:
            return
        p.ended = True
        if entry is not None:
            p.entry = entry
            self._ended[prompt_id] = None
            self._ended.move_to_end(prompt_id)
            while len(self._ended) > self.entries_cap:
                old, _ = self._ended.popitem(last=False)
                if (q := self._by_id.get(old)) is not None:
                    q.entry = None
        self._told(prompt_id, p)

    def forget(self, prompt_id: str) -> None:
        """Out of the history (``POST /history`` delete or clear); the owner is still known."""
        p = self._by_id.get(prompt_id)
        if p is not None:
            p.entry = None
        self._ended.pop(prompt_id, None)

    def waiting(self, viewer: Viewer) -> dict[str, Prompt]:
        """The viewer's prompts that have not ended (queued or running on a node)."""
        return {pid: p for pid, p in self._by_id.items() if not p.ended and viewer.sees(p)}

    def history(self, viewer: Viewer) -> Iterator[tuple[str, Prompt]]:
        """The viewer's ended prompts with an entry, oldest end first (ComfyUI's history order)."""
        for pid in self._ended:
            p = self._by_id[pid]
            if p.entry is not None and viewer.sees(p):
                yield pid, p


def as_given(item: list[Any], p: Prompt) -> list[Any]:
    """A queue item or history ``prompt`` (``[number, id, prompt, extra_data, outputs]``) as the
    client knows it: its number, its own client_id."""
    if len(item) < 4:
        return item
    out = list(item)
    if p.number is not None:
        out[0] = p.number
    extra = dict(out[3]) if isinstance(out[3], dict) else {}
    if p.client_id is ABSENT:
        extra.pop("client_id", None)
    else:
        extra["client_id"] = p.client_id
    out[3] = extra
    return out


def prompt_id_of(entry: dict[str, Any]) -> str | None:
    """The prompt id a history entry names (its ``prompt``: ``[number, id, …]``)."""
    item = entry.get("prompt")
    return item[1] if isinstance(item, list) and len(item) > 1 and isinstance(item[1], str) else None


def without_traceback(data: dict[str, Any]) -> dict[str, Any]:
    """An ``execution_error`` without the node's traceback: its frames name the node's files and
    code, which clients have no use for (the message and the failing node stay)."""
    return {k: v for k, v in data.items() if k != "traceback"}


#: (node, owner, entry) → the entry with its files under the route's names (comfy_store.py)
Names = Callable[[str, str, dict[str, Any]], dict[str, Any]]


def entry_as_given(entry: dict[str, Any], p: Prompt | None, names: Names | None = None) -> dict[str, Any]:
    """A history entry as the client knows its prompt (``p``, when it is in the record): its
    number and client id, its files under the route's ``names`` (what ``/view`` serves), without
    tracebacks."""
    if p is not None and names is not None:
        entry = names(p.node, p.subject, entry)
    item = entry.get("prompt")
    out = {**entry, "prompt": as_given(item, p)} if isinstance(item, list) and p is not None else dict(entry)
    status = entry.get("status")
    messages = status.get("messages") if isinstance(status, dict) else None
    if isinstance(status, dict) and isinstance(messages, list):
        out["status"] = {**status, "messages": [
            [m[0], without_traceback(m[1])] if isinstance(m, list) and len(m) == 2 and isinstance(m[1], dict) else m
            for m in messages]}
    return out


def record_of(p: Prompt) -> dict[str, Any]:
    """A waiting prompt as every gateway reads it (cluster/comfylists.py)."""
    rec = {"subject": p.subject, "node": p.node, "number": p.number, "node_number": p.node_number}
    return rec if p.client_id is ABSENT else {**rec, "client_id": p.client_id}


def record_of_queued(q: Queued) -> dict[str, Any]:
    """A prompt in one gateway's own queue as every gateway reads it (cluster/comfylists.py): on
    no node yet (``node`` ""), with its queue item as GET /queue lists it."""
    return {"subject": q.subject, "node": "", "number": q.item[0] if q.item else None, "item": q.item}


def queued_item(rec: dict[str, Any]) -> list[Any] | None:
    """The queue item of a record written by ``record_of_queued`` (None: a prompt on a node)."""
    item = rec.get("item")
    return item if rec.get("node") == "" and isinstance(item, list) and len(item) == 5 else None


def prompt_of(rec: dict[str, Any]) -> Prompt | None:
    """The Prompt a waiting record written by ``record_of`` names (None: not one)."""
    subject, node = rec.get("subject"), rec.get("node")
    if not isinstance(subject, str) or not isinstance(node, str):
        return None
    number, node_number = rec.get("number"), rec.get("node_number")
    return Prompt(subject, node, number if isinstance(number, (int, float)) else None, rec.get("client_id", ABSENT),
                  node_number=node_number if isinstance(node_number, (int, float)) else None)
