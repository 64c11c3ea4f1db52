"""Small helpers for testing credential provider plugins (standard library only)."""

from __future__ import annotations

import base64
import binascii
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from ._endpoint import ScriptedEndpoint

__all__ = [
    "SDK_VARIABLES",
    "call_concurrently",
    "check_cached_then_refreshed",
    "check_entry_point",
    "unsigned_jwt",
    "unverified_claims",
]

T = TypeVar("T")

SDK_VARIABLES: tuple[str, ...] = (
    "AGENT_SANDBOX_BROKER_URL",
    "AGENT_SANDBOX_CA_BUNDLE",
    "AGENT_SANDBOX_TEMPLATE",
    "AGENT_SANDBOX_TOKEN",
    "AGENT_SANDBOX_TOKEN_FILE",
    "AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD",
    "AGENT_SANDBOX_LOAD_PLUGINS",
    "AGENT_SANDBOX_DEBUG",
    "AGENT_SANDBOX_TRUST_ENV_PROXIES",
    "AGENT_SANDBOX_TTL_SECONDS",
    "AGENT_SANDBOX_KEEPALIVE_TTL_SECONDS",
    "AGENT_SANDBOX_BROKER_PROTOCOL",
    # the original package's variables, read as aliases (ours first)
    "BROKER_URL",
    "BROKER_TOKEN",
    "AGENT_SANDBOX_TOKEN_PATH",
    "BROKER_TOKEN_PATH",
    "KSA_TOKEN_PATH",
    "AGENT_SANDBOX_WARMPOOL",
    "SANDBOX_WARMPOOL",
    "AGENT_SANDBOX_NAMESPACE",
    "SANDBOX_NAMESPACE",
    "SANDBOX_TTL_SECONDS",
)
"""Every environment variable the SDK reads. Remove them all (and your platform's variables)
before a test that uses ``os.environ``, so the developer's or CI's own settings cannot leak in."""

_FAKE_SIGNATURE = base64.urlsafe_b64encode(b"not a signature").rstrip(b"=").decode()


def _b64(obj: object) -> str:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def unsigned_jwt(claims: Mapping[str, Any] | None = None, *, ttl: int = 300) -> str:
    """A JWT-shaped token (``header.payload.signature``) whose signature is NOT valid.

    The payload is ``{"iat": now, "exp": now + ttl}`` updated with ``claims`` (give ``aud``,
    ``iss``, ``sub`` ... as your platform would; a negative ``ttl`` makes an expired token).
    The header says ``RS256``. For client-side unit tests only: the SDK decodes a token's
    claims (``aud``, ``exp``) without verifying it, but a broker rejects this token. For a
    really signed token use ``LocalBroker.add_issuer(...).issue_token(...)``.
    """
    now = int(time.time())
    payload: dict[str, Any] = {"iat": now, "exp": now + ttl}
    payload.update(claims or {})
    return f"{_b64({'alg': 'RS256', 'typ': 'JWT'})}.{_b64(payload)}.{_FAKE_SIGNATURE}"


def unverified_claims(token: str) -> dict[str, Any]:
    """The payload of a JWT, decoded WITHOUT verifying its signature (to assert on ``exp``...).

    Raises ``ValueError`` (whose message never contains the token) when ``token`` is not a JWT
    with a JSON object payload.
    """
    parts = token.split(".")
    if len(parts) != 3:
        raise ValueError(
            f"not a JWT: expected 3 dot-separated parts, got {len(parts)}; "
            "pass the token exactly as the provider returned it"
        )
    payload = parts[1]
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ValueError(
            "not a JWT: the payload (second part) is not base64url-encoded JSON"
        ) from None
    if not isinstance(claims, dict):
        raise ValueError(f"not a JWT: the payload is a JSON {type(claims).__name__}, not an object")
    return claims


