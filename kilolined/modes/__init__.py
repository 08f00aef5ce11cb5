"""Client modes: how a leased call reaches the client (sync, SSE, async job with webhook)."""
