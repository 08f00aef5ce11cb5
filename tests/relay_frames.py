"""HTTP/1.1 frames the relay tests send a peer."""

from __future__ import annotations

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def piece(i: int) -> bytes:
    data = b"data: {\"n\": %d}\n\n" % i
    return b"%x\r\n%s\r\n" % (len(data), data)


def data(i: int) -> bytes:
    return b"data: {\"n\": %d}\n\n" % i