def call_concurrently(fn: Callable[[], T], callers: int = 16, *, timeout: float = 10.0) -> list[T]:
    """Call ``fn`` from ``callers`` threads released at the same moment; return the results.

    For testing single-flight behaviour: for example that 16 threads asking one
    ``DefaultCredentials`` for a token cause one fetch at your platform's endpoint. The results
    are in completion order. If a call raises, the first exception (in completion order) is
    re-raised once every thread finished; if threads are still running after ``timeout``
    seconds, ``TimeoutError`` names how many.
    """
    if callers < 1:
        raise ValueError(f"callers must be at least 1, not {callers}")
    barrier = threading.Barrier(callers)
    lock = threading.Lock()
    results: list[T] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait(timeout)
            value = fn()
        except BaseException as exc:
            with lock:
                errors.append(exc)
        else:
            with lock:
                results.append(value)

    threads = [
        threading.Thread(target=worker, name=f"call-concurrently-{i}", daemon=True)
        for i in range(callers)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    running = sum(thread.is_alive() for thread in threads)
    if running:
        raise TimeoutError(
            f"{running} of {callers} concurrent calls of {getattr(fn, '__name__', fn)!r} did not "
            f"finish within {timeout}s (a deadlock, or a fetch slower than the timeout?)"
        )
    if errors:
        raise errors[0]
    return results


def check_cached_then_refreshed(
    get_token: Callable[[], str],
    endpoint: ScriptedEndpoint,
    *,
    callers: int = 16,
    timeout: float = 5.0,
) -> None:
    """Check the SDK's cache contract for a provider whose tokens are not file-backed.

    ``get_token`` returns a token for one audience through the SDK (for example
    ``lambda: source.get_credential(broker_url).token`` with one ``DefaultCredentials``);
    ``endpoint`` is the :class:`ScriptedEndpoint` your provider fetches from, which must not
    have been asked yet and must mint a new, short-lived token (a few seconds) per request.

    Raises ``AssertionError`` (saying which rule broke) unless: ``callers`` concurrent calls
    all get the same token from ONE request to ``endpoint`` (``TimeoutError`` if they take more
    than 10 s); later calls get that token from the cache; the SDK fetches again by itself
    within ``timeout`` seconds, never returning the first token when asked at or after its
    ``exp`` (the fetch itself may arrive after it on a loaded machine: the SDK asks for a new
    token in the last 10 % of the old one's lifetime); and the token is then a new one. Calls
    ``get_token`` every 50 ms while waiting for the refresh.
    """

    def check(ok: bool, rule: str) -> None:
        if not ok:
            raise AssertionError(f"{rule} (requests at the endpoint: {len(endpoint.requests)})")

    check(not endpoint.requests, "the endpoint was asked before the check started")
    tokens = call_concurrently(get_token, callers, timeout=10.0)
    check(len(tokens) == callers, f"expected {callers} tokens, got {len(tokens)}")
    check(len(set(tokens)) == 1, f"{callers} concurrent callers got {len(set(tokens))} tokens")
    check(len(endpoint.requests) == 1, f"{callers} concurrent callers caused more than 1 fetch")
    first = tokens[0]
    first_exp = float(unverified_claims(first)["exp"])

    deadline = time.monotonic() + timeout
    while len(endpoint.requests) == 1 and time.monotonic() < deadline:
        asked = time.time()
        token = get_token()
        if len(endpoint.requests) == 1:
            check(token == first, "a call got a new token without a new fetch")
        if token == first:  # asked at or after its exp: the SDK served an expired token
            check(asked < first_exp, "the SDK returned the token after its exp, not fetching")
        time.sleep(0.05)
    check(len(endpoint.requests) == 2, f"expected one refresh fetch within {timeout}s")
    check(get_token() != first, "after the refresh fetch the SDK still returned the old token")


def check_entry_point(
    name: str,
    value: str,
    *,
    distribution: str,
    not_imported: Sequence[str] = ("httpx", "k8s_agent_sandbox"),
) -> object:
    """Check an installed plugin's registration and import cost; return the loaded plugin.

    Raises ``AssertionError`` (saying which rule broke) unless exactly one entry point named
    ``name`` is registered in the ``k8s_agent_sandbox_awx.providers`` group, its value is
    ``value`` (``"my_module"`` or ``"my_module:attr"``), it comes from the distribution
    ``distribution`` and it loads; and unless importing its module in a fresh interpreter
    loads none of the modules ``not_imported`` (by default httpx and the upstream client:
    import those inside your hook, so that discovery stays fast for everyone who has your
    plugin installed). Needs the plugin installed (``pip install -e .``).
    """
    from importlib.metadata import entry_points

    from ..hookspecs import ENTRY_POINT_GROUP

    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if len(found) != 1:
        raise AssertionError(
            f"expected one entry point {name!r} in group {ENTRY_POINT_GROUP!r}, found "
            f"{len(found)}: install the plugin (pip install -e .) exactly once"
        )
    [entry] = found
    if entry.value != value:
        raise AssertionError(f"entry point {name!r} is {entry.value!r}, expected {value!r}")
    owner = entry.dist.name if entry.dist is not None else None
    if owner != distribution:
        raise AssertionError(
            f"entry point {name!r} comes from distribution {owner!r}, expected {distribution!r}"
        )
    plugin = entry.load()
    module = value.partition(":")[0].strip()
    if not all(part.isidentifier() for part in module.split(".")):
        raise AssertionError(f"entry point {name!r}: {module!r} is not a module name")
    code = (
        f"import json, sys; import {module}; "
        f"print(json.dumps(sorted(m for m in {list(not_imported)!r} if m in sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise AssertionError(
            f"importing {module} in a fresh interpreter failed (exit {done.returncode}): "
            f"{done.stderr.strip()[-2000:]}"
        )
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    if loaded:
        raise AssertionError(
            f"importing {module} loads {', '.join(loaded)}: import them inside the hook instead"
        )
    return plugin
