"""The one request path over httpx, its settings, and the sync and async transports."""
