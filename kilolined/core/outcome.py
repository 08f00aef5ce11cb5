"""How an admitted request ends, in the client's terms: one vocabulary for every client mode.

Adapters and the lease scope raise these; the sinks (sync response, OpenAI stream, job events)
render them. The mapping from a node failure to 502/504 is written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kilolined.core.verdict import NodeVerdict
from kilolined.scheduling.queue import Rejected


class Failure(Exception):
    """The request failed after admission (or was refused by the queue while it waited)."""

    #: set when the node failed after its answer began (``mid_response``): what happened
    cut: NodeVerdict | None = None

    def __init__(self, type_: str, message: str, http_status: int | None = None, body: bytes | None = None,
                 content_type: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.type, self.message, self.http_status = type_, message, http_status
        self.body, self.content_type = body, content_type
        self.retry_after = retry_after

    @classmethod
    def upstream(cls, reason: str, timeout: bool) -> Failure:
        if timeout:
            return cls("upstream_timeout", reason, 504)
        return cls("upstream_error", reason, 502)

    @classmethod
    def mid_response(cls, node: str, cut: NodeVerdict) -> Failure:
        """The node failed after its answer had begun (bytes read, or sent on to the client): no
        re-queue is possible. ``cut.reason`` names what happened ("node lost (connection dropped
        mid-response)"), never an exception class or an address."""
        f = cls("upstream_error", f"node {node} failed: {cut.reason}", 502)
        f.cut = cut
        return f

    @classmethod
    def rejected(cls, r: Rejected) -> Failure:
        return cls(r.type, r.message, r.status, retry_after=r.retry_after)

    @property
    def outcome(self) -> str:
        """The ``kiloline_requests_total`` outcome word."""
        if self.type == "upstream_timeout":
            return "timeout"
        if self.type == "upstream_error" and (self.http_status or 502) >= 500:
            return "upstream_error"
        return "failed"


class Cancelled(Exception):
    """The job was cancelled (DELETE, or interrupted on the node by someone)."""


@dataclass
class Result:
    """A completed request's answer, kept for ``/v1/jobs/{id}/result``."""

    http_status: int
    content_type: str
    body: bytes
    result: Any = None  # what output_ready.result carries (parsed JSON ≤ 1 MB, or an adapter's view)
    files: list[tuple[str, str]] = field(default_factory=list)  # comfyui: (node, /view query)
