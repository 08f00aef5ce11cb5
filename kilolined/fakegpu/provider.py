"""`kilolined fakegpu --provider vastai|runpod`: a fake GPU market on loopback (docs/BACKENDS.md,
"Fake providers").

Its instances are simulated cards (`FakeGPU`) it starts itself, in this process, on free loopback
ports: an instance is `loading` for `boot_sec`, then its card listens and it is `running`; a
reclaim (`POST /_fake/reclaim/{id}`) stops the card and leaves the instance `exited`, as a spot
host taking its GPU back does. A stop (the provider's own API) stops the card and keeps the
instance `stopped`, unbilled, on its machine; a resume serves again after `resume_sec` (the model
is still on the disk, so no boot time). This module holds the market (offers, instances, spend, injected
failures) and the `/_fake/*` test routes; each provider's own wire format is a `Wire` in
`provider_vastai.py` or `provider_runpod.py`, which import this module and never the reverse.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aiohttp import web

from kilolined.fakegpu import KINDS, FakeGPU
from kilolined.fakegpu.base import is_int, is_number, is_status, read_json, serve_until_signal

log = logging.getLogger("kilolined.fakegpu.provider")

# The API calls an injected failure can target (POST /_fake/fail {"op": ...}); each wire maps its
# routes or GraphQL fields onto them. They are the gateway's provider interface, one for one.
OPS = ("search", "create", "status", "list", "destroy", "label", "stop", "resume")
LIVE = ("loading", "running")  # states that are billed
# Images whose name says which API the container serves; anything else gets the --kind default.
IMAGE_KINDS = (("comfy", "comfyui"), ("openai", "openai"), ("llama", "openai"), ("vllm", "openai"),
               ("ollama", "openai"), ("sglang", "openai"), ("text-generation", "openai"))
DEFAULT_PORTS = {"comfyui": 8188, "openai": 8000, "generic": 8080}


@dataclass(frozen=True)
class Offer:
    """One rentable machine. `dph_total` is the on-demand price per hour, `min_bid` the lowest
    interruptible (spot) bid it takes; both are for the whole machine (`num_gpus` cards)."""

    id: int
    machine_id: int
    gpu_name: str
    dph_total: float
    min_bid: float
    num_gpus: int = 1
    reliability: float = 0.99
    gpu_ram_gb: float = 24.0
    gpu_type_id: str = ""  # RunPod's GPU type id; default "NVIDIA <gpu_name>"
    geolocation: str = "Loopback, LO"

    @property
    def runpod_type(self) -> str:
        return self.gpu_type_id or f"NVIDIA {self.gpu_name}"


DEFAULT_OFFERS = (
    Offer(1001, 501, "RTX 4090", 0.40, 0.25, reliability=0.995, gpu_type_id="NVIDIA GeForce RTX 4090"),
    Offer(1002, 502, "RTX 4090", 0.42, 0.26, reliability=0.99, gpu_type_id="NVIDIA GeForce RTX 4090"),
    Offer(1003, 503, "RTX 4090", 0.44, 0.28, reliability=0.98, gpu_type_id="NVIDIA GeForce RTX 4090"),
    Offer(1004, 504, "RTX 4090", 0.38, 0.22, reliability=0.95, gpu_type_id="NVIDIA GeForce RTX 4090"),
    Offer(1005, 505, "RTX 3090", 0.22, 0.12, reliability=0.99, gpu_type_id="NVIDIA GeForce RTX 3090"),
    Offer(1006, 506, "RTX 3090", 0.24, 0.13, reliability=0.985, gpu_type_id="NVIDIA GeForce RTX 3090"),
    Offer(1007, 507, "A100 SXM4", 1.10, 0.70, reliability=0.995, gpu_ram_gb=80.0,
          gpu_type_id="NVIDIA A100-SXM4-80GB"),
)

_OFFER_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "id": (lambda v: is_int(v) and v > 0, "an int > 0"),
    "machine_id": (lambda v: is_int(v) and v > 0, "an int > 0"),
    "gpu_name": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "dph_total": (lambda v: is_number(v) and v > 0, "a number > 0"),
    "min_bid": (lambda v: is_number(v) and v > 0, "a number > 0"),
    "num_gpus": (lambda v: is_int(v) and v >= 1, "an int >= 1"),
    "reliability": (lambda v: is_number(v) and 0 <= v <= 1, "a number from 0 to 1"),
    "gpu_ram_gb": (lambda v: is_number(v) and v > 0, "a number > 0"),
    "gpu_type_id": (lambda v: isinstance(v, str), "a string"),
    "geolocation": (lambda v: isinstance(v, str), "a string"),
}
_OFFER_REQUIRED = ("id", "machine_id", "gpu_name", "dph_total")


def parse_offers(data: Any) -> list[Offer]:
    """Offers from JSON (a list of objects, `min_bid` defaulting to 60 % of `dph_total`);
    raises ValueError naming every problem."""
    if not isinstance(data, list):
        raise ValueError("offers must be a JSON list of objects")
    problems: list[str] = []
    offers: list[Offer] = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            problems.append(f"offers[{i}]: must be an object")
            continue
        bad = [f"offers[{i}].{k}: missing" for k in _OFFER_REQUIRED if k not in item]
        for key, value in item.items():
            check = _OFFER_FIELDS.get(key)
            if check is None:
                bad.append(f"offers[{i}].{key}: unknown field")
            elif not check[0](value):
                bad.append(f"offers[{i}].{key}: must be {check[1]}")
        if bad:
            problems.extend(bad)
            continue
        values = dict(item)
        values.setdefault("min_bid", round(float(item["dph_total"]) * 0.6, 4))
        offers.append(Offer(**values))
    ids = [o.id for o in offers]
    problems.extend(f"offers: id {i} appears twice" for i in sorted({i for i in ids if ids.count(i) > 1}))
    if problems:
        raise ValueError("; ".join(problems))
    return offers


def load_offers(path: str | None) -> list[Offer]:
    if path is None:
        return list(DEFAULT_OFFERS)
    return parse_offers(json.loads(Path(path).read_text()))


def kind_for(image: str, env: Mapping[str, str], default: str) -> str:
    """The simulated API an instance serves: env FAKEGPU_KIND, else a hint in the image name
    (IMAGE_KINDS), else `default`."""
    explicit = env.get("FAKEGPU_KIND", "")
    if explicit in KINDS:
        return explicit
    lowered = image.lower()
    return next((kind for hint, kind in IMAGE_KINDS if hint in lowered), default)


@dataclass(eq=False)
class Instance:
    """A rented machine. `status`: loading → running → exited (reclaimed) or stopped (by its
    renter; loading again on a resume); destroyed at the end."""

    id: str
    offer: Offer
    image: str
    label: str
    env: dict[str, str]
    ports: list[tuple[int, str]]  # container ports (port, "tcp"|"http") all mapped to the card's port
    price: float  # per hour, what the renter pays
    interruptible: bool
    kind: str
    created_at: float = field(default_factory=time.time)
    status: str = "loading"
    ready_at: float | None = None
    ended_at: float | None = None
    card: FakeGPU | None = None
    boot: asyncio.Task[None] | None = None
    partitioned: bool = False  # the card is cut off (POST /_fake/partition/{id}) while still running

    @property
    def host_port(self) -> int | None:
        return self.card.port if self.card is not None and self.status == "running" else None

    def view(self) -> dict[str, Any]:
        """The row of GET /_fake/instances."""
        return {
            "id": self.id, "offer_id": self.offer.id, "machine_id": self.offer.machine_id,
            "gpu_name": self.offer.gpu_name, "label": self.label, "image": self.image, "kind": self.kind,
            "status": self.status, "partitioned": self.partitioned, "price_per_hour": self.price,
            "interruptible": self.interruptible,
            "port": self.host_port, "url": self.card.url if self.host_port is not None and self.card else None,
            "created_at": self.created_at, "ready_at": self.ready_at, "ended_at": self.ended_at,
        }


@dataclass
class FailPlan:
    """Injected API failures: the next `count` calls (None: until cleared) of `op` (None: any)
    answer `status`, with `Retry-After: retry_after` when set."""

    status: int = 429
    count: int | None = 1
    retry_after: float | None = None
    op: str | None = None


def parse_fail(data: Any) -> FailPlan:
    if not isinstance(data, dict):
        raise ValueError("body must be a JSON object")
    checks: dict[str, tuple[Callable[[Any], bool], str]] = {
        "status": (lambda v: is_status(v) and v >= 400, "an HTTP status code >= 400"),
        "count": (lambda v: v is None or (is_int(v) and v >= 1), "an int >= 1 or null (until cleared)"),
        "retry_after": (lambda v: v is None or (is_number(v) and v >= 0), "a number >= 0 or null"),
        "op": (lambda v: v is None or v in OPS, f"null or one of {', '.join(OPS)}"),
    }
    problems = [f"{k}: unknown field" if k not in checks else f"{k}: must be {checks[k][1]}"
                for k, v in data.items() if k not in checks or not checks[k][0](v)]
    if problems:
        raise ValueError("; ".join(problems))
    return replace(FailPlan(), **data)


def retry_after_header(seconds: float) -> str:
    """Whole seconds as an int (RFC 9110's delay-seconds); a fraction kept for quick tests."""
    return str(int(seconds)) if float(seconds).is_integer() else repr(float(seconds))


class Wire:
    """One provider's API on the fake market: its routes, ids and error bodies."""

    name = ""

    def instance_id(self, n: int) -> str:
        """The id the provider gives its n-th instance (1-based)."""
        raise NotImplementedError

    def add_routes(self, app: web.Application, market: FakeProvider) -> None:
        raise NotImplementedError

    def error(self, status: int, message: str) -> web.Response:
        raise NotImplementedError


class FakeProvider:
    """The fake market: offers, instances and their cards, spend, injected failures, `/_fake/*`."""

    def __init__(self, wire: Wire, *, offers: Iterable[Offer] = DEFAULT_OFFERS, api_key: str | None = None,
                 boot_sec: float = 5.0, host: str = "127.0.0.1", port: int = 0, default_kind: str = "generic",
                 card_options: Mapping[str, Any] | None = None, resume_sec: float = 5.0) -> None:
        if not (is_number(boot_sec) and boot_sec >= 0):
            raise ValueError("boot_sec must be a number >= 0")
        if not (is_number(resume_sec) and resume_sec >= 0):
            raise ValueError("resume_sec must be a number >= 0")
        if default_kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {default_kind!r}")
        self.wire = wire
        self.offers = list(offers)
        self.api_key = api_key or None
        self.boot_sec = float(boot_sec)
        self.resume_sec = float(resume_sec)
        self.host = host
        self.port = port
        self.default_kind = default_kind
        self.card_options = dict(card_options or {})
        self.instances: dict[str, Instance] = {}  # every instance ever created, destroyed ones too
        self.calls: dict[str, int] = dict.fromkeys(OPS, 0)
        self.failed_calls: dict[str, int] = dict.fromkeys(OPS, 0)
        self.fail_plan: FailPlan | None = None
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ----------------------------------------------------------------- the market

    def rented_offer_ids(self) -> set[int]:
        """An offer is taken from creation until its instance is destroyed (a reclaimed machine
        is not rentable again until the renter lets it go)."""
        return {i.offer.id for i in self.instances.values() if i.status != "destroyed"}

    def available(self) -> list[Offer]:
        taken = self.rented_offer_ids()
        return [o for o in self.offers if o.id not in taken]

    def offer(self, offer_id: int) -> Offer | None:
        return next((o for o in self.offers if o.id == offer_id), None)

    def live(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.status != "destroyed"]

    def spend_per_hour(self) -> float:
        return round(sum(i.price for i in self.instances.values() if i.status in LIVE), 6)

    def rent(self, offer: Offer, *, image: str, label: str, env: Mapping[str, str],
             ports: list[tuple[int, str]], price: float, interruptible: bool) -> Instance:
        """Create an instance on `offer` (the caller checked it is available) and start its boot."""
        kind = kind_for(image, env, self.default_kind)
        if not ports:
            ports = [(int(env["PORT"]), "tcp")] if env.get("PORT", "").isdigit() else [(DEFAULT_PORTS[kind], "tcp")]
        inst = Instance(self.wire.instance_id(len(self.instances) + 1), offer, image, label, dict(env), ports,
                        round(price, 6), interruptible, kind)
        self.instances[inst.id] = inst
        inst.boot = asyncio.get_running_loop().create_task(self._boot(inst, self.boot_sec), name=f"fake-boot-{inst.id}")
        log.info("fake %s: instance %s on machine %d (%s, %s), %.4f/h", self.wire.name, inst.id,
                 offer.machine_id, offer.gpu_name, kind, inst.price)
        return inst

    async def _boot(self, inst: Instance, boot_sec: float) -> None:
        await asyncio.sleep(boot_sec)
        options = dict(self.card_options)
        if inst.env.get("FAKEGPU_API_KEY"):
            options["api_key"] = inst.env["FAKEGPU_API_KEY"]
        # Recorded before it starts, so a reclaim that cancels the start still stops the card.
        inst.card = FakeGPU(inst.kind, host=self.host, port=0, **options)
        await inst.card.start()
        inst.status, inst.ready_at = "running", time.time()

    async def _end(self, inst: Instance, status: str) -> None:
        if inst.status in (status, "destroyed"):
            return
        inst.status = status
        inst.ended_at = inst.ended_at or time.time()
        if inst.boot is not None and not inst.boot.done():
            inst.boot.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await inst.boot
        if inst.card is not None:
            await inst.card.stop()

    async def reclaim(self, inst: Instance) -> None:
        """The host takes its GPU back: the card stops answering, the instance is exited."""
        await self._end(inst, "exited")

    async def destroy(self, inst: Instance) -> None:
        await self._end(inst, "destroyed")

    async def stop_instance(self, inst: Instance) -> None:
        """The renter stops it: the card goes, the machine (and its disk) stays the renter's."""
        await self._end(inst, "stopped")

    def resume(self, inst: Instance) -> None:
        """A stopped (or reclaimed) instance starts again on its machine: `loading` for
        `resume_sec`, then a card answers (on a new port, as a provider may map a new one)."""
        if inst.status in LIVE:
            return
        inst.status, inst.ended_at, inst.card = "loading", None, None
        inst.boot = asyncio.get_running_loop().create_task(self._boot(inst, self.resume_sec),
                                                           name=f"fake-resume-{inst.id}")

    def take_failure(self, op: str) -> FailPlan | None:
        """Count the call; the injected failure it must answer with, if any."""
        self.calls[op] += 1
        plan = self.fail_plan
        if plan is None or (plan.op is not None and plan.op != op):
            return None
        if plan.count is not None:
            plan.count -= 1
            if plan.count <= 0:
                self.fail_plan = None
        self.failed_calls[op] += 1
        return plan

    # ----------------------------------------------------------------- HTTP

    def authorized(self, request: web.Request) -> bool:
        """`Authorization: Bearer <key>` (both clients) or `?api_key=<key>` (RunPod's documented
        form, older Vast clients); any key when the fake was started without one."""
        if self.api_key is None:
            return True
        header = request.headers.get("Authorization", "")
        given = header[7:] if header.startswith("Bearer ") else request.query.get("api_key", "")
        return hmac.compare_digest(given.encode(), self.api_key.encode())

    def failure_response(self, op: str) -> web.Response | None:
        plan = self.take_failure(op)
        if plan is None:
            return None
        resp = self.wire.error(plan.status, f"injected failure ({plan.status}) on {op}")
        if plan.retry_after is not None:
            resp.headers["Retry-After"] = retry_after_header(plan.retry_after)
        return resp

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=1024**2)
        app.router.add_get("/_fake/instances", self._h_instances)
        app.router.add_post("/_fake/reclaim/{id}", self._h_reclaim)
        app.router.add_post("/_fake/partition/{id}", self._h_partition)
        app.router.add_post("/_fake/heal/{id}", self._h_heal)
        app.router.add_post("/_fake/control", self._h_control)
        app.router.add_post("/_fake/fail", self._h_fail)
        app.router.add_delete("/_fake/fail", self._h_fail_clear)
        app.router.add_get("/_fake/offers", self._h_offers)
        app.router.add_put("/_fake/offers", self._h_set_offers)
        self.wire.add_routes(app, self)
        return app

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("the fake provider is already started")
        runner = web.AppRunner(self.build_app(), access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        if self.port == 0:
            self.port = int(runner.addresses[-1][1])

    async def stop(self) -> None:
        """Close the API and every card (the instances' records stay readable)."""
        for inst in list(self.instances.values()):
            await self._end(inst, "exited")
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def _find(self, request: web.Request) -> Instance | None:
        return self.instances.get(request.match_info["id"])

    async def _h_instances(self, request: web.Request) -> web.Response:
        return web.json_response({"provider": self.wire.name,
                                  "instances": [i.view() for i in self.instances.values()],
                                  "spend_per_hour": self.spend_per_hour(),
                                  "calls": self.calls, "failed_calls": self.failed_calls})

    async def _h_reclaim(self, request: web.Request) -> web.Response:
        inst = self._find(request)
        if inst is None:
            return web.json_response({"error": f"no instance {request.match_info['id']}"}, status=404)
        if inst.status == "destroyed":
            return web.json_response({"error": f"instance {inst.id} is destroyed"}, status=409)
        await self.reclaim(inst)
        return web.json_response(inst.view())

    async def _h_partition(self, request: web.Request) -> web.Response:
        """The network to a running card is cut: it stops answering, yet the provider still says
        running (a node that only lost the network, which the fleet must not replace)."""
        inst = self._find(request)
        if inst is None or inst.status != "running" or inst.card is None:
            return web.json_response({"error": f"no running instance {request.match_info['id']}"}, status=409)
        await inst.card.kill()
        inst.partitioned = True
        return web.json_response(inst.view())

    async def _h_heal(self, request: web.Request) -> web.Response:
        inst = self._find(request)
        if inst is None or not inst.partitioned or inst.card is None or inst.status != "running":
            return web.json_response({"error": f"no partitioned instance {request.match_info['id']}"}, status=409)
        await inst.card.revive()
        inst.partitioned = False
        return web.json_response(inst.view())

    async def _h_control(self, request: web.Request) -> web.Response:
        """`{"boot_sec": n, "resume_sec": n}`: the boot (resume) time of the instances created
        (resumed) from now on."""
        try:
            data = await read_json(request)
        except ValueError:
            data = None
        if not isinstance(data, dict) or set(data) - {"boot_sec", "resume_sec"}:
            return web.json_response({"error": "body must be {\"boot_sec\"?: number >= 0, "
                                               "\"resume_sec\"?: number >= 0}"}, status=400)
        for key in ("boot_sec", "resume_sec"):
            if key in data and not (is_number(data[key]) and data[key] >= 0):
                return web.json_response({"error": f"{key}: must be a number >= 0"}, status=400)
        self.boot_sec = float(data.get("boot_sec", self.boot_sec))
        self.resume_sec = float(data.get("resume_sec", self.resume_sec))
        return web.json_response({"boot_sec": self.boot_sec, "resume_sec": self.resume_sec})

    async def _h_fail(self, request: web.Request) -> web.Response:
        try:
            plan = parse_fail(await read_json(request) or {})
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.fail_plan = plan
        return web.json_response({"status": plan.status, "count": plan.count, "retry_after": plan.retry_after,
                                  "op": plan.op})

    async def _h_fail_clear(self, request: web.Request) -> web.Response:
        self.fail_plan = None
        return web.json_response({"cleared": True})

    async def _h_offers(self, request: web.Request) -> web.Response:
        taken = self.rented_offer_ids()
        return web.json_response({"offers": [{**o.__dict__, "rented": o.id in taken} for o in self.offers]})

    async def _h_set_offers(self, request: web.Request) -> web.Response:
        try:
            self.offers = parse_offers(await read_json(request))
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return await self._h_offers(request)


def run_provider(wire: Wire, *, host: str, port: int, offers_path: str | None, api_key: str | None,
                 boot_sec: float, default_kind: str, card_options: Mapping[str, Any],
                 resume_sec: float = 5.0) -> int:
    """Serve until Ctrl-C or SIGTERM (for `kilolined fakegpu --provider`); returns the exit code."""
    try:
        provider = FakeProvider(wire, offers=load_offers(offers_path), api_key=api_key, boot_sec=boot_sec,
                                host=host, port=port, default_kind=default_kind, card_options=card_options,
                                resume_sec=resume_sec)
        FakeGPU(default_kind, **card_options)  # the card options are checked now, not at the first boot
    except (OSError, ValueError) as exc:
        print(f"fakegpu: {exc}", file=sys.stderr)
        return 2
    return serve_until_signal(provider, f"fakegpu provider {provider.wire.name}")
