"""The broker: the server, its backends and the identity it verifies."""
