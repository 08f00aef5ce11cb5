"""The live parts of one daemon as the HTTP layer sees them.

``Runtime`` holds the core state (config, scheduler, nodes, limits, keys, pools); the parts
built on it — jobs, webhook delivery, the notifier — sit beside it here instead of inside it,
so that nothing below the HTTP layer needs to know them.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from kilolined.modes.jobs import Jobs
from kilolined.ops.notify import Notifier
from kilolined.ops.runtime import Runtime
from kilolined.ops.webhooks import WebhookDeliverer


@dataclass(eq=False)
class Gateway:
    rt: Runtime
    jobs: Jobs
    webhooks: WebhookDeliverer
    notifier: Notifier
    log_json: bool = False


GW: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
RT: web.AppKey[Runtime] = web.AppKey("runtime", Runtime)
