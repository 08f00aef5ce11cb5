"""The configuration schema (docs/CONFIG.md): pydantic models, YAML loading, ${VAR} expansion.

Every problem is reported as ``file:line: dotted.path: message`` (like ``nginx -t``) so that an
operator can find the line. A key given twice in one mapping is an error (PyYAML keeps the last
one silently, which drops a whole route), and aliases may not expand past MAX_ALIAS_NODES.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kilolined.core.keystrength import MIN_KEY_BITS, key_bits
from kilolined.core.templates import IMAGES_PATHS, Slot, TemplateError, load_workflow, slots

NotifyEvent = Literal[
    "node_down",
    "node_up",
    "breaker_open",
    "breaker_closed",
    "failover",
    "failback",
    "route_down",
    "route_up",
    "reload_failed",
    "cluster_degraded",  # cluster mode only (docs/CLUSTER.md)
    "cluster_restored",
    "cluster_gateway_lost",
    "fleet_node_lost",  # fleet pools only (docs/FLEET.md)
    "fleet_node_rented",
    "fleet_node_ready",
    "fleet_rent_failed",
    "fleet_node_stopped",
    "fleet_node_resumed",
    "node_slow",  # slow nodes (docs/CONFIG.md "nodes.<n>.slow")
    "node_recovered",
    "node_drifting",
]
NOTIFY_EVENTS: tuple[NotifyEvent, ...] = get_args(NotifyEvent)

# Paths that are list/status/static endpoints per kind: forwarded without a slot (docs/API.md#route-kinds).
DEFAULT_UNQUEUED: dict[str, list[str]] = {
    # Only a prompt is GPU work (GPU_WORK below): the web UI's files and its metadata, history,
    # files, uploads, user data and the socket are answered at once, whatever renders.
    "comfyui": ["*"],
    # Model lists and health: never GPU work (the SDK's models.retrieve is /v1/models/{id}); the
    # /models forms are what a route with strip_path: true sees.
    "openai": ["/v1/models", "/v1/models/*", "/health", "/v1/health", "/models", "/models/*"],
    "generic": [],
}

# Requests that take a slot whatever a route's unqueued_paths say: on a comfyui route a prompt is
# the GPU's work, and a glob that matched it would let it skip the queue and every limit.
GPU_WORK: dict[str, frozenset[tuple[str, str]]] = {
    "comfyui": frozenset({("POST", "/prompt"), ("POST", "/api/prompt"), *(("POST", p) for p in IMAGES_PATHS)}),
}

DISCOVER = "discover"  # nodes.*.models: ask the node's GET /v1/models
Sec = Annotated[float, Field(ge=0)]
PosSec = Annotated[float, Field(gt=0)]


class ConfigError(Exception):
    """A config that cannot be used; ``errors`` holds ``dotted.path: message`` lines."""

    def __init__(self, errors: list[str]):
        super().__init__("\n".join(errors))
        self.errors = errors


class _Model(BaseModel):
    # Unknown keys are almost always typos (max_concurency), so they are errors.
    model_config = ConfigDict(extra="forbid", frozen=True)


_M = TypeVar("_M", bound=_Model)


class TLSConfig(_Model):
    cert: str
    key: str


class ServerConfig(_Model):
    listen: str = "0.0.0.0:8080"
    tls: TLSConfig | None = None
    trusted_proxies: list[str] = []
    max_body_mb: Annotated[float, Field(gt=0)] = 64
    # Bodies of waiting requests held in memory, in total and per key (kilolined/scheduling/bodies.py):
    # a request that would have to wait past them is refused (503 / 429 queue_full).
    max_queued_body_mb: Annotated[float, Field(gt=0)] = 1024
    max_queued_body_mb_per_key: Annotated[float, Field(gt=0)] = 256
    shutdown_grace_sec: Sec = 30
    heartbeat_sec: PosSec = 10
    state_dir: str | None = None
    access_log: bool = True
    header_timeout_sec: PosSec = 30  # a whole request head within this (slowloris); nginx: 60 s
    idle_timeout_sec: PosSec = 75  # keep-alive connection with no request in progress; nginx: 75 s
    max_connections: Annotated[int, Field(ge=1)] = 10000  # more wait in the kernel backlog
    # Every URL the gateway hands out (job status/events/result/files, Location) starts with this,
    # so a webhook receiver on another host can use them; none = paths relative to the gateway.
    public_url: Annotated[str, Field(pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$")] | None = None

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        split_listen(v)
        return v

    @field_validator("trusted_proxies")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        import ipaddress

        for c in v:
            try:
                ipaddress.ip_network(c, strict=False)
            except ValueError:
                raise ValueError(f"not a CIDR: {c!r}")
        return v


def split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` → (host, port)."""
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\]:(\d+)|([^:\[\]]*):(\d+)", listen)
    if not m:
        raise ValueError("expected host:port (or [::]:port)")
    host = m.group(1) if m.group(1) is not None else m.group(3)
    port = int(m.group(2) or m.group(4))
    if not 0 <= port <= 65535:
        raise ValueError("port out of range")
    return host or "0.0.0.0", port


MIN_KEY_CHARS = 16  # a clear-text key shorter than this is refused (`kilolined keygen` makes 35)
# Keys anyone would try first: the words of examples and tutorials. Their sha256 is refused
# wherever a key or its hash is given, so no copy of an example (an older etc/kiloline.yaml had
# sha256("foo") and sha256("bar")) authenticates a guessable key.
WELL_KNOWN_KEYS = (
    "foo", "bar", "baz", "qux", "test", "testing", "secret", "password", "passw0rd", "admin", "root",
    "changeme", "change-me", "key", "apikey", "api-key", "api_key", "token", "demo", "example", "default",
    "kiloline", "letmein", "hello", "1234", "12345", "123456", "12345678", "alice", "bob", "ci", "x",
    "sk-1234", "sk-xxx",
)
WEAK_DIGESTS = frozenset(hashlib.sha256(w.encode()).hexdigest() for w in WELL_KNOWN_KEYS)
_KEYGEN_HINT = "make one with `kilolined keygen`"
# The signing secret of the Standard Webhooks documentation and test vectors (an older
# etc/kiloline.yaml had it as its default): callbacks signed with it prove nothing.
PUBLISHED_WHSECS = frozenset({"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"})


