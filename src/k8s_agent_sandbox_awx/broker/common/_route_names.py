"""Route templates: what the logs and the metrics call a request, never its raw path.

A raw path can hold a file's name (``/download/secret-plans.txt``), a command's id or a sandbox's
name; a metric label must come from a small, fixed set. So every request is named by its
route's template (``/v1/sandboxes/{name}``, ``/rpc op=create``, ``{data} /commands/{id}/events``),
and anything the broker does not route is ``unmatched`` (``{data} other`` on the data plane). A
port request's path is its user's: it is ``{data} port`` (``{data} websocket`` for a WebSocket),
whatever the path.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Final

__all__ = [
    "METHODS",
    "PORT_ROUTE",
    "WEBSOCKET_ROUTE",
    "action_of",
    "data_route",
    "issuer_route",
    "logged_method",
    "method_label",
    "rpc_route",
    "v1_route",
]

METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""The methods a label may name; any other is ``other``."""

UNMATCHED: Final = "unmatched"
DATA: Final = "{data} "
WEBSOCKET_ROUTE: Final = DATA + "websocket"
"""Every WebSocket handshake on the data plane (a port request's: its path is the user's)."""
PORT_ROUTE: Final = DATA + "port"
"""Every HTTP port request (its path is the user's server's, not one of the runtime's routes;
its port is a field of the access line apart, never a metric label)."""

_V1_FIXED: Final = frozenset({"/v1/healthz", "/v1/whoami", "/v1/sandboxes"})
_DATA_FIXED: Final = frozenset(
    {"/", "/execute", "/upload", "/list", "/commands"}
    | {"/fs/read", "/fs/list", "/fs/exists", "/fs/info", "/fs/watch"}
    | {"/fs/write", "/fs/mkdir", "/fs/move", "/fs/remove"}
)
_DATA_FILE_ROUTES: Final = ("download", "list", "exists")
_COMMAND_ACTIONS: Final = frozenset({"events", "kill", "stdin"})

_ACTIONS: Final = {
    ("POST", "/v1/sandboxes"): "create",
    ("DELETE", "/v1/sandboxes/{name}"): "delete",
    ("PUT", "/v1/sandboxes/{name}/lifetime"): "extend",
    ("POST", "/rpc op=create"): "create",
    ("POST", "/rpc op=delete"): "delete",
    ("POST", "/rpc op=extend"): "extend",
}
"""The control-plane requests that change a claim: each is a decision the audit log records."""


def method_label(method: str) -> str:
    return method if method in METHODS else "other"


_LOGGED_METHOD: Final = re.compile(r"[A-Z][A-Z-]{0,19}")


def logged_method(method: str) -> str:
    """A method as a log line writes it: as it is when it is 1 to 20 upper-case letters or
    ``-`` (``GET``, ``PROPFIND``, ``VERSION-CONTROL``), else ``other`` (a method is the
    caller's token: any length, any token characters)."""
    return method if _LOGGED_METHOD.fullmatch(method) else "other"


def v1_route(path: str) -> str:
    """The template of a ``/v1`` path (as :class:`..control._v1.V1` routes them)."""
    if path in _V1_FIXED:
        return path
    if path.startswith("/v1/sandboxes/"):
        rest = path[len("/v1/sandboxes/") :]
        if "/" not in rest:
            return "/v1/sandboxes/{name}"
        if rest.count("/") == 1 and rest.endswith("/lifetime"):
            return "/v1/sandboxes/{name}/lifetime"
    return "/v1 " + UNMATCHED


def rpc_route(op: object, ops: Collection[str]) -> str:
    """The template of an ``/rpc`` request with body ``{"op": op}`` (``ops``: the served ones;
    any other op is ``other``)."""
    return f"/rpc op={op}" if isinstance(op, str) and op in ops else "/rpc op=other"


def data_route(path: str) -> str:
    """The template of a data-plane path: the runtime's routes, their arguments as ``{...}``."""
    if path in _DATA_FIXED:
        return DATA + path
    first, _, rest = path[1:].partition("/")
    if first in _DATA_FILE_ROUTES:
        return DATA + f"/{first}/{{path}}"
    if first == "commands":
        ident, _, sub = rest.partition("/")
        if not sub and ident:
            return DATA + "/commands/{id}"
        if sub in _COMMAND_ACTIONS:
            return DATA + f"/commands/{{id}}/{sub}"
        return DATA + "/commands/{id}/other"
    if first == "fs":
        return DATA + "/fs/other"
    if first == "code":
        return DATA + _code_route(rest)
    return DATA + "other"


def _code_route(rest: str) -> str:
    """The template of a ``/code/...`` path (``rest``: what follows ``/code/``)."""
    noun, _, tail = rest.partition("/")
    ident, _, sub = tail.partition("/")
    if noun in ("execute", "executions", "contexts") and not tail:
        return f"/code/{noun}"
    if noun == "executions" and ident and sub in ("", "events", "interrupt"):
        return "/code/executions/{id}" + (f"/{sub}" if sub else "")
    if noun == "contexts" and ident and sub in ("", "restart", "remove"):
        return "/code/contexts/{id}" + (f"/{sub}" if sub else "")
    return "/code/other"


def issuer_route(path: str) -> str:
    """The template of a local issuer's document."""
    for doc in ("jwks", ".well-known/openid-configuration"):
        if path.endswith("/" + doc) and path.count("/") == 3 + doc.count("/"):
            return "/issuers/{name}/" + doc
    return "/issuers " + UNMATCHED


def action_of(method: str, route: str) -> str | None:
    """``create``, ``delete`` or ``extend`` for a request that changes a claim, else ``None``."""
    return _ACTIONS.get((method, route))
