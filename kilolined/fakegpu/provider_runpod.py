"""RunPod's GraphQL API on the fake market, as the official `runpod` client (1.11) speaks it.

`POST /graphql` (`Authorization: Bearer <key>` or `?api_key=`), body `{"query", "variables",
"operationName"}`. The client writes its arguments inline, so this holds a small GraphQL reader
(operations, fields, aliases, arguments, variables; no fragments) and answers only the fields
asked for, as a GraphQL server does. Fields: `gpuTypes`, `pod`, `myself { pods }`,
`podFindAndDeployOnDemand`, `podRentInterruptable`, `podStop`, `podResume`, `podTerminate`
(docs/BACKENDS.md, "Fake providers").
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kilolined.fakegpu.base import is_int, is_number
from kilolined.fakegpu.provider import FakeProvider, Instance, Offer, Wire

NO_CAPACITY = ("There are no longer any instances available with the requested specifications. "
               "Please refresh and try again.")
# Which of the fleet's provider calls each root field is (for counting and injected failures).
FIELD_OPS = {"gpuTypes": "search", "podFindAndDeployOnDemand": "create", "podRentInterruptable": "create",
             "pod": "status", "myself": "list", "podTerminate": "destroy", "podStop": "stop",
             "podResume": "resume"}
DESIRED = {"loading": "RUNNING", "running": "RUNNING", "exited": "EXITED", "stopped": "EXITED",
           "destroyed": "TERMINATED"}


class GraphQLError(ValueError):
    pass


@dataclass
class Selection:
    name: str
    alias: str
    args: dict[str, Any] = field(default_factory=dict)
    fields: list[Selection] | None = None


@dataclass
class Operation:
    kind: str  # "query" | "mutation"
    fields: list[Selection]


# ----------------------------------------------------------------------------- reading GraphQL

_TOKEN = re.compile(r'''
    (?P<skip>[\s,\ufeff]+|\#[^\n]*)
  | (?P<spread>\.\.\.)
  | (?P<punct>[!$():=@\[\]{}|&])
  | (?P<block>"""(?:\\"""|[^"]|"(?!""))*""")
  | (?P<string>"(?:\\.|[^"\\\n])*")
  | (?P<number>-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)
  | (?P<name>[_A-Za-z][_0-9A-Za-z]*)
