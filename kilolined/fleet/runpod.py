"""RunPod's GraphQL API behind the fleet's Provider interface (wire as the official ``runpod``
client speaks it: ``POST /graphql`` with ``Authorization: Bearer``; ``gpuTypes`` with
``lowestPrice`` for offers, ``podRentInterruptable`` / ``podFindAndDeployOnDemand``, ``pod``,
``podStop``, ``podResume``, ``podTerminate``, ``myself { pods }``). Values are written into the query as JSON string
literals, as the official client writes them, so that a name can never end the string.

RunPod places a pod itself: an offer is a GPU type at its lowest price, with no machine to
choose or exclude and no reliability figure (``min_reliability`` is not asked of it).
"""

from __future__ import annotations

import json
from typing import Any

from kilolined.core.config import FleetOfferConfig, FleetTemplateConfig
from kilolined.fleet.provider import (
    BOOTING,
    GONE,
    RUNNING,
    STOPPED,
    ErrorKind,
    Instance,
    Offer,
    ProviderError,
    Status,
    pool_of,
    price_per_hour,
)
from kilolined.fleet.wire import ProviderHTTP

DEFAULT_BASE = "https://api.runpod.io"
_POD_FIELDS = """id name desiredStatus costPerHr machineId
  runtime { ports { ip isIpPublic privatePort publicPort type } }"""


def _s(v: str) -> str:
    return json.dumps(v)  # a JSON string is a GraphQL string literal


class RunPod:
    def __init__(self, api_key: str, api_base: str | None = None, *, timeout_sec: float = 30):
        self._http = ProviderHTTP((api_base or DEFAULT_BASE).rstrip("/"), {"Authorization": f"Bearer {api_key}"},
                                  timeout_sec)

    async def close(self) -> None:
        await self._http.close()

    async def _gql(self, query: str) -> dict[str, Any]:
        body = await self._http.call("POST", "/graphql", {"query": query})
        if isinstance(body, dict) and body.get("errors"):
            err = body["errors"][0]
            msg = self._http.clean(str(err.get("message") if isinstance(err, dict) else err))
            low = msg.lower()
            kind: ErrorKind = "client"
            if "no longer any instances" in low or "not available" in low or "no instances" in low:
                kind = "no_offer"
            elif "balance" in low or "quota" in low or "limit" in low:
                kind = "quota"
            raise ProviderError(kind, f"graphql: {msg}")
        data = body.get("data") if isinstance(body, dict) else None
        return data if isinstance(data, dict) else {}

    async def search(self, offer: FleetOfferConfig, exclude_machines: frozenset[str], max_price: float) -> list[Offer]:
        data = await self._gql(
            f"query GpuTypes {{ gpuTypes {{ id displayName lowestPrice(input: {{gpuCount: {offer.num_gpus}}}) "
            "{ minimumBidPrice uninterruptablePrice } } }")
        out = []
        for g in data.get("gpuTypes") or []:
            if not isinstance(g, dict) or g.get("id") is None:
                continue
            names = {str(g.get("id")).lower(), str(g.get("displayName") or "").lower()}
            low = g.get("lowestPrice") or {}
            price = price_per_hour(low.get("minimumBidPrice" if offer.interruptible else "uninterruptablePrice"))
            if offer.gpu_name.lower() not in names or price is None:
                continue
            per_hour = price * offer.num_gpus
            if per_hour <= max_price:
                out.append(Offer(id=str(g["id"]), machine=None, price=per_hour, reliability=1.0,
                                 gpu_name=offer.gpu_name, num_gpus=offer.num_gpus))
        return out

    async def create(self, offer: Offer, cfg: FleetOfferConfig, template: FleetTemplateConfig, label: str) -> str:
        env = ", ".join(f"{{ key: {_s(k)}, value: {_s(v)} }}" for k, v in template.env.items())
        fields = [f"name: {_s(label)}", f"imageName: {_s(template.image)}", f"gpuTypeId: {_s(offer.id)}",
                  "cloudType: ALL", f"gpuCount: {cfg.num_gpus}", f"containerDiskInGb: {template.disk_gb}",
                  "volumeInGb: 0", "supportPublicIp: true", f"ports: {_s(f'{template.port}/tcp')}", f"env: [{env}]"]
        if cfg.interruptible:
            mutation = "podRentInterruptable"
            fields.append(f"bidPerGpu: {offer.price / max(1, cfg.num_gpus):.4f}")
        else:
            mutation = "podFindAndDeployOnDemand"
        inputs = ", ".join(fields)
        data = await self._gql(f"mutation {{ {mutation}(input: {{ {inputs} }}) {{ id machineId costPerHr }} }}")
        pod = data.get(mutation)
        if not isinstance(pod, dict) or not pod.get("id"):
            raise ProviderError("no_offer", f"{mutation} answered no pod")
        return str(pod["id"])

    async def status(self, instance_id: str, port: int) -> Instance | None:
        data = await self._gql(f"query pod {{ pod(input: {{podId: {_s(instance_id)}}}) {{ {_POD_FIELDS} }} }}")
        pod = data.get("pod")
        return _instance(pod, port) if isinstance(pod, dict) else None

    async def stop(self, instance_id: str) -> None:
        await self._gql(f"mutation {{ podStop(input: {{podId: {_s(instance_id)}}}) {{ id desiredStatus }} }}")

    async def resume(self, instance_id: str, num_gpus: int) -> None:
        await self._gql(f"mutation {{ podResume(input: {{podId: {_s(instance_id)}, gpuCount: {int(num_gpus)}}}) "
                        "{ id desiredStatus } }")

    async def destroy(self, instance_id: str) -> None:
        await self._gql(f"mutation {{ podTerminate(input: {{podId: {_s(instance_id)}}}) }}")

    async def list_own(self, port: int) -> list[Instance]:
        data = await self._gql(f"query myPods {{ myself {{ pods {{ {_POD_FIELDS} }} }} }}")
        me = data.get("myself") or {}
        pods = me.get("pods") if isinstance(me, dict) else None
        out = []
        for p in pods if isinstance(pods, list) else []:
            inst = _instance(p, port) if isinstance(p, dict) else None
            if inst is not None and pool_of(inst.label) is not None:
                out.append(inst)
        return out


def _status(pod: dict[str, Any]) -> Status:
    desired = str(pod.get("desiredStatus") or "").upper()
    if desired == "TERMINATED":
        return GONE
    if desired in ("EXITED", "STOPPED"):
        return STOPPED  # stopped, or a spot pod interrupted: podResume may bring it back
    return RUNNING if desired == "RUNNING" and pod.get("runtime") else BOOTING


def _instance(pod: dict[str, Any], port: int) -> Instance | None:
    if not pod.get("id"):
        return None
    url = None
    runtime = pod.get("runtime")
    ports = runtime.get("ports") if isinstance(runtime, dict) else None
    for p in ports if isinstance(ports, list) else []:
        if isinstance(p, dict) and p.get("privatePort") == port and p.get("isIpPublic") and p.get("ip"):
            url = f"http://{p['ip']}:{p['publicPort']}"
            break
    machine = pod.get("machineId")
    price = price_per_hour(pod.get("costPerHr")) or 0.0  # 0: not given (the rent's price stays)
    return Instance(id=str(pod["id"]), label=pod.get("name"), status=_status(pod), price=price,
                    machine=None if machine is None else str(machine), url=url)
