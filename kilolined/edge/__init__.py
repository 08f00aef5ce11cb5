"""The HTTP edge: the listener, the aiohttp application, the admin and jobs endpoints, the dashboard.

A request enters here (docs/ARCHITECTURE.md, "The journey of one request")."""
