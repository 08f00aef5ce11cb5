"""``Expect: 100-continue``: the client sends its head and waits before uploading its body.

aiohttp answers ``100 Continue`` as soon as a route matches, before any handler runs, so a client
with a wrong key or a body over ``server.max_body_mb`` uploaded all of it before hearing 401 or
413. As nginx does, the gateway says ``100 Continue`` only where it is about to read the body:
after auth, the limits and the size check. A request refused before that gets its final answer
instead, and its connection is closed (the client may or may not send the body now: the next
request on that connection could not be told apart from it).
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.web_exceptions import HTTPRequestEntityTooLarge

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


async def defer(request: web.Request) -> None:
    """The routes' expect handler: nothing yet (``let_body_come`` answers when the body is read).
    Expectations other than 100-continue are ignored, as nginx does."""
    return None


def waits_for_continue(request: web.BaseRequest) -> bool:
    """The client asked for ``100 Continue`` and its body has not (all) arrived."""
    expect = request.headers.get("Expect")
    return (expect is not None and expect.strip().lower() == "100-continue" and request.version >= (1, 1)
            and not request.content.is_eof())


def let_body_come(request: web.BaseRequest) -> None:
    """Called just before the body is read: a body declared over the app's limit is refused (413,
    before the client sends it); a client waiting for ``100 Continue`` gets it."""
    declared = request.content_length
    if declared is not None and declared > request.client_max_size:
        raise HTTPRequestEntityTooLarge(max_size=request.client_max_size, actual_size=declared)
    if waits_for_continue(request):
        tr = request.transport
        if tr is not None and not tr.is_closing():
            tr.write(CONTINUE)  # no response has begun: the interim answer goes straight out