''', re.VERBOSE)


def tokens(source: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(source):
        m = _TOKEN.match(source, pos)
        if m is None:
            raise GraphQLError(f"Syntax Error: unexpected character {source[pos]!r} at {pos}.")
        kind = m.lastgroup or ""
        if kind != "skip":
            out.append((kind, m.group()))
        pos = m.end()
    return out


class _Reader:
    def __init__(self, source: str, variables: Mapping[str, Any]) -> None:
        self.toks = tokens(source)
        self.pos = 0
        self.variables = dict(variables)

    def peek(self) -> tuple[str, str]:
        return self.toks[self.pos] if self.pos < len(self.toks) else ("eof", "")

    def take(self, value: str | None = None, kind: str | None = None) -> str:
        k, v = self.peek()
        if (value is not None and v != value) or (kind is not None and k != kind) or k == "eof":
            raise GraphQLError(f"Syntax Error: expected {value or kind}, found {v or '<EOF>'!r}.")
        self.pos += 1
        return v

    def at(self, value: str) -> bool:
        return self.peek()[1] == value and self.peek()[0] in ("punct", "spread")

    def operations(self) -> dict[str | None, Operation]:
        ops: dict[str | None, Operation] = {}
        while self.peek()[0] != "eof":
            if self.at("{"):
                ops[None] = Operation("query", self.selection_set())
                continue
            kind = self.take(kind="name")
            if kind not in ("query", "mutation"):
                raise GraphQLError(f"the fake reads query and mutation operations, not {kind!r}")
            name = self.take(kind="name") if self.peek()[0] == "name" else None
            if self.at("("):
                self.variable_definitions()
            self.directives()
            ops[name] = Operation(kind, self.selection_set())
        if not ops:
            raise GraphQLError("Syntax Error: no operation.")
        return ops

    def variable_definitions(self) -> None:
        self.take("(")
        while not self.at(")"):
            self.take("$")
            name = self.take(kind="name")
            self.take(":")
            self.type_ref()
            if self.at("="):
                self.take("=")
                default = self.value()
                self.variables.setdefault(name, default)
            self.directives()
        self.take(")")

    def type_ref(self) -> None:
        if self.at("["):
            self.take("[")
            self.type_ref()
            self.take("]")
        else:
            self.take(kind="name")
        if self.at("!"):
            self.take("!")

    def directives(self) -> None:
        # Read and ignored: the client sends none, and @include/@skip would need the schema's rules.
        while self.at("@"):
            self.take("@")
            self.take(kind="name")
            if self.at("("):
                self.arguments()

    def selection_set(self) -> list[Selection]:
        self.take("{")
        out: list[Selection] = []
        while not self.at("}"):
            if self.at("..."):
                raise GraphQLError("the fake does not read fragments")
            name = self.take(kind="name")
            alias = name
            if self.at(":"):
                self.take(":")
                name = self.take(kind="name")
            args = self.arguments() if self.at("(") else {}
            self.directives()
            fields = self.selection_set() if self.at("{") else None
            out.append(Selection(name, alias, args, fields))
        self.take("}")
        return out

    def arguments(self) -> dict[str, Any]:
        self.take("(")
        args: dict[str, Any] = {}
        while not self.at(")"):
            key = self.take(kind="name")
            self.take(":")
            args[key] = self.value()
        self.take(")")
        return args

    def value(self) -> Any:
        kind, text = self.peek()
        if self.at("$"):
            self.take("$")
            return self.variables.get(self.take(kind="name"))
        if self.at("["):
            self.take("[")
            items = []
            while not self.at("]"):
                items.append(self.value())
            self.take("]")
            return items
        if self.at("{"):
            self.take("{")
            obj: dict[str, Any] = {}
            while not self.at("}"):
                key = self.take(kind="name")
                self.take(":")
                obj[key] = self.value()
            self.take("}")
            return obj
        self.take()
        if kind == "string":
            return json.loads(text)
        if kind == "block":
            return text[3:-3].replace('\\"""', '"""')
        if kind == "number":
            return float(text) if any(c in text for c in ".eE") else int(text)
        if kind == "name":
            return {"true": True, "false": False, "null": None}.get(text, text)  # else an enum value
        raise GraphQLError(f"Syntax Error: unexpected {text!r}.")


def parse(query: str, variables: Mapping[str, Any] | None = None, operation: str | None = None) -> Operation:
    ops = _Reader(query, variables or {}).operations()
    if operation is not None:
        if operation not in ops:
            raise GraphQLError(f'Unknown operation named "{operation}".')
        return ops[operation]
    if len(ops) > 1:
        raise GraphQLError("Must provide operation name if query contains multiple operations.")
    return next(iter(ops.values()))


def project(value: Any, fields: list[Selection] | None, type_name: str) -> Any:
    """`value` cut down to the fields asked for; a callable field is called with its arguments."""
    if fields is None or value is None:
        return value
    if isinstance(value, list):
        return [project(v, fields, type_name) for v in value]
    out: dict[str, Any] = {}
    for sel in fields:
        if sel.name == "__typename":
            out[sel.alias] = type_name
            continue
        if sel.name not in value:
            raise GraphQLError(f'Cannot query field "{sel.name}" on type "{type_name}".')
        got = value[sel.name]
        out[sel.alias] = project(got(sel.args) if callable(got) else got, sel.fields, sel.name)
    return out


# ----------------------------------------------------------------------------- the objects


def per_gpu(price: float, offer: Offer) -> float:
    return round(price / offer.num_gpus, 6)


def env_list(inst: Instance) -> list[str]:
    return [f"{k}={v}" for k, v in inst.env.items()]


def pod_row(inst: Instance, host: str, now: float) -> dict[str, Any]:
    """A pod as `pod`, `myself { pods }` and the create mutations return it."""
    port = inst.host_port
    runtime = None
    if port is not None:
        uptime = int(now - (inst.ready_at or now))
        runtime = {
            "uptimeInSeconds": uptime,
            "ports": [{"ip": host, "isIpPublic": True, "privatePort": p, "publicPort": port, "type": t}
                      for p, t in inst.ports],
            "gpus": [{"id": f"GPU-fake-{inst.id}-{i}", "gpuUtilPercent": 0, "memoryUtilPercent": 0}
                     for i in range(inst.offer.num_gpus)],
            "container": {"cpuPercent": 0, "memoryPercent": 0},
        }
    return {
        "id": inst.id, "name": inst.label, "imageName": inst.image, "desiredStatus": DESIRED[inst.status],
        "costPerHr": inst.price, "adjustedCostPerHr": inst.price,
        "podType": "INTERRUPTABLE" if inst.interruptible else "RESERVED",
        "machineId": str(inst.offer.machine_id), "gpuCount": inst.offer.num_gpus, "vcpuCount": 16,
        "memoryInGb": 64, "containerDiskInGb": 10, "volumeInGb": 0, "volumeMountPath": "/workspace",
        "dockerArgs": "", "dockerId": None, "env": env_list(inst),
        "ports": ",".join(f"{p}/{t}" for p, t in inst.ports), "port": None,
        "uptimeSeconds": runtime["uptimeInSeconds"] if runtime else 0,
        "lastStatusChange": f"{DESIRED[inst.status].title()}: {time.ctime(inst.ended_at or inst.created_at)}",
        "runtime": runtime,
        "machine": {"podHostId": f"{inst.id}-{inst.offer.machine_id}", "gpuDisplayName": inst.offer.gpu_name,
                    "gpuTypeId": inst.offer.runpod_type, "location": inst.offer.geolocation},
    }


def gpu_type(type_id: str, offers: list[Offer], available: list[Offer]) -> dict[str, Any]:
    """A GPU type as `gpuTypes` lists it; prices per GPU, from what is on the market now."""
    mine = [o for o in offers if o.runpod_type == type_id]
    free = [o for o in available if o.runpod_type == type_id]
    demand = min((per_gpu(o.dph_total, o) for o in free), default=None)
    spot = min((per_gpu(o.min_bid, o) for o in free), default=None)

    def lowest(args: Mapping[str, Any]) -> dict[str, Any]:
        count = (args.get("input") or {}).get("gpuCount") or 1
        fits = [o for o in free if o.num_gpus >= count]
        return {"minimumBidPrice": min((per_gpu(o.min_bid, o) for o in fits), default=None),
                "uninterruptablePrice": min((per_gpu(o.dph_total, o) for o in fits), default=None),
                "stockStatus": ("High" if len(fits) > 2 else "Low") if fits else None,
                "gpuName": mine[0].gpu_name, "gpuTypeId": type_id}

    return {
        "id": type_id, "displayName": mine[0].gpu_name, "manufacturer": "Nvidia",
        "memoryInGb": int(mine[0].gpu_ram_gb), "maxGpuCount": max(o.num_gpus for o in mine), "cudaCores": 0,
        "secureCloud": True, "communityCloud": True, "securePrice": demand, "communityPrice": demand,
        "secureSpotPrice": spot, "communitySpotPrice": spot,
        "oneMonthPrice": None, "threeMonthPrice": None, "oneWeekPrice": None, "lowestPrice": lowest,
    }


def _ports(spec: Any) -> list[tuple[int, str]]:
    """`"8188/http,22/tcp"` → [(8188, "http"), (22, "tcp")]."""
    out: list[tuple[int, str]] = []
    for part in str(spec or "").replace(" ", "").split(","):
        number, _, kind = part.partition("/")
        if number.isdigit() and (int(number), kind or "http") not in out:
            out.append((int(number), kind if kind in ("tcp", "udp") else "http"))
    return out


def _env(items: Any) -> dict[str, str]:
    if not isinstance(items, list) or not all(isinstance(i, dict) and "key" in i for i in items):
        raise GraphQLError("env must be a list of {key, value}")
    return {str(i["key"]): "" if i.get("value") is None else str(i["value"]) for i in items}


# ----------------------------------------------------------------------------- the API


class RunPodWire(Wire):
    name = "runpod"

    def instance_id(self, n: int) -> str:
        return f"fkpod{n:09d}"  # 14 characters of [a-z0-9], as RunPod's ids

    def error(self, status: int, message: str) -> web.Response:
        return web.json_response({"errors": [{"message": message, "extensions": {"code": str(status)}}]},
                                 status=status)

    def add_routes(self, app: web.Application, market: FakeProvider) -> None:
        api = _RunPodApi(market, self)
        app.router.add_post("/graphql", api.graphql)


Resolver = Callable[[Mapping[str, Any]], Awaitable[Any]]


class _RunPodApi:
    def __init__(self, market: FakeProvider, wire: RunPodWire) -> None:
        self.market = market
        self.wire = wire
        self.roots: dict[str, dict[str, Resolver]] = {
            "query": {"gpuTypes": self.gpu_types, "pod": self.pod, "myself": self.myself},
            "mutation": {"podFindAndDeployOnDemand": self.deploy_on_demand,
                         "podRentInterruptable": self.rent_interruptable, "podTerminate": self.terminate,
                         "podStop": self.stop, "podResume": self.resume},
        }

    async def graphql(self, request: web.Request) -> web.StreamResponse:
        if not self.market.authorized(request):
            return self.wire.error(401, "Unauthorized")
        try:
            body = json.loads(await request.read())
            if not isinstance(body, dict) or not isinstance(body.get("query"), str):
                raise GraphQLError('the body must be {"query": string, "variables": {...}}')
            variables = body.get("variables") or {}
            if not isinstance(variables, dict):
                raise GraphQLError("variables must be an object")
            op = parse(body["query"], variables, body.get("operationName"))
        except (ValueError, RecursionError) as exc:  # json's errors and GraphQLError are ValueErrors
            return self.wire.error(400, str(exc) if isinstance(exc, GraphQLError) else "body is not JSON")
        roots = self.roots[op.kind]
        unknown = [s.name for s in op.fields if s.name not in roots]
        if unknown:
            root_type = "Query" if op.kind == "query" else "Mutation"
            return self.wire.error(400, f'Cannot query field "{unknown[0]}" on type "{root_type}".')
        failure = self.market.failure_response(FIELD_OPS[op.fields[0].name])
        if failure is not None:
            return failure
        return web.json_response(await self.execute(op, roots))

    async def execute(self, op: Operation, roots: Mapping[str, Resolver]) -> dict[str, Any]:
        data: dict[str, Any] = {}
        errors: list[dict[str, Any]] = []
        for sel in op.fields:
            try:
                data[sel.alias] = project(await roots[sel.name](sel.args), sel.fields, sel.name)
            except GraphQLError as exc:
                data[sel.alias] = None
                errors.append({"message": str(exc), "path": [sel.alias]})
        return {"data": data, "errors": errors} if errors else {"data": data}

    def _pod(self, args: Mapping[str, Any]) -> Instance | None:
        pod_id = (args.get("input") or {}).get("podId")
        inst = self.market.instances.get(str(pod_id))
        return inst if inst is not None and inst.status != "destroyed" else None

    async def gpu_types(self, args: Mapping[str, Any]) -> list[dict[str, Any]]:
        wanted = (args.get("input") or {}).get("id")
        offers, free = self.market.offers, self.market.available()
        ids = list(dict.fromkeys(o.runpod_type for o in offers))
        return [gpu_type(i, offers, free) for i in ids if wanted is None or i == wanted]

    async def pod(self, args: Mapping[str, Any]) -> dict[str, Any] | None:
        inst = self._pod(args)
        return pod_row(inst, self.market.host, time.time()) if inst else None

    async def myself(self, args: Mapping[str, Any]) -> dict[str, Any]:
        now = time.time()
        return {"id": "fake-user", "email": "fake@localhost", "clientBalance": 1000.0,
                "currentSpendPerHr": self.market.spend_per_hour(),
                "pods": [pod_row(i, self.market.host, now) for i in self.market.live()]}

    async def deploy_on_demand(self, args: Mapping[str, Any]) -> dict[str, Any]:
        spec = _deploy_input(args)
        fits = self._fitting(spec)
        if not fits:
            raise GraphQLError(NO_CAPACITY)
        offer = min(fits, key=lambda o: per_gpu(o.dph_total, o))
        return self._rent(offer, spec, per_gpu(offer.dph_total, offer) * spec["gpuCount"], interruptible=False)

    async def rent_interruptable(self, args: Mapping[str, Any]) -> dict[str, Any]:
        spec = _deploy_input(args)
        bid = spec.get("bidPerGpu")
        if not (is_number(bid) and bid > 0):
            raise GraphQLError("bidPerGpu: required, a number > 0")
        fits = [o for o in self._fitting(spec) if per_gpu(o.min_bid, o) <= bid]
        if not fits:
            raise GraphQLError(NO_CAPACITY)
        offer = min(fits, key=lambda o: per_gpu(o.min_bid, o))
        return self._rent(offer, spec, bid * spec["gpuCount"], interruptible=True)

    def _fitting(self, spec: Mapping[str, Any]) -> list[Offer]:
        types = spec["gpuTypeIdList"] or [spec["gpuTypeId"]]
        return [o for o in self.market.available() if o.runpod_type in types and o.num_gpus >= spec["gpuCount"]]

    def _rent(self, offer: Offer, spec: Mapping[str, Any], price: float, interruptible: bool) -> dict[str, Any]:
        inst = self.market.rent(offer, image=spec["imageName"], label=spec["name"], env=spec["env"],
                                ports=_ports(spec["ports"]), price=price, interruptible=interruptible)
        return pod_row(inst, self.market.host, time.time())

    async def terminate(self, args: Mapping[str, Any]) -> None:
        inst = self._pod(args)
        if inst is None:
            raise GraphQLError("Pod not found.")
        await self.market.destroy(inst)

    async def stop(self, args: Mapping[str, Any]) -> dict[str, Any]:
        inst = self._pod(args)
        if inst is None:
            raise GraphQLError("Pod not found.")
        await self.market.stop_instance(inst)
        return pod_row(inst, self.market.host, time.time())

    async def resume(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """`podResume(input: {podId, gpuCount})`: the pod's own GPUs come back (the fake has one
        machine per pod, so a count other than the pod's is refused)."""
        inst = self._pod(args)
        if inst is None:
            raise GraphQLError("Pod not found.")
        count = (args.get("input") or {}).get("gpuCount", inst.offer.num_gpus)
        if count != inst.offer.num_gpus:
            raise GraphQLError(f"gpuCount: the pod has {inst.offer.num_gpus} GPU(s)")
        self.market.resume(inst)
        return pod_row(inst, self.market.host, time.time())


def _deploy_input(args: Mapping[str, Any]) -> dict[str, Any]:
    """The create mutations' `input`, checked; what the fake does not model is read and ignored
    (cloudType, volumes, disk, dataCenterId, ...)."""
    spec = args.get("input")
    if not isinstance(spec, dict):
        raise GraphQLError("input: required")
    image = spec.get("imageName")
    if not isinstance(image, str) or not image:
        raise GraphQLError("imageName: required (the fake does not model templates)")
    type_list = spec.get("gpuTypeIdList") or []
    if not isinstance(spec.get("gpuTypeId"), str) and not type_list:
        raise GraphQLError("gpuTypeId: required (the fake has no CPU pods)")
    count = spec.get("gpuCount", 1)
    if not (is_int(count) and count >= 1):
        raise GraphQLError("gpuCount: must be an int >= 1")
    return {**spec, "imageName": image, "gpuTypeIdList": list(type_list), "gpuCount": count,
            "name": str(spec.get("name") or ""), "env": _env(spec.get("env") or []), "ports": spec.get("ports")}
