"""The live gateway: runtime state, health checks, the slow-node watch, reload, notifications, webhooks,
metrics, history."""
