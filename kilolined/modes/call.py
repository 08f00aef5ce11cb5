"""``Call``: what the pipeline learns about one client request, for its answer and its log line.

A small object of a low layer, so that every layer above (stages, runner, sinks, jobs) can carry
it without importing the HTTP application.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from kilolined.adapters.base import Adapter
from kilolined.adapters.generic import GenericAdapter
from kilolined.core.auth import Principal
from kilolined.core.errors import anthropic_error_response, error_response
from kilolined.core.templates import is_images
from kilolined.scheduling.queue import Rejected, Ticket
from kilolined.wire.proxy import Exchange


@dataclass(slots=True)
class Call:
    request: web.Request
    request_id: str
    started: float
    route: str = "-"
    kind: str = "generic"
    anthropic: bool = False  # a path of Anthropic's API on an openai route: errors in Anthropic's shape
    key: str = "-"
    mode: str = "sync"
    node: str = "-"
    status: int = 0
    queue_wait: float | None = 0.0  # None: not known when the line is written (an async job's 202)
    bytes_out: int = 0
    headers: dict[str, str] = field(default_factory=dict)  # rate-limit headers for every response
    adapter: Adapter = field(default_factory=GenericAdapter)
    principal: Principal | None = None
    subject: str = "-"  # whom limits count against: the key id, or ip:<client>
    client_ip: str = ""
    trusted_peer: bool = False  # the peer is one of server.trusted_proxies (what it forwards is believed)
    tail: str = "/"  # the node path with its query
    route_name: str = "-"  # the scheduler's route (ad-hoc targets: adhoc:<url>; `route` is its label)
    pinned_node: str | None = None
    ticket: Ticket | None = None
    unqueued_path: str = "/"  # the tail without query, percent-decoded, for unqueued_paths globs
    exchange: Exchange | None = None
    budget_taken: bool = False  # a request budget unit taken but not yet spent on an admitted request
    cost: float | None = None  # what it holds of a node's capacity; None when its route has no ``cost``
    route_choices: tuple[str, ...] = ()  # routes sharing the path whose match may hold (routing.py)
    model: str | None = None  # the body's model, read when the route's nodes declare models (models.py)
    swap: bool | None = None  # its node had to load the model; None when the node has no model state
    admin: bool = False  # the admin key on a comfyui route: reads and stops every prompt, sends none
    #: the model the client named, when a rewrite may rename it: the answer carries this name
    asked_model: str | None = None

    @property
    def key_id(self) -> str | None:
        return self.principal.key_id if self.principal is not None else None

    def error(self, status: int, type_: str, message: str, retry_after: float | None = None,
              param: str | None = None) -> web.Response:
        if self.anthropic:
            return anthropic_error_response(status, type_, message, request_id=self.request_id,
                                            retry_after=retry_after, headers=self.headers)
        return error_response(status, type_, message, request_id=self.request_id, retry_after=retry_after,
                              headers=self.headers, openai=self.kind == "openai" or self.images, param=param)

    @property
    def images(self) -> bool:
        """OpenAI's Images API on a comfyui route: its errors are in OpenAI's shape too."""
        return self.kind == "comfyui" and is_images(self.request.method, self.unqueued_path)

    def rejected(self, r: Rejected) -> web.Response:
        return self.error(r.status, r.type, r.message, r.retry_after)
