"""Jobs anywhere: the cluster ``JobStore``, an sse/async job's state, events and result in Redis.

Every gateway of one ``key_prefix`` answers ``GET /v1/jobs/{id}`` (events, result, files) and
``DELETE`` for every job: the gateway that runs a job mirrors it into Redis, the others read it
there. A DELETE on another gateway is published to the owner (``P jx:<inst>``), which cancels it.

Events are one Redis stream per job whose entry ids are the event ids (``0-<n>``): a replay from
``Last-Event-ID`` is one XREAD from that id, and the live follow is the same XREAD, blocking — no
gap and no duplicate between the replay and the live events, which a pub/sub channel (fire and
forget, nothing kept) could not give without a second, racing read of the log.

A job whose gateway dies is carried on by another: each gateway runs the ``CLAIM`` script every
``lease_ttl_sec / 3``; it takes, atomically, the active jobs of every gateway whose lease heartbeat
is gone (the same verdict that reaps its leases, kilolined/cluster/scripts.py), so exactly one
gateway adopts each job. A waiting job's ticket is kept in the queue by the reaper and passes to
the adopter with its place; a running one is queued again (``rerouted``, reason ``gateway_lost``).
To run it again the gateway keeps, with the job, the route, method, path, the client's headers
(never its credentials) and body; all of it lives in Redis memory only, like the results.

The keys and the scripts: kilolined/cluster/jobscripts.py. While Redis is down the writes are
dropped and jobs go on locally (degraded); a Redis that came back empty has forgotten the
others' jobs, whose endpoints then answer 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import orjson
import redis.asyncio as aioredis
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from redis.exceptions import NoScriptError, RedisError

from kilolined.adapters.registry import adapter_for
from kilolined.cluster.jobscripts import CLAIM, EVENT, FINISH, FLAG, RESYNC, SAVE, WEBHOOK, WEBHOOK_DONE
from kilolined.cluster.leases import ClusterLeases
from kilolined.core.outcome import Result
from kilolined.modes.call import Call
from kilolined.modes.jobs import TERMINAL, Event, Hook, Job, Jobs
from kilolined.ops.runtime import Runtime
from kilolined.ops.webhooks import WebhookDeliverer
from kilolined.scheduling.queue import Rejected, Ticket
from kilolined.wire.proxy import Exchange
from kilolined.wire.tasks import cancel_all

log = logging.getLogger("kilolined.modes.jobs")
#: never kept in Redis: whoever adopts a job runs it as the key it was admitted for, not by the secret
CREDENTIALS = frozenset(("authorization", "x-api-key", "proxy-authorization", "cookie"))
FOLLOW_BLOCK_MS = 1000  # a remote follower re-checks that its job still exists this often
CANCEL_WAIT_SEC = 5.0
ENDING = ("output_ready", "failed")
# What XREAD answers to a client without decode_responses (both of ours): [[stream, [(id, fields)]]].
# redis-py's own annotation is the union of every protocol and decoding mode.
XRead = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What the forwarder reads of a client request (Exchange.upstream_header_pairs), rebuilt
    from Redis on the gateway that carries a job on."""

    headers: CIMultiDictProxy[str]
    remote: str | None
    scheme: str


def _state(job: Job) -> bytes:
    return orjson.dumps({
        "route": job.route, "label": job.route_label, "kind": job.kind, "key": job.key, "mode": job.mode,
        "token": job.access_token, "callback": job.callback, "base_url": job.base_url,
        "created_at": job.created_at, "started_at": job.started_at, "finished_at": job.finished_at,
        "status": job.status, "node": job.node, "http_status": job.http_status, "error": job.error,
        "queue_wait": job.queue_wait, "duration": job.duration, "position": job.last_position,
        "est": job.last_est, "requeues": job.ticket.requeues,
    })


