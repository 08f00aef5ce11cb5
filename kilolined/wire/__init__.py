"""Bytes to and from the nodes: the upstream HTTP client, the proxy relay, WebSocket relay, deadlines."""
