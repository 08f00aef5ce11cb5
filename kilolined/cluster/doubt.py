"""Reaped slots in doubt: the leader asks their nodes whether they are free (docs/CLUSTER.md).

A gateway frozen past ``lease_ttl_sec`` (or killed) is reaped, but its requests may still run on
the nodes. Its leases stay counted in Redis, *in doubt* (kilolined/cluster/scripts.py ``doubt``),
until their route's ``request_timeout_sec`` since the grant has passed (the scripts' ``reap``) or
the node itself shows the slots free, which this check asks where the server can tell:

- ComfyUI ``GET /queue``: every prompt in ``queue_running`` and ``queue_pending`` holds a slot
  (a pending one runs next);
- llama.cpp ``GET /slots``: the slots with ``is_processing`` (older builds: ``state`` != 0);
- vLLM, SGLang and TGI ``GET /metrics`` (Prometheus text): what they run plus what they queue
  (a queued request runs next, as ComfyUI's pending prompt), see ``SERVER_METRICS``;
- any other server where ``nodes.<n>.busy`` says: a JSON number or a metric.

A node that answers none of these (a generic node without ``busy``, a llama.cpp started with
``--no-slots``, a vLLM with its stats off) cannot tell, so its slots wait for the timeout. The
probes are pure (body in, count out); ``DoubtCheck`` runs one round every ``lease_ttl_sec / 3``
on the leader.

Which slots in doubt are free (``keep``, one round for each node with leases in doubt):

1. read S1, the live leases on the node (held by gateways alive in Redis) marked *sent* — their
   gateway wrote the request to the node (``Lease.sent``) — and D, the leases in doubt there;
2. ask the node its count C (what it runs plus what it has queued);
3. read S2, the live leases on the node.

Each lease in S1 ∩ S2 had its request on the node before the probe and was still held after it,
so its request was on the node all through the probe and C counts it. The leases in D were in
doubt before the probe (a lease in doubt never comes back to life), so none of them is in S1 ∩ S2
and each is counted by C only if its request still ran. Hence at most C − |S1 ∩ S2| of D ran at
the probe, and a request that had ended cannot start again: all of D but that many can be freed
at once, whatever the leases' ages — turnover faster than a round does not hide anything. The
edge cases: a lease that ended between its mark and the probe is not in S2, so it is not
subtracted (C does not count it either); a lease granted but not yet sent is not in S1, so it is
not subtracted, though C may count it (the bound only grows: safe); a node that queues requests
counts them in C (vLLM's waiting, ComfyUI's pending), as it counts those it runs; a lease that
went into doubt after step 1 is not in D and waits for the next round; a probe that fails frees
nothing. It rests on the node counting a request from when it is written to it until its answer
has reached the gateway; a server's count lags that by moments (an engine step before vLLM's
gauge shows a new request, the last bytes in flight after it ends), the only time it may run
more than N.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from redis.exceptions import RedisError

from kilolined.cluster.leases import ClusterLeases
from kilolined.core.config import BusyConfig
from kilolined.scheduling.costs import json_pointer
from kilolined.wire.tasks import cancel_until_done

log = logging.getLogger("kilolined")

#: Each server's own metrics for the requests it runs and those it has queued (summed over every
#: sample: a data-parallel server has one per engine), read from their sources:
#: - vLLM: ``vllm:num_requests_running`` / ``vllm:num_requests_waiting``, gauges labelled
#:   model_name and engine (vllm-project/vllm vllm/v1/metrics/loggers.py, PrometheusStatLogger,
#:   at commit 005a810bc40f, the v1 engine);
#: - SGLang: ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs``, gauges
#:   (sgl-project/sglang python/sglang/srt/metrics/collector.py, SchedulerMetricsCollector, at
#:   commit 00ae9c1590d2; served with ``--enable-metrics``);
#: - TGI: ``tgi_batch_current_size`` / ``tgi_queue_size``, gauges (huggingface/text-generation-
#:   inference backends/v3/src/backend.rs and queue.rs, described in router/src/server.rs, at
#:   3.3.6-dev0, commit db931fcf42da).
SERVER_METRICS = (
    ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
    ("tgi_batch_current_size", "tgi_queue_size"),
)


@dataclass(frozen=True)
class Probe:
    """One way a node shows what it runs: GET ``path``; ``read`` counts it (None: nothing usable)."""

    path: str
    read: Callable[[bytes], int | None]


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def comfy_queue(body: bytes) -> int | None:
    q = _json(body)
    if not isinstance(q, dict):
        return None
    running, pending = q.get("queue_running"), q.get("queue_pending")
    if not isinstance(running, list) or not isinstance(pending, list):
        return None
    return len(running) + len(pending)


def llama_slots(body: bytes) -> int | None:
    slots = _json(body)
    if not isinstance(slots, list):
        return None  # --no-slots answers an error object
    busy = 0
    for slot in slots:
        if not isinstance(slot, dict):
            return None
        if "is_processing" in slot:
            busy += bool(slot["is_processing"])
        elif "state" in slot:
            busy += slot["state"] != 0
        else:
            return None
    return busy


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text exposition: each metric name -> the sum of its samples' values."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, rest = _split_sample(line)
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def _split_sample(line: str) -> tuple[str, str]:
    """(name, what follows its labels): a label value may hold spaces, braces and \" escapes."""
    brace = line.find("{")
    space = min((i for i in (line.find(" "), line.find("\t")) if i >= 0), default=-1)
    if brace < 0 or (0 <= space < brace):
        return (line[:space], line[space:]) if space >= 0 else (line, "")
    quoted, i = False, brace + 1
    while i < len(line):
        c = line[i]
        if c == "\\" and quoted:
            i += 2
            continue
        if c == '"':
            quoted = not quoted
        elif c == "}" and not quoted:
            return line[:brace], line[i + 1:]
        i += 1
    return "", ""