def _job(job_id: str, st: dict[str, Any]) -> Job:
    job = Job(id=job_id, access_token=st["token"], route=st["route"], route_label=st["label"], kind=st["kind"],
              key=st["key"], mode=st["mode"], ticket=Ticket(0, st["route"], st["key"] or "", 0, 0.0, state="done"),
              callback=st["callback"], base_url=st["base_url"], created_at=st["created_at"])
    job.started_at, job.finished_at, job.status = st["started_at"], st["finished_at"], st["status"]
    job.node, job.http_status, job.error = st["node"], st["http_status"], st["error"]
    job.queue_wait, job.duration = st["queue_wait"], st["duration"]
    job.last_position, job.last_est = st["position"], st["est"]
    job.ticket.requeues = st.get("requeues", 0)
    return job


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class ClusterJobs:
    """The Redis ``JobStore`` (kilolined/modes/jobs.py), beside the cluster lease store it shares a
    connection pool and the instance id with."""

    def __init__(self, rt: Runtime, leases: ClusterLeases):
        self.rt = rt
        self.leases = leases
        self.redis = leases.redis
        self.prefix = leases.prefix
        self.inst = leases.inst
        self.jobs: Jobs | None = None
        self._ops: list[tuple[str, list[Any]]] = []  # writes not yet sent, in order: (script, ARGV)
        self._waiters: list[asyncio.Future[None]] = []
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        #: this gateway's unfinished jobs — and those that ended while Redis was unreachable — with
        #: their request (the body is the Exchange's own bytes): what RESYNC writes again
        self._mine: dict[str, tuple[Job, bytes, bytes]] = {}
        #: webhooks of jobs that ended while Redis was unreachable, sent once it answers (by job id)
        self._unsent: dict[str, tuple[Job, Hook, WebhookDeliverer]] = {}
        #: webhooks delivered whose end (WEBHOOK_DONE) Redis has not confirmed: written until it does,
        #: or another gateway would send them again once this one is gone
        self._delivered: set[str] = set()
        #: webhooks whose claim (WEBHOOK) is queued or in flight with the writer, by job id
        self._hook_claims: dict[str, tuple[Job, Hook, WebhookDeliverer]] = {}
        self._scripts: dict[str, Any] = {name: self.redis.register_script(src) for name, src in
                                         (("SAVE", SAVE), ("EVENT", EVENT), ("FLAG", FLAG), ("FINISH", FINISH),
                                          ("CLAIM", CLAIM), ("RESYNC", RESYNC), ("WEBHOOK", WEBHOOK),
                                          ("WEBHOOK_DONE", WEBHOOK_DONE))}
        # Blocking reads of remote followers get their own connections: they must never hold the
        # bounded pool the admissions use.
        self._follow = aioredis.Redis.from_url(leases.cfg.redis_url, socket_timeout=FOLLOW_BLOCK_MS / 1000 + 2,
                                               socket_connect_timeout=2)

    @property
    def up(self) -> bool:
        return self.leases.view.redis_up

    # --- lifecycle ------------------------------------------------------------------------
    def attach(self, jobs: Jobs) -> None:
        self.jobs = jobs

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._spawn(self._writer())
        self._spawn(self._claim_loop())
        self._spawn(self._listen())

    async def stop(self) -> None:
        """Send what is pending (a shutdown's last events), then stop. The jobs still running
        after that (past shutdown_grace_sec) stay the cluster's: another gateway carries them on."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.synced(), timeout=2)
        for _, hook, webhooks in self._unsent.values():
            # Redis never answered again: better twice (same webhook-id) than never
            webhooks.submit(hook.url, hook.payload, msg_id=hook.msg_id)
        self._unsent.clear()
        self._closed = True
        await cancel_all(self._tasks)
        await self._follow.aclose()

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # --- the JobStore calls: mirroring this gateway's jobs -------------------------------
    def created(self, job: Job, call: Call, ex: Exchange, priority: int) -> None:
        req = call.request
        t = job.ticket
        spec = orjson.dumps({
            "route": t.route, "subject": t.key, "priority": priority, "pinned": t.pinned_node, "cost": t.cost,
            "model": t.model, "method": ex.method, "tail": ex.tail, "request_id": ex.request_id,
            "client_ip": ex.client_ip, "trusted_peer": ex.trusted_peer,
            "remote": req.remote, "scheme": req.scheme,
            "headers": [[k, v] for k, v in req.headers.items() if k.lower() not in CREDENTIALS],
        })
        self._mine[job.id] = (job, spec, ex.body)
        if self.up:
            tid = self.leases.tid_of(t) or ""
            self._op("SAVE", [self.prefix, self.inst, job.id, tid, _state(job), spec, ex.body])

    def emitted(self, job: Job, ev: Event, evicted: int | None) -> None:
        if not self.up or self._closed:
            return  # an ending is written by RESYNC once Redis is back (the job stays in _mine)
        eid, name, frame = ev
        state = _state(job)
        self._op("EVENT", [self.prefix, self.inst, job.id, eid, name, frame, state, "" if evicted is None else evicted])
        if name in ENDING:
            self._finished(job)

    def _finished(self, job: Job) -> None:
        cfg = self.rt.cfg.jobs
        res = job.result
        left = (job.finished_at or time.time()) + cfg.result_ttl_sec - time.time()
        args: list[Any] = [self.prefix, self.inst, job.id, max(1, int(left)), int(cfg.max_results_mb * 1024 * 1024)]
        if res is None:
            args += ["0", "", "", "", "[]"]
        else:
            args += ["1", res.http_status, res.content_type, res.body, orjson.dumps(res.files)]
        # The oldest result is the one that finished first, not the one whose write reached Redis
        # first (two gateways' writers race).
        args.append(int((job.finished_at or time.time()) * 1000))
        self._op("FINISH", args)

    def _op(self, script: str, args: list[Any]) -> bool:
        """Queue a write for the writer; False: not queued (degraded: the job goes on here alone)."""
        if not self.up or self._wake is None or self._closed:
            return False
        self._ops.append((script, args))
        self._wake.set()
        return True

    async def synced(self) -> None:
        if not self._ops or self._wake is None:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._wake.set()
        await fut

    async def _writer(self) -> None:
        """One transaction per wake-up: the writes of a burst of events cost one round trip, and
        land whole or not at all (a job's ending with its webhook's claim)."""
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            ops, self._ops = self._ops, []
            waiters, self._waiters = self._waiters, []
            try:
                if ops:
                    self._answered(ops, await self._send(ops))
            except (RedisError, OSError) as e:
                log.warning("cluster jobs: %d writes lost, Redis unreachable (%s)", len(ops), e)
                self._hooks_unanswered(ops, e)
            except Exception as e:
                log.exception("cluster jobs: writer")
                self._hooks_unanswered(ops, e)
            finally:
                for w in waiters:
                    if not w.done():
                        w.set_result(None)

    def _answered(self, ops: list[tuple[str, list[Any]]], results: list[Any]) -> None:
        """What Redis said of each write: a job it does not know (it restarted empty, or the job
        was made while it was down) is written again whole; an ending that landed is done."""
        disowned = False
        again: set[str] = set()
        for (name, args), r in zip(ops, results, strict=True):
            if name == "WEBHOOK":
                self._hook_claimed(args[2], r)
            if isinstance(r, Exception):
                log.warning("cluster jobs: a write was refused (%s)", r)
            elif name == "WEBHOOK_DONE":
                self._delivered.discard(args[2])
            elif name in ("EVENT", "FINISH", "RESYNC"):
                job_id = args[2]
                if r == 0 and job_id in self._mine:
                    again.add(job_id)
                elif name == "FINISH" or r == -1:
                    self._mine.pop(job_id, None)
                disowned = disowned or r == -1
        if disowned:
            # This gateway was cut off longer than lease_ttl_sec: another carries its job on;
            # this copy runs out here unseen, and sends no webhook (send_once).
            log.warning("cluster jobs: a job of this gateway is carried on by another now")
        if again:
            self.resync(again)

    def _hooks_unanswered(self, ops: list[tuple[str, list[Any]]], why: Exception) -> None:
        """A batch that never got its answer: its webhook claims are asked again once Redis answers."""
        for name, args in ops:
            if name == "WEBHOOK":
                self._hook_claimed(args[2], why)

    async def _send(self, ops: list[tuple[str, list[Any]]]) -> list[Any]:
        """The scripts by their sha in one transaction; a Redis that lost them (restarted) is given
        them again and the refused ones are sent once more, in their order."""
        results = await self._pipeline(ops)
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            for sc in self._scripts.values():
                await self.redis.script_load(sc.script)
            for i, r in zip(missing, await self._pipeline([ops[i] for i in missing]), strict=True):
                results[i] = r
        return results

    async def _pipeline(self, ops: list[tuple[str, list[Any]]]) -> list[Any]:
        pipe = self.redis.pipeline(transaction=True)
        for name, args in ops:
            pipe.evalsha(self._scripts[name].sha, 0, *args)
        return list(await pipe.execute(raise_on_error=False))

    def send_once(self, job: Job, hook: Hook, webhooks: WebhookDeliverer) -> None:
        if self._closed:
            return  # a job cut by this gateway's shutdown: the gateway that carries it on sends it
        if not self.up:
            # Cut off from Redis, this gateway cannot tell whether another one carries the job
            # on (it does once this one's heartbeat lapsed, and sends the webhook when its copy
            # ends): the webhook waits until Redis answers and says who owns the job.
            self._unsent[job.id] = (job, hook, webhooks)
            return
        self._claim_hook(job, hook, webhooks)

    def _claim_hook(self, job: Job, hook: Hook, webhooks: WebhookDeliverer) -> None:
        """Claim the webhook in the write that ends the job: the job's ending (EVENT, FINISH) was
        queued in this same turn of the loop, and the writer sends a batch as one transaction. A
        claim sent on its own after the ending landed left, at a kill -9 in between, a job ended
        in Redis with nobody's webhook claim: no gateway ever sent it. The delivery starts once
        Redis answered the claim (_hook_claimed)."""
        args = [self.prefix, self.inst, job.id, max(1, int(self.rt.cfg.jobs.result_ttl_sec)), hook.url,
                orjson.dumps(hook.payload), hook.msg_id]
        self._hook_claims[job.id] = (job, hook, webhooks)
        if not self._op("WEBHOOK", args):
            self._hook_claims.pop(job.id, None)
            self._unsent[job.id] = (job, hook, webhooks)

    def _hook_claimed(self, job_id: str, answer: Any) -> None:
        """Redis answered a webhook claim: this gateway sends it (1), another does (0), or it is
        asked again once Redis answers (the claim was refused, or its batch was lost)."""
        held = self._hook_claims.pop(job_id, None)
        if held is None:
            return
        job, hook, webhooks = held
        if isinstance(answer, Exception):
            self._unsent[job_id] = held
        elif answer:
            self._spawn(self._deliver(job_id, hook, webhooks))
        else:
            log.info("job %s: its webhook was sent by another gateway", job.id)

    def _send_unsent(self) -> None:
        """Redis answers again (this gateway's jobs are queued to be written there first)."""
        unsent, self._unsent = self._unsent, {}
        for job, hook, webhooks in unsent.values():
            self._claim_hook(job, hook, webhooks)
        for job_id in self._delivered:  # an end written while Redis did not answer was lost
            self._op("WEBHOOK_DONE", [self.prefix, self.inst, job_id])

    async def _deliver(self, job_id: str, hook: Hook, webhooks: WebhookDeliverer) -> None:
        """Send a claimed webhook; once it is delivered (or its attempts ran out) Redis forgets
        it — until then a gateway that finds this one dead sends it (CLAIM)."""
        await webhooks.deliver(hook.url, hook.payload, msg_id=hook.msg_id)
        self._delivered.add(job_id)
        self._op("WEBHOOK_DONE", [self.prefix, self.inst, job_id])

    async def _resend(self, job_id: str) -> None:
        """A webhook a lost gateway claimed and never delivered: this gateway sends it."""
        url, body, msg = await self.redis.hmget(f"{self.prefix}jwo:{job_id}", "url", "body", "msg")
        if url is None or body is None or msg is None or self.jobs is None:
            return
        log.warning("job %s: its webhook, claimed by a gateway that was lost before it was delivered, "
                    "is sent from here", job_id)
        await self._deliver(job_id, Hook(_s(url), orjson.loads(body), _s(msg)), self.jobs.webhooks)

    # --- reading another gateway's jobs ---------------------------------------------------
    async def load(self, job_id: str) -> Job | None:
        if not self.up:
            return None
        try:
            st, cancel, status, ctype, body, files = cast("list[bytes | None]", await self.redis.hmget(
                f"{self.prefix}j:{job_id}", "st", "cancel", "r_status", "r_ctype", "r_body", "r_files"))
        except (RedisError, OSError):
            return None
        if st is None:
            return None
        job = _job(job_id, orjson.loads(st))
        job.remote = True
        job.cancel_requested = cancel is not None
        if status is not None:
            job.result = Result(int(status), _s(ctype), bytes(body or b""),
                                files=[(n, q) for n, q in orjson.loads(files or b"[]")])
        return job

    async def follow(self, job: Job, after: int) -> AsyncIterator[list[Event]]:
        key = f"{self.prefix}je:{job.id}"
        last = after
        block: int | None = None  # the first read is the replay: it does not wait
        while True:
            try:
                got = cast("XRead | None", await self._follow.xread({key: f"0-{last}"}, block=block))
            except (RedisError, OSError):
                return
            block = FOLLOW_BLOCK_MS
            batch: list[Event] = []
            ended = False
            for _, entries in got or ():
                for eid, fields in entries:
                    n = int(_s(eid).split("-", 1)[1])
                    name = _s(fields[b"e"])
                    batch.append((n, name, bytes(fields[b"f"])))
                    last = max(last, n)
                    ended = ended or name in ENDING
            if batch:
                yield batch
            if ended:
                return
            if not batch:
                # Nothing new: the job may have ended before our first read, or be gone.
                now = await self.load(job.id)
                if now is None or (now.status in TERMINAL and not await self._follow.xread({key: f"0-{last}"})):
                    return

    async def cancel(self, job: Job) -> Job | None:
        key = f"{self.prefix}j:{job.id}"
        try:
            owner = await self.redis.hget(key, "owner")
            await self.redis.hset(key, "cancel", "1")  # an adopter of a lost gateway's job reads this
            if owner is not None:
                await self.redis.publish(f"{self.prefix}jx:{_s(owner)}", job.id)
        except (RedisError, OSError):
            return None
        deadline = time.monotonic() + CANCEL_WAIT_SEC
        while time.monotonic() < deadline:
            now = await self.load(job.id)
            if now is None or now.status in TERMINAL:
                return now
            await asyncio.sleep(0.05)
        return await self.load(job.id)

    async def _listen(self) -> None:
        """DELETEs made on other gateways for jobs this one runs."""
        channel = f"{self.prefix}jx:{self.inst}"
        while True:
            try:
                async with self.redis.pubsub(ignore_subscribe_messages=True) as ps:
                    await ps.subscribe(channel)
                    while True:
                        msg = await ps.get_message(timeout=None)
                        if msg is not None and msg.get("type") == "message" and self.jobs is not None:
                            job = self.jobs.jobs.get(_s(msg["data"]))
                            if job is not None:
                                self.jobs.cancel(job)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError):
                await asyncio.sleep(self.leases.cfg.lease_ttl_sec / 3)
            except Exception:
                log.exception("cluster jobs: cancel listener")
                await asyncio.sleep(1.0)

    # --- carrying on the jobs of a lost gateway -------------------------------------------
    def resync(self, only: set[str] | None = None, ended: bool = False) -> int:
        """This gateway's jobs (or ``only`` these) written to Redis again: after Redis was lost, a
        Redis that came back empty forgot them, one that did not missed their latest events and
        endings. ``ended``: the jobs that ended here before, still held in memory, too (Redis came
        back empty). An ended job leaves ``_mine`` once its FINISH landed."""
        n = 0
        held = [(j, spec, body) for j, spec, body in self._mine.values() if only is None or j.id in only]
        if ended and self.jobs is not None:
            held += [(j, b"", b"") for j in self.jobs.finished.values() if j.id not in self._mine and not j.remote]
        for job, spec, body in held:
            tid = self.leases.tid_of(job.ticket) or ""
            args: list[Any] = [self.prefix, self.inst, job.id, tid, _state(job), spec, body]
            for ev in job.events:
                args += ev
            self._op("RESYNC", args)
            if job.status in TERMINAL:
                self._finished(job)
            n += 1
        return n

    async def _check_back(self, after_outage: bool) -> bool:
        """After an outage, or when Redis forgot this gateway's mark (it restarted empty, maybe
        too fast for the heartbeat to notice): write this gateway's jobs there again."""
        mark = f"{self.prefix}jmark:{self.inst}"
        empty = not await self.redis.exists(mark)
        if empty:
            await self.redis.set(mark, "1")
        if (empty or after_outage) and self.resync(ended=empty):
            log.info("cluster jobs: this gateway's jobs are written to Redis again%s",
                     " (it came back empty)" if empty else "")
        return empty

    def _forget_old(self) -> None:
        """While Redis is down: an ended job is written again only within result_ttl_sec."""
        cutoff = time.time() - self.rt.cfg.jobs.result_ttl_sec
        for job_id, (job, _, _) in list(self._mine.items()):
            if job.status in TERMINAL and (job.finished_at or 0) < cutoff:
                del self._mine[job_id]

    async def _claim_loop(self) -> None:
        ttl = self.leases.cfg.lease_ttl_sec
        up_since: float | None = None
        while True:
            await asyncio.sleep(ttl / 3)
            if not self.up or self.jobs is None or self.rt.shutting_down:
                up_since = None
                self._forget_old()
                continue
            now = self.rt.clock()
            try:
                empty = await self._check_back(after_outage=up_since is None)
            except (RedisError, OSError):
                up_since = None
                continue
            self._send_unsent()
            if up_since is None or empty:
                up_since = now
            if now - up_since < ttl:
                # Just started, or Redis just came back (maybe empty): a live peer may not have
                # renewed its heartbeat yet, though its jobs are written again; they are not ours.
                continue
            try:
                await self.claim()
            except (RedisError, OSError) as e:
                log.warning("cluster jobs: claim failed (%s)", e)
            except Exception:
                log.exception("cluster jobs: claim")

    async def claim(self) -> int:
        """Adopt the jobs of the gateways found lost; how many were adopted."""
        hold = int(self.rt.cfg.jobs.webhook_timeout_sec * 1000)  # an attempt in flight has ended by then
        out = [_s(x) for x in await self._scripts["CLAIM"](args=[self.prefix, self.inst, hold])]
        grants: list[str] = []
        hooks: list[str] = []
        claimed = []
        i = 0
        while i < len(out):
            if out[i] in ("grant", "hook"):
                (grants if out[i] == "grant" else hooks).append(out[i + 1])
                i += 2
            else:
                claimed.append(out[i:i + 5])
                i += 5
        for job_id, how, tid, lid, node in claimed:
            try:
                await self._adopt(job_id, how, tid, lid, node)
            except (RedisError, OSError):
                raise
            except Exception:
                log.exception("job %s: could not be carried on", job_id)
        self.leases.take_grants(grants)
        for job_id in hooks:
            self._spawn(self._resend(job_id))
        return len(claimed)

    async def _adopt(self, job_id: str, how: str, tid: str, lid: str, node: str) -> None:
        """Carry on one claimed job: rebuild it and its request, then its ticket — the kept one
        (``how`` 'w' waiting, 'l' granted meanwhile) or a new one ('n')."""
        assert self.jobs is not None
        rt = self.rt
        pipe = self.redis.pipeline(transaction=False)
        pipe.hmget(f"{self.prefix}j:{job_id}", "st", "spec", "body", "cancel")
        pipe.xrange(f"{self.prefix}je:{job_id}")
        (st_raw, spec_raw, body, cancel), entries = await pipe.execute()
        if st_raw is None or spec_raw is None:
            self._drop_ticket(how, tid, lid, node)
            return
        st, spec = orjson.loads(st_raw), orjson.loads(spec_raw)
        job = _job(job_id, st)
        job.cancel_requested = cancel is not None
        for eid, fields in entries:
            job.events.append((int(_s(eid).split("-", 1)[1]), _s(fields[b"e"]), bytes(fields[b"f"])))
        job.next_id = (job.events[-1][0] + 1) if job.events else 1
        running = job.status == "running"
        log.warning("⚡ job %s: its gateway was lost — carried on here (%s)", job_id,
                    "re-queued" if running else "in its place" if how != "n" else "queued again")
        route = spec["route"]
        rq = rt.scheduler.routes.get(route)
        why = None
        if rq is None:
            why = f"its gateway was lost and route {route} is gone"
        elif running and job.ticket.requeues >= rq.cfg.retry_on_failover:
            why = "the gateway running it was lost (retry_on_failover spent)"
        body = bytes(body or b"")
        head = RequestHead(CIMultiDictProxy(CIMultiDict([(k, v) for k, v in spec["headers"]])),
                           spec["remote"], spec["scheme"])
        # The forwarder reads only headers, remote and scheme of the request (RequestHead).
        ex = Exchange(cast(web.Request, head), spec["method"], spec["tail"], body, spec["request_id"],
                      spec["client_ip"], bool(spec.get("trusted_peer")))
        adapter = adapter_for(job.kind)
        if why is None:
            try:
                adapter.prepare(ex)
            except Rejected as r:
                why = f"its gateway was lost and the request is refused now: {r.message}"
        if why is not None or rq is None:
            self._drop_ticket(how, tid, lid, node)
            self.jobs.fail_carried(job, why or "")
            return
        waited = time.time() - job.created_at
        deadline = rt.clock() + max(1.0, rq.cfg.queue_timeout_sec - waited)
        args = {"pinned_node": spec["pinned"], "cost": spec["cost"], "model": spec.get("model")}
        if how in ("w", "l"):
            ticket = self.leases.carry(tid, route, spec["subject"], spec["priority"], deadline=deadline, **args)
        else:
            ticket = rt.admit(route, spec["subject"], spec["priority"], **args)
            # A running job cut by its gateway's loss is re-queued: at the head, as after a node failure.
            ticket.requeues = job.ticket.requeues + (1 if running else 0)
            if rt.settle is not None:
                try:
                    ticket = await rt.settle(ticket)
                except Rejected as r:
                    self.jobs.fail_carried(job, f"its gateway was lost and it could not queue again: {r.message}")
                    return
            new_tid = self.leases.tid_of(ticket)
            if new_tid is not None:
                self._op("FLAG", [self.prefix, job_id, new_tid])
        ticket.requeues = job.ticket.requeues + (1 if running else 0)
        job.ticket = ticket
        lost = None
        if running:
            lost = (job.node or "-", "gateway_lost")
            job.status, job.node = "queued", None
        self._mine[job_id] = (job, spec_raw, body)
        self.jobs.resume(job, ex, adapter, lost)
        if how == "l":
            self.leases.take_grants([f"{tid} {lid} {node}"])

    def _drop_ticket(self, how: str, tid: str, lid: str, node: str) -> None:
        """A claimed job that will not run here: its kept place or grant goes back."""
        if how == "w":
            self.leases.cancel(self.leases.carry(tid, "", "", 0, pinned_node=None, cost=0.0, deadline=0.0))
        elif how == "l":
            self.leases.take_grants([f"{tid} {lid} {node}"])  # a grant nobody here waits for is given back
