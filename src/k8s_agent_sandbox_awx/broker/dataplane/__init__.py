"""The data plane: a request to a sandbox checked, routed, forwarded and its answer relayed
(HTTP and WebSockets; port requests)."""