def server_metrics(body: bytes) -> int | None:
    """vLLM's, SGLang's or TGI's own count of what it runs and queues (SERVER_METRICS)."""
    samples = metric_samples(body.decode("utf-8", "replace"))
    for running, queued in SERVER_METRICS:
        if running in samples:
            return round(samples[running] + samples.get(queued, 0.0))
    return None


def custom_probe(busy: BusyConfig) -> Probe:
    """``nodes.<n>.busy``: the number at ``json_pointer`` (an array: its length) or a metric's sum."""
    metric, pointer = busy.metric, busy.json_pointer

    def read(body: bytes) -> int | None:
        if metric is not None:
            samples = metric_samples(body.decode("utf-8", "replace"))
            return round(samples[metric]) if metric in samples else None
        assert pointer is not None
        found, v = json_pointer(_json(body), pointer)
        if not found or isinstance(v, bool):
            return None
        if isinstance(v, list):
            return len(v)
        return round(v) if isinstance(v, int | float) and v >= 0 else None

    return Probe(busy.path, read)


COMFY = Probe("/queue", comfy_queue)
SLOTS = Probe("/slots", llama_slots)
METRICS = Probe("/metrics", server_metrics)


def probes(kind: str | None, busy: BusyConfig | None) -> list[Probe]:
    """What to ask a node of this route kind, in order; the first that counts answers."""
    if busy is not None:
        return [custom_probe(busy)]
    if kind == "comfyui":
        return [COMFY]
    if kind == "openai":
        return [SLOTS, METRICS]  # llama.cpp; else vLLM or SGLang
    return [METRICS]  # TGI's own API is a generic route


def may_run(busy: int, before: dict[str, bool], after: dict[str, bool]) -> int:
    """How many leases in doubt may still run on a node that counted ``busy``, given its live
    leases read before and after the probe ({lease: sent}): ``busy`` minus those sent before the
    probe and still live after it (the module's docstring proves it)."""
    through = sum(1 for lid, sent in before.items() if sent and lid in after)
    return max(0, busy - through)


class DoubtCheck:
    """The leader's round: the nodes with leases in doubt are asked what they run."""

    def __init__(self, leases: ClusterLeases, *, probes_of: Callable[[str], list[Probe]],
                 fetch: Callable[[str, str], Awaitable[bytes]], leader: Callable[[], bool], every_sec: float):
        self.leases = leases
        self.probes_of = probes_of  # node -> what to ask it (probes(), by its route kind and config)
        self.fetch = fetch  # (node, path) -> the body of a 2xx; raises when it does not answer
        self.leader = leader
        self.every_sec = every_sec
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
                pass  # the heartbeat notices a lost Redis
            except Exception:
                log.exception("cluster: node check of slots in doubt")

    async def round(self) -> None:
        if not self.leader() or not self.leases.view.redis_up:
            return
        for node in await self.leases.in_doubt():
            before, held = await self.leases.on_node(node)
            if not held:
                continue
            busy = await self._busy(node)
            if busy is None:
                continue  # a node that does not tell frees nothing
            after, _ = await self.leases.on_node(node)
            freed = await self.leases.free_doubt(node, may_run(busy, before, after), held)
            if freed:
                log.info("cluster: node %s shows %d reaped slot(s) free: granted again", node, freed)

    async def _busy(self, node: str) -> int | None:
        for probe in self.probes_of(node):
            try:
                body = await self.fetch(node, probe.path)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a node that does not answer shows nothing free
                log.debug("cluster: %s %s unreadable (%s)", node, probe.path, type(e).__name__)
                continue
            busy = probe.read(body)
            if busy is not None:
                return busy
        return None
