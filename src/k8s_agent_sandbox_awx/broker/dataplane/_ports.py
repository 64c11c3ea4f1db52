"""Port requests: a data-plane request to a port of the user's own server in the sandbox.

A data-plane request whose ``X-Sandbox-Port`` is not the runtime's port (8888) is a port
request (docs/broker-api.md, "Ports"). It passes every check a runtime request passes (token,
owner, claim binding, Ready), and besides:

- the scope is decided by the port, not by the path: a port request needs ``commands`` (a
  caller who may run commands can reach the port from inside the sandbox anyway; a sandbox
  granted only ``files`` reaches no port);
- the caller's policy must allow the port (``Policy.ports``): else ``403 port_not_allowed``
  naming the port and the allowed ones;
- its target is forwarded as sent (:func:`._target.port_target`), never counted as a command;
- a port nothing listens on is ``502 port_not_listening`` naming the port and the sandbox (only
  then: a router that cannot be reached, or a TLS failure, is ``502 sandbox_unreachable`` saying
  so: :mod:`._unreachable`).
"""

from __future__ import annotations

import logging

from starlette.datastructures import Headers

from ..backends._interface import ClaimState
from ..common._errors import ApiError
from ..common._route_names import logged_method
from ..identity._policy import Caller
from ..identity._rules import PolicyDenied, PolicySource
from ..server._ws import ws_protocol

__all__ = [
    "PORT_SCOPE",
    "check_port_allowed",
    "log_port_request",
    "not_listening",
    "refuse_unsupported_upgrade",
    "ws_protocol",
]

PORT_SCOPE = "commands"
"""The scope a port request needs (see the module docstring)."""

log = logging.getLogger("k8s_agent_sandbox_awx.broker")


def check_port_allowed(
    policies: PolicySource, caller: Caller, state: ClaimState, port: int
) -> None:
    """403 unless the caller's policy allows ``port`` (and the sandbox holds the scope)."""
    if PORT_SCOPE not in state.scopes:
        raise ApiError(
            403,
            "scope_denied",
            f"sandbox {state.name!r} was not granted the {PORT_SCOPE!r} scope, which a request "
            f"to port {port} needs (granted: {sorted(state.scopes)}); request it at create, "
            "within the caller's policy",
        )
    try:
        policy = policies.policy_for(caller)
    except PolicyDenied as exc:
        raise ApiError(403, exc.code, exc.detail) from None
    if not policy.port_ranges.allows(port):
        allowed = policy.port_ranges.describe()
        raise ApiError(
            403,
            "port_not_allowed",
            f"port {port} of sandbox {state.name!r} is not allowed by the caller's policy "
            f"(its ports: {allowed or 'none'}); use an allowed port, or ask the broker's "
            "operators to add it to the policy's ports",
        )


def not_listening(name: str, port: int, *, via_router: bool = False) -> ApiError:
    """The answer for a port no server listens on: the connection to it was refused, or the
    router answered that it could not connect to it (``via_router``; :mod:`._unreachable`)."""
    how = " (the router could not connect to it)" if via_router else ""
    return ApiError(
        502,
        "port_not_listening",
        f"nothing listens on port {port} in sandbox {name!r}{how}: start a server on it "
        "first, listening on 127.0.0.1 or 0.0.0.0, in the background (from the command "
        f"line: agent-sandbox-awx run --sandbox {name} --background --timeout 0 -- CMD; "
        "from Python: sandbox.commands.run(..., background=True, timeout=0))",
    )


def log_port_request(name: str, port: int, method: str) -> None:
    """One line per port request: never a header (no token can reach the log), nor the path
    (a user's server may carry secrets in it, ``/reset/<code>``)."""
    log.info("sandbox %s: port %d request %s", name, port, logged_method(method))


def refuse_unsupported_upgrade(headers: Headers) -> None:
    """A WebSocket handshake the server passed on as a plain request (no ``websockets``)."""
    if "websocket" in headers.get("upgrade", "").lower():
        raise ApiError(
            501,
            "websocket_unsupported",
            "this broker cannot accept WebSocket upgrades: its server lacks the 'websockets' "
            "library (install the broker with its [broker] extra)",
        )