class _Secret(_Model):
    """Either the sha256 of a key or the key itself (usually from ${ENV})."""

    key_sha256: str | None = None
    key: str | None = None

    @field_validator("key_sha256")
    @classmethod
    def _hex(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", v):
            raise ValueError("must be 64 hex characters (sha256 of the key)")
        if v is not None and v.lower() in WEAK_DIGESTS:
            raise ValueError(f"is the sha256 of a well-known word (anyone can guess the key): {_KEYGEN_HINT}")
        return v.lower() if v else v

    @field_validator("key")
    @classmethod
    def _strong(cls, v: str | None) -> str | None:
        # An empty value is no key at all (admin: every admin endpoint then answers 401).
        if v and len(v) < MIN_KEY_CHARS:
            raise ValueError(f"shorter than {MIN_KEY_CHARS} characters (anyone can guess it): {_KEYGEN_HINT}")
        if v and hashlib.sha256(v.encode()).hexdigest() in WEAK_DIGESTS:
            raise ValueError(f"is a well-known word (anyone can guess it): {_KEYGEN_HINT}")
        if v and key_bits(v, WELL_KNOWN_KEYS) < MIN_KEY_BITS:
            raise ValueError("has too little entropy (repeats, runs like 1234 or abcd, well-known words: "
                             f"anyone can guess it): {_KEYGEN_HINT}")
        return v

    def digest(self) -> str | None:
        if self.key_sha256:
            return self.key_sha256
        if self.key:
            return hashlib.sha256(self.key.encode()).hexdigest()
        return None


class AdminConfig(_Secret):
    public_metrics: bool = False


class RateConfig(_Model):
    per_minute: Annotated[float, Field(gt=0)]
    # Bucket capacity; default: one minute's worth, i.e. per_minute requests may come at once.
    burst: Annotated[int, Field(ge=1)] | None = None

    @property
    def capacity(self) -> int:
        return self.burst if self.burst is not None else max(1, int(self.per_minute))


class BudgetConfig(_Model):
    # The window the limits below count over: the UTC day, or the UTC calendar month (the names
    # keep "per_day" for the default).
    period: Literal["day", "month"] = "day"
    requests_per_day: Annotated[int, Field(ge=0)] | None = None
    tokens_per_day: Annotated[int, Field(ge=0)] | None = None
    gpu_seconds_per_day: Annotated[float, Field(ge=0)] | None = None


class KeyConfig(_Secret):
    routes: list[str] = ["*"]
    rate: RateConfig | None = None
    priority: int = 0
    budget: BudgetConfig | None = None
    webhook_url: str | None = None
    adhoc_targets: list[str] = []

    @model_validator(mode="after")
    def _one_secret(self) -> KeyConfig:
        if not self.key_sha256 and not self.key:
            raise ValueError("needs key_sha256 or key")
        if self.key_sha256 and self.key:
            raise ValueError("give key_sha256 or key, not both")
        return self


class HealthConfig(_Model):
    path: str = "/health"
    interval_sec: PosSec = 5
    timeout_sec: PosSec = 2
    fall: Annotated[int, Field(ge=1)] = 3
    rise: Annotated[int, Field(ge=1)] = 2
    expect_status: list[int] = [200]


class BreakerConfig(_Model):
    consecutive_failures: Annotated[int, Field(ge=1)] = 3
    open_sec: PosSec = 10
    max_open_sec: PosSec = 300
    slow_start_sec: Sec = 30


class SlowConfig(_Model):
    """How a node's speed is judged against its peers and its own past (docs/CONFIG.md "Slow nodes")."""

    ratio: Annotated[float, Field(gt=1)] = 1.5  # slower than its peers' median by this factor
    min_gap_ms: Annotated[float, Field(ge=0)] = 5  # and by at least this much per unit
    samples: Annotated[int, Field(ge=1, le=10000)] = 20  # the EWMA's span, in requests
    evaluations: Annotated[int, Field(ge=1, le=1000)] = 3  # consecutive slow evaluations before acting
    stall_sec: PosSec = 30  # a stream with no byte for this long is a stall
    drift: Annotated[float, Field(gt=1)] = 1.3  # alone on its route: this much worse than its best hour


def _slow_off(v: Any) -> Any:
    """``slow: off`` (YAML reads it as false) disables; ``slow: on`` / an empty key takes the defaults."""
    if v is False or v == "off":
        return None
    if v is None or v is True or v == "on":
        return {}
    return v


class RewriteConfig(_Model):
    """What the gateway changes in a request's JSON body (and a form's ``model`` field) before it
    is matched and routed (docs/CONFIG.md#rewriting-requests): a route's first, then its node's."""

    model: dict[str, str] = {}  # the name a client asks for -> the name the node is sent
    default: dict[str, Any] = {}  # set when the client did not
    set: dict[str, Any] = {}  # always
    strip: list[str] = []  # removed

    @model_validator(mode="after")
    def _not_model(self) -> RewriteConfig:
        for key in ("default", "set"):
            if "model" in getattr(self, key):
                raise ValueError(f"{key}: the model is renamed by rewrite.model, not {key}")
        if "model" in self.strip:
            raise ValueError("strip: the model cannot be removed (rewrite.model renames it)")
        both = sorted(set(self.strip) & (set(self.set) | set(self.default)))
        if both:
            raise ValueError(f"strip: {', '.join(both)} also set (or defaulted): say one")
        for alias, name in self.model.items():
            if not alias.strip() or not name.strip():
                raise ValueError("model: a model name may not be empty")
        return self


class PriceConfig(_Model):
    """What a node's provider charges per million tokens (a hosted API), in the bill's currency."""

    input: Annotated[float, Field(ge=0)] = 0
    output: Annotated[float, Field(ge=0)] = 0


class OverflowConfig(_Model):
    """Nodes (a hosted API) that take a request only when no primary or standby can within
    ``when_wait_sec``, or none is up (docs/CONFIG.md#overflow)."""

    nodes: Annotated[list[str], Field(min_length=1)]
    when_wait_sec: Sec = 30


class BusyConfig(_Model):
    """Where a node shows what it runs (docs/CLUSTER.md): GET ``path``, then the number at
    ``json_pointer`` in its JSON (an array: its length) or the sum of a Prometheus ``metric``."""

    path: Annotated[str, Field(pattern=r"^/")]
    json_pointer: str | None = None
    metric: Annotated[str, Field(pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")] | None = None

    @field_validator("json_pointer")
    @classmethod
    def _pointer(cls, v: str | None) -> str | None:
        if v is not None and v != "" and not v.startswith("/"):
            raise ValueError("a JSON pointer starts with / (RFC 6901), e.g. /num_running")
        return v

    @model_validator(mode="after")
    def _one(self) -> BusyConfig:
        if (self.json_pointer is None) == (self.metric is None):
            raise ValueError("give exactly one of json_pointer or metric")
        return self


class CardConfig(_Model):
    """One GPU that several nodes (servers on their own ports) share (docs/CONFIG.md#cards)."""

    max_concurrency: Annotated[int, Field(ge=1)] | None = None  # leases on all its nodes at once
    capacity: Annotated[float, Field(gt=0)] | None = None  # their costs at once, in the routes' cost units


class NodeConfig(_Model):
    url: str
    label: str | None = None
    headers: dict[str, str] = {}
    max_concurrency: Annotated[int, Field(ge=1)] | None = None
    capacity: Annotated[float, Field(gt=0)] | None = None  # units held at once (say GB of VRAM)
    card: str | None = None  # the ``cards`` entry (GPU) it shares with other nodes
    health: HealthConfig | None = None
    breaker: BreakerConfig = BreakerConfig()
    #: speed watch (docs/CONFIG.md "Slow nodes"): on by default; None when ``slow: off``
    slow: SlowConfig | None = SlowConfig()
    #: the models it serves (a list, or "discover": its GET /v1/models); None = whatever it is asked
    models: list[str] | str | None = None
    warm_models: Annotated[int, Field(ge=1)] = 1  # models it keeps loaded at once (OLLAMA_MAX_LOADED_MODELS)
    #: applied after its route's rewrite, on the request this node is sent (a hosted API's names)
    rewrite: RewriteConfig | None = None
    price_per_mtok: PriceConfig | None = None  # a hosted API's price: the usage's cost
    #: where it shows what it runs, for a server the gateway has no probe for (docs/CLUSTER.md)
    busy: BusyConfig | None = None

    @field_validator("slow", mode="before")
    @classmethod
    def _slow(cls, v: Any) -> Any:
        return _slow_off(v)

    @field_validator("models")
    @classmethod
    def _models(cls, v: list[str] | str | None) -> list[str] | str | None:
        if v is None or v == DISCOVER:
            return v
        if isinstance(v, str):
            raise ValueError(f'must be a list of model names or "{DISCOVER}"')
        if not v:
            raise ValueError(f'must name at least one model (or be "{DISCOVER}")')
        for m in v:
            if not m.strip():
                raise ValueError("a model name may not be empty")
        dup = sorted({m for m in v if v.count(m) > 1})
        if dup:
            raise ValueError(f"model listed twice: {', '.join(dup)}")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.fullmatch(r"https?://[^/\s?#]+(/[^\s?#]*)?", v):
            raise ValueError("must be http(s)://host:port")
        return v.rstrip("/")


COST_UNITS = ("megapixels", "tokens")


class RequestCostConfig(_Model):
    """What one request of a route costs on a node's ``capacity``: ``base + per_unit × units``."""

    base: Annotated[float, Field(ge=0)] = 0
    per_unit: Annotated[float, Field(ge=0)] = 0
    unit: str | None = None
    default_max_tokens: Annotated[int, Field(ge=0)] = 1024

    @field_validator("unit")
    @classmethod
    def _unit(cls, v: str | None) -> str | None:
        if v is None or v in COST_UNITS:
            return v
        if v.startswith(("json:", "json_chars:")):
            ptr = v.split(":", 1)[1]
            if ptr and not ptr.startswith("/"):
                raise ValueError("a JSON pointer starts with / (RFC 6901), e.g. json:/batch_size")
            if re.search(r"~[^01]|~$", ptr):
                raise ValueError("in a JSON pointer ~ must be followed by 0 or 1")
            return v
        if v.startswith("header:") and re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", v[7:]):
            return v
        raise ValueError("must be megapixels, tokens, json:/pointer, json_chars:/pointer or header:Name")


class MatchConfig(_Model):
    """When a route takes a request on a path it shares with other routes (all given must hold)."""

    min_units: Annotated[float, Field(ge=0)] | None = None  # inclusive, in the route's cost.unit
    max_units: Annotated[float, Field(ge=0)] | None = None
    model: list[str] | None = None  # globs on the JSON body's "model"
    header: dict[str, str] | None = None  # header name -> glob on its value
    method: list[str] | None = None

    @field_validator("method")
    @classmethod
    def _upper(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [m.upper() for m in v]


class S3StoreConfig(_Model):
    """An S3-compatible bucket for a ComfyUI route's outputs (docs/CONFIG.md "comfy")."""

    endpoint: Annotated[str, Field(pattern=r"^https?://[^/?#]+/?$")]  # scheme://host[:port]
    bucket: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")]
    region: str = "us-east-1"
    access_key: str
    secret_key: SecretStr
    prefix: str = ""  # object keys: {prefix}{route}/{type}/{subfolder/}{filename}


class ComfyStoreConfig(_Model):
    s3: S3StoreConfig | None = None  # None: the gateway's memory


class ComfyConfig(_Model):
    """What a ``comfyui`` route keeps of its prompts' files (docs/API.md "ComfyUI over several GPUs")."""

    #: memory for held inputs and (without a bucket) outputs, per route; the oldest go first
    max_files_mb: Annotated[float, Field(gt=0)] = 1024
    #: globs of http(s) URLs the gateway may fetch when a prompt names one as an input
    fetch_inputs: list[str] = []
    store: ComfyStoreConfig = ComfyStoreConfig()
    #: every key sees every prompt and file of the route (one app backend with one key)
    shared: bool = False


class TemplateConfig(_Model):
    """A ComfyUI workflow behind OpenAI's Images API (docs/CONFIG.md "templates")."""

    workflow: Annotated[str, Field(min_length=1)]  # API-format JSON; relative to the config file
    inputs: dict[str, str] = {}  # Images API field -> "NODE.inputs.NAME"
    #: the workflow and each field's typed input, read from the file at each load (reload reads it again)
    _graph: dict[str, Any] = PrivateAttr(default_factory=dict)
    _slots: dict[str, Slot] = PrivateAttr(default_factory=dict)
    _digest: str = PrivateAttr(default="")

    @property
    def graph(self) -> dict[str, Any]:
        return self._graph

    @property
    def slots(self) -> dict[str, Slot]:
        return self._slots

    def load(self, base: Path) -> str | None:
        """Read and check the workflow file; the problem as ``key: message``, or None."""
        path = base / self.workflow
        try:
            data = path.read_bytes()
        except OSError as e:
            return f"workflow: cannot read {str(path)!r}: {e.strerror or e}"
        try:
            self._graph = load_workflow(data)
            self._slots = slots(self._graph, self.inputs)
        except TemplateError as e:
            msg = str(e)
            return msg if msg.startswith("inputs.") else f"workflow: {path}: {msg}"
        self._digest = hashlib.sha256(data).hexdigest()
        return None


class RouteConfig(_Model):
    path: str
    kind: Literal["generic", "comfyui", "openai"] = "generic"
    nodes: list[str] = []  # empty only when a fleet pool joins the route (cross_check)
    standby: list[str] = []
    max_concurrency: Annotated[int, Field(ge=1)] = 1
    max_queue_depth: Annotated[int, Field(ge=0)] = 100
    queue_timeout_sec: PosSec = 120
    request_timeout_sec: PosSec = 600
    drop_policy: Literal["reject_with_429", "reject_with_503", "drop_oldest"] = "reject_with_429"
    strategy: Literal["fifo", "fifo_fair_lease", "priority"] = "fifo_fair_lease"
    max_queued_per_key: Annotated[int, Field(ge=1)] | None = None
    rate: RateConfig | None = None
    auth: Literal["required", "none"] = "required"
    retry_on_failover: Annotated[int, Field(ge=0)] = 1
    #: an ``openai`` stream whose node fails mid-answer goes on on another node (docs/API.md
    #: "Streams that survive their node"); off: it ends as any other stream cut by its node
    continue_streams: bool = True
    expected_duration_sec: Annotated[float, Field(gt=0)] | None = None
    unqueued_paths: list[str] | None = None
    cost: RequestCostConfig | None = None
    max_bypass: Annotated[int, Field(ge=0)] = 8  # times a head that does not fit may be passed (backfill)
    #: times a head that would make its node swap models may be passed for a request warm there
    max_swap_bypass: Annotated[int, Field(ge=0)] = 4
    match: MatchConfig | None = None  # several routes on one path: the first whose match holds
    rewrite: RewriteConfig | None = None  # aliases and parameters, before matching and routing
    overflow: OverflowConfig | None = None
    #: cut ``path`` off before forwarding (nginx's proxy_pass with a URI); None = the kind's default
    strip_path: bool | None = None
    #: send a request where its prompt's prefix (or its session) was sent before (docs/CONFIG.md#affinity)
    affinity: Literal["off", "prefix", "session"] = "off"
    #: the unit the prefix index counts in: bytes of canonical prompt text per key
    affinity_block_bytes: Annotated[int, Field(ge=16, le=65536)] = 256
    #: ComfyUI routes: held inputs, the output store, per-key files (docs/CONFIG.md "comfy")
    comfy: ComfyConfig = ComfyConfig()
    #: comfyui routes: workflows served as OpenAI's Images API, by template name (the request's model)
    templates: dict[str, TemplateConfig] = {}

    @field_validator("affinity", mode="before")
    @classmethod
    def _affinity_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false: that is what the operator wrote.
        return "off" if v is False else v

    @field_validator("path")
    @classmethod
    def _path(cls, v: str) -> str:
        if not v.startswith("/") or "?" in v or "#" in v:
            raise ValueError("must start with / and hold no query")
        return v.rstrip("/") or "/"

    @property
    def unqueued(self) -> list[str]:
        return self.unqueued_paths if self.unqueued_paths is not None else DEFAULT_UNQUEUED[self.kind]

    @property
    def strips_path(self) -> bool:
        """OpenAI clients' base URL ends in /v1 and a node's url is the server's root (vLLM serves
        nothing without /v1): an openai route at .../v1 forwards the whole path by default."""
        if self.strip_path is not None:
            return self.strip_path
        return not (self.kind == "openai" and self.path.endswith("/v1"))

    @property
    def overflow_nodes(self) -> list[str]:
        return self.overflow.nodes if self.overflow is not None else []


class TelegramConfig(_Model):
    bot_token: str
    chat_id: str | int
    api_base: str = "https://api.telegram.org"


class DiscordConfig(_Model):
    webhook_url: str


class WebhookTargetConfig(_Model):
    url: str
    secret: str | None = None


class NotifyConfig(_Model):
    telegram: TelegramConfig | None = None
    discord: DiscordConfig | None = None
    webhook: WebhookTargetConfig | None = None
    events: list[NotifyEvent] = list(NOTIFY_EVENTS)
    min_interval_sec: Sec = 60
    group_sec: Sec = 2

    @model_validator(mode="before")
    @classmethod
    def _empty_is_off(cls, data: Any) -> Any:
        # `bot_token: "${TG_TOKEN:-}"` lets one example file serve hosts with and without a channel.
        if isinstance(data, dict):
            data = dict(data)
            for ch, field in (("telegram", "bot_token"), ("discord", "webhook_url"), ("webhook", "url")):
                v = data.get(ch)
                if isinstance(v, dict) and v.get(field) == "":
                    data[ch] = None
        return data


class JobsConfig(_Model):
    result_ttl_sec: PosSec = 600
    max_results_mb: Annotated[float, Field(gt=0)] = 512
    webhook_secret: str | None = None
    webhook_allow_private: bool = False
    webhook_backoff_sec: list[Sec] = [5, 30, 120, 600, 1800]
    webhook_timeout_sec: PosSec = 15

    @field_validator("webhook_secret")
    @classmethod
    def _whsec(cls, v: str | None) -> str | None:
        if not v:
            return None  # `"${KILOLINE_WEBHOOK_SECRET:-}"` unset: callbacks go unsigned
        if v in PUBLISHED_WHSECS:
            raise ValueError("the Standard Webhooks example secret, published: anyone can sign with it; "
                             "make one with `kilolined keygen --whsec`")
        import base64
        import binascii

        try:
            raw = base64.b64decode(v.removeprefix("whsec_") + "==", validate=False)
        except (binascii.Error, ValueError):
            raise ValueError("must be whsec_ followed by base64")
        if len(raw) < 16:
            raise ValueError("secret too short (at least 24 random bytes recommended)")
        return v


class CostConfig(_Model):
    gpu_hourly_usd: Annotated[float, Field(ge=0)] | None = None
    serverless_per_sec_usd: Annotated[float, Field(ge=0)] | None = None


class ClusterConfig(_Model):
    """Several gateways sharing one truth through Redis (docs/CLUSTER.md)."""

    redis_url: Annotated[str, Field(pattern=r"^(redis|rediss|unix)://")]
    gateway_id: str | None = None  # default: hostname + ":" + listen port
    lease_ttl_sec: Annotated[float, Field(ge=1)] = 10
    key_prefix: Annotated[str, Field(min_length=1)] = "kiloline:"

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        why = redis_url_problem(v)
        if why:
            raise ValueError(why)
        return v


def redis_url_problem(url: str) -> str | None:
    """Why redis-py would misread ``url``, in words that never quote it: the URL usually holds the
    password (``redis://:${REDIS_PASSWORD}@host``), and a password with ``/``, ``#`` or ``?``
    ends the URL's host part early, so what the parser then reports as a port or a database is a
    piece of the secret."""
    scheme, _, rest = url.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in rest[len(authority):]:
        return ("the user or password holds '/', '?' or '#', which end the host part of a URL: "
                "percent-encode them (/ as %2F, ? as %3F, # as %23, @ as %40, % as %25)")
    if scheme == "unix":
        return None
    hostport = authority.rpartition("@")[2]
    port = hostport.rpartition("]")[2] if hostport.startswith("[") else hostport
    if ":" in port and not port.rpartition(":")[2].isdigit():
        return ("the port is not a number (a user or password with ':' or '@' must be "
                "percent-encoded: : as %3A, @ as %40)")
    db = re.split(r"[?#]", rest[len(authority):], maxsplit=1)[0].strip("/")
    if db and not db.isdigit():
        return "the path must be the database number (redis://host:6379/0)"
    return None


class FleetProviderConfig(_Model):
    """A GPU rental account (docs/FLEET.md). The key is a SecretStr: never in logs, state or dumps."""

    kind: Literal["vastai", "runpod"]
    api_key: SecretStr
    api_base: str | None = None  # the provider's own URL by default; tests point it at the fake

    @field_validator("api_base")
    @classmethod
    def _base(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^/\s?#]+(/[^\s?#]*)?", v):
            raise ValueError("must be http(s)://host[:port][/path]")
        return v.rstrip("/") if v else v


class FleetOfferConfig(_Model):
    gpu_name: Annotated[str, Field(min_length=1)]
    num_gpus: Annotated[int, Field(ge=1)] = 1
    max_dph: Annotated[float, Field(gt=0)]
    min_reliability: Annotated[float, Field(ge=0, le=1)] = 0.0
    interruptible: bool = True


class FleetTemplateConfig(_Model):
    image: Annotated[str, Field(min_length=1)]
    disk_gb: Annotated[int, Field(ge=1)] = 20
    env: dict[str, str] = {}
    port: Annotated[int, Field(ge=1, le=65535)]


class FleetNodeConfig(_Model):
    """``nodes.<n>`` without ``url`` (the instance's address); ``{id}`` in label is the instance id."""

    label: str | None = None
    headers: dict[str, str] = {}
    max_concurrency: Annotated[int, Field(ge=1)] | None = None
    capacity: Annotated[float, Field(gt=0)] | None = None
    health: HealthConfig = HealthConfig()  # a pool node always has one: it is how a reclaim is seen
    breaker: BreakerConfig = BreakerConfig()
    models: list[str] | str | None = None
    warm_models: Annotated[int, Field(ge=1)] = 1

    def node(self, url: str, instance_id: str) -> NodeConfig:
        label = self.label.replace("{id}", instance_id) if self.label else None
        return NodeConfig(url=url, **{**self.model_dump(exclude={"label"}), "label": label})


class FleetPoolConfig(_Model):
    """A pool: ``size: N`` keeps N serving; ``min``/``max`` follow the queue (docs/FLEET.md).
    Which of them is given, and ``offer`` or ``offers``, is checked by ``fleet_rules``."""

    provider: str
    size: Annotated[int, Field(ge=0)] | None = None
    min: Annotated[int, Field(ge=0)] | None = None
    max: Annotated[int, Field(ge=0)] | None = None
    offer: FleetOfferConfig | None = None
    offers: list[FleetOfferConfig] = []  # in order of preference
    template: FleetTemplateConfig
    node: FleetNodeConfig = FleetNodeConfig()
    routes: Annotated[list[str], Field(min_length=1)]
    boot_timeout_sec: PosSec = 900
    #: the first wait after a failed rent (docs/FLEET.md: 60 s doubling to 1 h); lower in tests
    backoff_base_sec: PosSec = 60
    scale_up_wait_sec: Sec = 20
    idle_stop_sec: Sec = 600  # 0: never stopped for idleness
    stopped_destroy_sec: Sec = 86400  # 0: a stopped instance is kept

    @property
    def min_size(self) -> int:
        return self.size if self.size is not None else (self.min or 0)

    @property
    def max_size(self) -> int:
        if self.size is not None:
            return self.size
        return self.max if self.max is not None else self.min_size

    @property
    def offer_list(self) -> list[FleetOfferConfig]:
        """The entries to rent from, the preferred first (``offer`` is a list of one)."""
        return list(self.offers) or ([self.offer] if self.offer is not None else [])


class FleetConfig(_Model):
    providers: dict[str, FleetProviderConfig] = {}
    pools: dict[str, FleetPoolConfig] = {}
    max_spend_per_hour: Annotated[float, Field(ge=0)]


class Config(_Model):
    server: ServerConfig = ServerConfig()
    admin: AdminConfig = AdminConfig()
    keys: dict[str, KeyConfig] = {}
    cards: dict[str, CardConfig] = {}
    nodes: Annotated[dict[str, NodeConfig], Field(min_length=1)]
    routes: Annotated[dict[str, RouteConfig], Field(min_length=1)]
    notify: NotifyConfig = NotifyConfig()
    jobs: JobsConfig = JobsConfig()
    cost: CostConfig = CostConfig()
    cluster: ClusterConfig | None = None
    fleet: FleetConfig | None = None

    def cross_check(self) -> list[str]:
        """References between sections, which pydantic cannot see field by field."""
        refs = {name: {f: getattr(r, f) for f in ROUTE_NODE_FIELDS} for name, r in self.routes.items()}
        pools = {n: {"provider": p.provider, "routes": list(p.routes), "size": p.size, "min": p.min, "max": p.max,
                     "offer": p.offer, "offers": p.offers} for n, p in (self.fleet.pools.items() if self.fleet else ())}
        providers = set(self.fleet.providers) if self.fleet else set()
        return [*reference_errors(set(self.nodes), refs, set(self.routes), {n: k.routes for n, k in self.keys.items()}),
                *route_rules(self.routes), *key_rules(self.keys),
                *rewrite_rules(self.nodes, self.routes, self.cluster is not None),
                *card_rules(set(self.cards), {n: c.card for n, c in self.nodes.items()}),
                *fleet_rules(pools, providers, set(self.nodes), {n: r.nodes for n, r in self.routes.items()})]


ROUTE_NODE_FIELDS = ("nodes", "standby")


def reference_errors(nodes: set[str], route_nodes: dict[str, dict[str, list[str]]], routes: set[str],
                     key_routes: dict[str, list[str]]) -> list[str]:
    """Names one section uses that another must define: a route's nodes, a key's routes."""
    errs: list[str] = []
    for name, fields in route_nodes.items():
        for field, names in fields.items():
            errs.extend(f"routes.{name}.{field}.{i}: unknown node {n!r}" for i, n in enumerate(names)
                        if n not in nodes)
    for name, names in key_routes.items():
        errs.extend(f"keys.{name}.routes.{i}: unknown route {rn!r}" for i, rn in enumerate(names)
                    if rn != "*" and rn not in routes)
    return errs


def fleet_rules(pools: dict[str, dict[str, Any]], providers: set[str], nodes: set[str],
                route_nodes: dict[str, list[str]]) -> list[str]:
    """A pool names a known provider and known routes; its nodes' names (``<pool>-<id>``) cannot
    be taken by a static node; a route lists a node unless a pool joins it."""
    errs: list[str] = []
    joined: set[str] = set()
    for name, p in pools.items():
        prov = p.get("provider")
        if isinstance(prov, str) and prov not in providers:
            errs.append(f"fleet.pools.{name}.provider: unknown provider {prov!r}")
        for i, rn in enumerate(_str_list(p.get("routes"))):
            joined.add(rn)
            if rn not in route_nodes:
                errs.append(f"fleet.pools.{name}.routes.{i}: unknown route {rn!r}")
        errs.extend(f"nodes.{n}: the name is a node of fleet pool {name!r} (<pool>-<instance id>)"
                    for n in sorted(nodes) if n.startswith(name + "-"))
        errs.extend(f"fleet.pools.{name}.{e}" for e in pool_size_rules(p))
    errs.extend(f"routes.{rn}.nodes: must list at least one node (or be joined by a fleet pool)"
                for rn, ns in route_nodes.items() if not ns and rn not in joined)
    return errs


def pool_size_rules(p: dict[str, Any]) -> list[str]:
    """``size``, or ``min``/``max`` (min ≤ max, at least max); ``offer`` or a non-empty ``offers``."""
    errs: list[str] = []
    size, lo, hi = p.get("size"), p.get("min"), p.get("max")
    if size is not None and (lo is not None or hi is not None):
        errs.append(f"{'min' if lo is not None else 'max'}: give size (min = max = size), or min and max, not both")
    elif size is None and hi is None:
        errs.append("max: required (or size: N, which means min = max = N)")
    elif isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        errs.append(f"min: must be at most max ({hi}), not {lo}")
    if p.get("offer") is not None and p.get("offers"):
        errs.append("offers: give offer or offers, not both")
    elif p.get("offer") is None and not p.get("offers"):
        errs.append("offers: required, the offers to rent from in order of preference (or one offer)")
    return errs


def card_rules(cards: set[str], node_cards: dict[str, Any]) -> list[str]:
    """A node's card is one of ``cards``, and every card has a node."""
    errs = [f"nodes.{n}.card: unknown card {c!r}" for n, c in node_cards.items()
            if isinstance(c, str) and c not in cards]
    used = set(node_cards.values())
    errs.extend(f"cards.{c}: no node uses this card (nodes.<n>.card)" for c in sorted(cards) if c not in used)
    return errs


def route_rules(routes: dict[str, RouteConfig]) -> list[str]:
    """Rules between routes: standby overlap, shared and reserved paths, match needing a cost unit."""
    errs: list[str] = []
    paths: dict[str, str] = {}
    for name, r in routes.items():
        both = set(r.nodes) & set(r.standby)
        if both:
            errs.append(f"routes.{name}.standby: {sorted(both)} also listed in nodes")
        if r.path in paths:
            errs.extend(_shared_path(name, r, paths[r.path], routes))
        elif r.path.startswith("/v1/jobs") or r.path.startswith("/admin") or r.path in ("/v1/proxy", "/v1/usage"):
            errs.append(f"routes.{name}.path: {r.path!r} is reserved by the gateway")
        else:
            paths[r.path] = name
        m = r.match
        if m is not None and (m.min_units is not None or m.max_units is not None) and \
                (r.cost is None or r.cost.unit is None):
            errs.append(f"routes.{name}.match: min_units/max_units need a cost.unit on the route")
    return errs


def rewrite_rules(nodes: dict[str, NodeConfig], routes: dict[str, RouteConfig], cluster: bool) -> list[str]:
    """Aliases and overflow: an alias names a model some node of its route serves (when every
    node there lists what it serves); an overflow node exists and is not also a primary or
    standby; rewriting is for the kinds whose request is one HTTP body (openai, generic);
    overflow needs one gateway (the cluster's scripts choose nodes without it)."""
    errs: list[str] = []
    for name, r in routes.items():
        if r.rewrite is not None and r.kind == "comfyui":
            errs.append(f"routes.{name}.rewrite: not for comfyui routes (openai and generic routes)")
        if r.overflow is not None:
            if cluster:
                errs.append(f"routes.{name}.overflow: not available in cluster mode (one gateway only)")
            for i, n in enumerate(r.overflow.nodes):
                if n not in nodes:
                    errs.append(f"routes.{name}.overflow.nodes.{i}: unknown node {n!r}")
                elif n in r.nodes or n in r.standby:
                    errs.append(f"routes.{name}.overflow.nodes.{i}: {n!r} is also in the route's "
                                f"{'nodes' if n in r.nodes else 'standby'}")
        members = [n for n in (*r.nodes, *r.standby, *r.overflow_nodes) if n in nodes]
        served = [_serves(nodes[n]) for n in members]
        if r.rewrite is None or not members or any(s is None for s in served):
            continue  # a node takes any model, or says at run time: nothing to check here
        for alias, target in r.rewrite.model.items():
            if not any(target in s for s in served if s is not None):
                errs.append(f"routes.{name}.rewrite.model.{alias}: {target!r} is served by no node of the route")
    for name, nc in nodes.items():
        if nc.rewrite is not None and isinstance(nc.models, list):
            listed = nc.models
            errs.extend(f"nodes.{name}.rewrite.model.{alias}: {target!r} is not in the node's models"
                        for alias, target in nc.rewrite.model.items() if target not in listed)
    return errs


def _serves(n: NodeConfig) -> set[str] | None:
    """The names a node serves under its route's names; None: any, or known only at run time."""
    own = n.rewrite.model if n.rewrite is not None else {}
    if isinstance(n.models, list):
        return {*n.models, *(a for a, t in own.items() if t in n.models)}
    return set(own) if own and n.models is None else None


def key_rules(keys: dict[str, KeyConfig]) -> list[str]:
    errs: list[str] = []
    digests: dict[str, str] = {}
    for name, k in keys.items():
        d = k.digest()
        if d in digests:
            errs.append(f"keys.{name}: same key as keys.{digests[d]}")
        digests[d or ""] = name
    return errs


def _valid_entries(section: Any, model: type[_M]) -> dict[str, _M]:
    """The entries of a raw ``name: mapping`` section that pass the schema on their own."""
    out: dict[str, _M] = {}
    for name, v in section.items() if isinstance(section, dict) else ():
        try:
            out[str(name)] = model.model_validate(v)
        except ValidationError:
            pass  # its own errors are already reported
    return out


def _mapping(v: Any) -> dict[Any, Any]:
    return v if isinstance(v, dict) else {}


def _str_list(v: Any) -> list[str]:
    return [x for x in v if isinstance(x, str)] if isinstance(v, list) else []


def raw_cross_check(raw: dict[str, Any]) -> list[str]:
    """The rules of ``Config.cross_check`` on a tree that failed the schema, so that one run of
    ``check`` shows every problem: references are read from the raw lists (a route whose other
    fields are wrong still names its nodes), the other rules run on the entries that are valid."""
    def section(key: str) -> dict[str, Any]:
        v = raw.get(key)
        return {str(k): x for k, x in v.items()} if isinstance(v, dict) else {}

    nodes, routes, keys = section("nodes"), section("routes"), section("keys")
    route_nodes = {n: {f: _str_list(r.get(f)) for f in ROUTE_NODE_FIELDS} for n, r in routes.items()
                   if isinstance(r, dict)}
    key_routes = {n: _str_list(k.get("routes")) for n, k in keys.items() if isinstance(k, dict)}
    fleet = _mapping(raw.get("fleet"))
    raw_pools, raw_providers = _mapping(fleet.get("pools")), _mapping(fleet.get("providers"))
    pools = {str(n): p for n, p in raw_pools.items() if isinstance(p, dict)}
    return [*reference_errors(set(nodes), route_nodes, set(routes), key_routes),
            *card_rules(set(section("cards")), {n: _mapping(x).get("card") for n, x in nodes.items()}),
            *route_rules(_valid_entries(routes, RouteConfig)), *key_rules(_valid_entries(keys, KeyConfig)),
            *fleet_rules(pools, {str(p) for p in raw_providers}, set(nodes),
                         {n: f["nodes"] for n, f in route_nodes.items()})]


def _shared_path(name: str, r: RouteConfig, first: str, routes: dict[str, RouteConfig]) -> list[str]:
    """Routes on one path are tried in file order: each needs a match, but for one fallback, and
    they share what the gateway decides before it reads the body (kind, auth)."""
    same = [n for n, x in routes.items() if x.path == r.path]
    errs = []
    if r.match is None and any(routes[n].match is None for n in same[: same.index(name)]):
        fallback = next(n for n in same if routes[n].match is None)
        errs.append(f"routes.{name}.path: {r.path!r} already used by route {fallback!r} "
                    "(routes sharing a path need a match, but for one fallback)")
    base = routes[first]
    for key in ("kind", "auth"):
        if getattr(r, key) != getattr(base, key):
            errs.append(f"routes.{name}.{key}: routes sharing path {r.path!r} must have the same {key} "
                        f"(route {first!r} has {getattr(base, key)!r})")
    return errs


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(node: Any, env: dict[str, str], path: str, errors: list[str]) -> Any:
    """Replace ${VAR} / ${VAR:-default} in every string of the parsed YAML tree."""
    if isinstance(node, dict):
        return {k: expand_env(v, env, f"{path}.{k}" if path else str(k), errors) for k, v in node.items()}
    if isinstance(node, list):
        return [expand_env(v, env, f"{path}.{i}", errors) for i, v in enumerate(node)]
    if isinstance(node, str):

        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            errors.append(f"{path}: environment variable {name} is not set")
            return m.group(0)  # keep the text: an empty value would add a second, misleading error

        return _VAR.sub(sub, node)
    return node


def _loc(loc: tuple[Any, ...]) -> str:
    # pydantic puts validator names (e.g. "function-after[...]") and union branches in loc; drop them.
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in ("literal",)))]
    return ".".join(parts) or "(root)"


# --- YAML: duplicate keys, alias expansion, where each key is --------------------------------------

MAX_ALIAS_NODES = 10_000  # nodes that aliases may add to the tree (a "billion laughs" is ~10⁹)
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _AliasBomb(Exception):
    pass


def _alias_growth(root: yaml.Node) -> int:
    """How many nodes expanding every alias would add to the tree, computed on the composed graph
    (where an alias is the same node object reached twice) without expanding anything."""
    size: dict[int, int] = {}
    active: set[int] = set()

    def expanded(n: yaml.Node) -> int:
        k = id(n)
        if k in size:
            return size[k]
        if k in active:
            raise _AliasBomb("an alias refers to the node that contains it")
        active.add(k)
        total = 1
        if isinstance(n, yaml.MappingNode):
            total += sum(expanded(kn) + expanded(vn) for kn, vn in n.value)
        elif isinstance(n, yaml.SequenceNode):
            total += sum(expanded(c) for c in n.value)
        active.discard(k)
        size[k] = total
        return total

    return expanded(root) - len(size)


def _key_text(n: yaml.ScalarNode | yaml.SequenceNode | yaml.MappingNode) -> str:
    return str(n.value) if isinstance(n, yaml.ScalarNode) else f"<{n.id}>"


def _key_lines(root: yaml.Node) -> tuple[dict[str, int], list[tuple[str, int, str]]]:
    """``dotted.path -> line`` of every key and list item, and the duplicated keys found
    (path, line, message). Runs on the tree as the constructor will expand it (bounded above)."""
    lines: dict[str, int] = {}
    dups: list[tuple[str, int, str]] = []
    checked: set[int] = set()

    def walk(n: yaml.Node, path: str) -> None:
        if isinstance(n, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            merges = []
            for kn, vn in n.value:
                if kn.tag == _MERGE_TAG:
                    merges.append(vn)
                    continue
                key = _key_text(kn)
                p = f"{path}.{key}" if path else key
                line = kn.start_mark.line + 1
                if (kn.tag, key) in first:
                    if id(n) not in checked:
                        dups.append((p, line, f"duplicate key (first at line {first[(kn.tag, key)]})"))
                else:
                    first[(kn.tag, key)] = line
                lines.setdefault(p, line)
                walk(vn, p)
            checked.add(id(n))
            for m in merges:  # merged keys (`<<: *base`) come after the mapping's own keys
                for item in m.value if isinstance(m, yaml.SequenceNode) else [m]:
                    walk(item, path)
        elif isinstance(n, yaml.SequenceNode):
            for i, c in enumerate(n.value):
                p = f"{path}.{i}"
                lines.setdefault(p, c.start_mark.line + 1)
                walk(c, p)

    walk(root, "")
    return lines, dups


def _line_of(lines: dict[str, int], path: str) -> int:
    """The line of the key at ``path``, else of the nearest mapping that holds it (a key that is
    missing is reported at its mapping)."""
    p = path
    while p:
        if p in lines:
            return lines[p]
        p = p.rpartition(".")[0]
    return 1


def _yaml_error(e: yaml.YAMLError, source: str | None) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    if source is not None:
        line = mark.line + 1 if mark else 1
        col = f" (column {mark.column + 1})" if mark else ""
        return f"{source}:{line}: (yaml): {problem}{col}"
    where = f"line {mark.line + 1} column {mark.column + 1}" if mark else "yaml"
    return f"(yaml) {where}: {problem}"


# What YAML allows in a stream (YAML 1.1 §5.1, PyYAML's Reader): tab, newlines and printable text.
_NOT_YAML_TEXT = re.compile("[^\x09\x0A\x0D\x20-\x7E\x85\xA0-\uD7FF\uE000-\uFFFD\U00010000-\U0010FFFF]")


def _line_col(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of ``text[index]``."""
    line_start = text.rfind("\n", 0, index) + 1
    return text.count("\n", 0, index) + 1, index - line_start + 1


def config_text(data: bytes, source: str | None = None) -> str:
    """The file's bytes as text, or a ConfigError that says where they are not text.

    UTF-8 (a leading BOM is dropped), or UTF-16 with a BOM, as YAML itself reads; and only the
    characters YAML allows. A NUL or a byte that is not UTF-8 is a config error like any other,
    at its line: an editor, a truncated copy or a binary file saved over the config makes them.
    """
    utf16 = data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))
    encoding = "utf-16" if utf16 else "utf-8-sig"
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as e:
        before = data[:e.start].decode(encoding, errors="replace")
        line, col = _line_col(before + "?", len(before))
        name = "UTF-16" if utf16 else "UTF-8"
        raise ConfigError([_located(source, line, "(encoding)", f"byte 0x{data[e.start]:02x} at column {col} is "
                                    f"not {name}: the file must be {name} text")]) from None
    bad = _NOT_YAML_TEXT.search(text)
    if bad is not None:
        line, col = _line_col(text, bad.start())
        what = "NUL byte" if bad.group() == "\0" else f"control character U+{ord(bad.group()):04X}"
        raise ConfigError([_located(source, line, "(encoding)", f"{what} at column {col}: the file must be text")])
    return text


def parse_config(text: str | bytes, env: dict[str, str] | None = None, source: str | None = None) -> Config:
    """Parse and validate YAML text; raise ConfigError with every problem found.

    With ``source`` (the file's name) each error reads ``source:line: dotted.path: message``, as
    ``nginx -t`` prints them; without, ``dotted.path: message``. CPU-bound and blocking: the
    daemon calls it from a thread (kilolined/ops/reload.py).
    """
    env = dict(os.environ) if env is None else env
    if isinstance(text, bytes):
        text = config_text(text, source)
    try:
        return _parse_text(text, env, source)
    except RecursionError:  # nesting deeper than the parser's recursion (thousands of [[[…)
        where = f"{source}: " if source is not None else ""
        raise ConfigError([f"{where}(yaml): nested too deeply"]) from None


def _parse_text(text: str, env: dict[str, str], source: str | None) -> Config:
    try:
        loader = yaml.SafeLoader(text)  # a character YAML refuses may stop it here already
    except yaml.YAMLError as e:
        raise ConfigError([_yaml_error(e, source)]) from None
    try:
        root = loader.get_single_node()
        if root is None:
            raw: Any = {}
            lines: dict[str, int] = {}
        else:
            try:
                growth = _alias_growth(root)
            except _AliasBomb as e:
                raise ConfigError([_located(source, root.start_mark.line + 1, "(yaml)", str(e))])
            if growth > MAX_ALIAS_NODES:
                raise ConfigError([_located(source, root.start_mark.line + 1, "(yaml)",
                                            f"aliases expand to more than {MAX_ALIAS_NODES} nodes")])
            lines, dups = _key_lines(root)
            if dups:
                raise ConfigError([_located(source, line, p, msg) for p, line, msg in dups])
            raw = loader.construct_document(root)
    except yaml.YAMLError as e:
        raise ConfigError([_yaml_error(e, source)])
    finally:
        loader.dispose()
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([_located(source, 1, "(root)", "expected a mapping at the top level")])
    problems: list[str] = []
    raw = expand_env(raw, env, "", problems)
    # A value whose variable is not set is reported once, as that: what the schema would say
    # of the ${VAR} text left in its place (too short for a key, not a URL) would mislead.
    unset = {line.partition(": ")[0] for line in problems}
    cfg: Config | None = None
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        for err in e.errors():
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown key"
            if _loc(err["loc"]) not in unset:
                problems.append(f"{_loc(err['loc'])}: {msg}")
        problems.extend(raw_cross_check(raw))
    else:
        problems.extend(cfg.cross_check())
        problems.extend(template_rules(cfg.routes, Path(source).parent if source is not None else Path.cwd()))
    if problems:
        located = []
        for line in problems:
            path, _, msg = line.partition(": ")
            located.append(_located(source, _line_of(lines, path), path, msg))
        raise ConfigError(located)
    assert cfg is not None
    return cfg


def template_rules(routes: dict[str, RouteConfig], base: Path) -> list[str]:
    """Templates are for comfyui routes; each one's workflow file is read (again, at every load)
    and its inputs found in it."""
    errs: list[str] = []
    for name, r in routes.items():
        if r.templates and r.kind != "comfyui":
            errs.append(f"routes.{name}.templates: only on comfyui routes")
            continue
        for t, tc in r.templates.items():
            problem = tc.load(base)
            if problem is not None:
                errs.append(f"routes.{name}.templates.{t}.{problem}")
    return errs


def config_digest(cfg: Config, data: bytes) -> str:
    """The version of a config: its bytes and its templates' workflow files (a changed workflow
    is a new config for the reload)."""
    h = hashlib.sha256(data)
    for r in cfg.routes.values():
        for tc in r.templates.values():
            h.update(tc._digest.encode())
    return h.hexdigest()


def _located(source: str | None, line: int, path: str, message: str) -> str:
    return f"{source}:{line}: {path}: {message}" if source is not None else f"{path}: {message}"


def load_config(path: str | Path, env: dict[str, str] | None = None) -> tuple[Config, str]:
    """Read and validate the file; returns the config and its version (sha256 of the bytes).

    Every failure is a ConfigError (the reload, SIGHUP, the watcher and ``check`` report it and
    keep going): ``path:line: dotted.path: message``, or ``path: …`` where no line applies (the
    file cannot be read: missing, a permission, a directory)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError([f"{path}: cannot read: {e.strerror or e}"]) from None
    cfg = parse_config(data, env, source=str(path))
    return cfg, config_digest(cfg, data)


def default_config_path(cli_path: str | None) -> str:
    if cli_path:
        return cli_path
    if os.environ.get("KILOLINE_CONFIG"):
        return os.environ["KILOLINE_CONFIG"]
    if Path("etc/kiloline.yaml").exists():
        return "etc/kiloline.yaml"
    return "/etc/kiloline/kiloline.yaml"
