"""Google Cloud metadata-server credential provider for ``k8s_agent_sandbox_awx``.

Registered under the entry-point group ``k8s_agent_sandbox_awx.providers`` as ``google-cloud``.
On Compute Engine, GKE (with Workload Identity) and Cloud Run it asks the metadata server for an
identity token of the attached service account, with the broker URL as audience.

Two outcomes are kept apart on purpose:

- **not on Google Cloud**: the metadata host does not resolve, refuses the connection or does
  not accept it within a short connect timeout. The provider answers "not here", quickly and
  without retrying.
- **on Google Cloud but failing**: something accepted the connection and then answered with an
  error status, without the ``Metadata-Flavor: Google`` header, with something that is not a
  JWT, or not at all within the timeout. That is a ``CredentialSourceError``: discovery stops
  instead of silently using another identity.

Importing this module is cheap: httpx and the error classes are imported on first fetch.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import urlencode, urlsplit

from k8s_agent_sandbox_awx import Credential, CredentialRequest, ProviderInfo, hookimpl

if TYPE_CHECKING:
    import httpx

__all__ = [
    "CONNECT_TIMEOUT",
    "DEFAULT_METADATA_HOST",
    "IDENTITY_PATH",
    "PROVIDER_NAME",
    "agent_sandbox_get_credential",
    "agent_sandbox_provider_info",
]
__version__ = "0.1.0"

PROVIDER_NAME = "google-cloud"
"""The entry-point name; also ``Credential.provider`` for tokens from this plugin."""

HOST_VAR = "GCE_METADATA_HOST"
DEFAULT_METADATA_HOST = "metadata.google.internal"
IDENTITY_PATH = "/computeMetadata/v1/instance/service-accounts/default/identity"
CONNECT_TIMEOUT = 1.0
"""Seconds to resolve the metadata host and to connect to it before deciding "not here"."""

_RETRY_STATUSES = frozenset({500, 502, 503, 504})
_RETRY_PAUSE = 0.2
_MAX_REPLY_BYTES = 64 * 1024
_JWT_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")

_log = logging.getLogger(__name__)


class _NotHere(Exception):
    """The metadata server cannot be reached at all: this is not Google Cloud."""


@hookimpl
def agent_sandbox_provider_info() -> ProviderInfo:
    return ProviderInfo(
        # Probing the metadata server costs a DNS lookup (and a connection): consult this
        # provider after the ones that only look at the environment.
        priority=-100,
        hint=(
            "on Compute Engine, GKE or Cloud Run, attach a service account to the workload "
            f"(GKE: Workload Identity); {HOST_VAR} overrides the metadata host"
        ),
        description="Google Cloud metadata server identity token (GCE, GKE, Cloud Run)",
    )


@hookimpl
def agent_sandbox_get_credential(request: CredentialRequest) -> Credential | None:
    hostname, port, name = _metadata_host(request.environ)
    try:
        token = fetch_identity_token(hostname, port, request.audience, request.timeout)
    except _NotHere as exc:
        request.not_here(str(exc))
        return None
    return Credential(
        token, provider=PROVIDER_NAME, file_backed=False, source=f"metadata server {name}"
    )


def fetch_identity_token(hostname: str, port: int, audience: str, timeout: float) -> str:
    """Fetch the default service account's identity token for ``audience``; return the JWT.

    Raises ``_NotHere`` when the host cannot be resolved or connected to within
    ``CONNECT_TIMEOUT`` (never retried), and ``CredentialSourceError`` for everything that
    happens after a connection was made. A ``5xx`` reply or a dropped connection is retried
    once within ``timeout``.
    """
    name = _display(hostname, port)
    connect_timeout = min(CONNECT_TIMEOUT, timeout)
    deadline = time.monotonic() + timeout
    address = _resolve(hostname, port, connect_timeout)
    import httpx  # after resolving: off Google Cloud, "not here" costs no httpx import

    query = urlencode({"audience": audience, "format": "full"})
    url = f"http://{_display(address[0], address[1])}{IDENTITY_PATH}?{query}"
    headers = {
        # The connection goes to the resolved address; the request names the metadata host.
        "Host": name,
        "Metadata-Flavor": "Google",
        "User-Agent": f"k8s-agent-sandbox-awx-google-cloud/{__version__}",
    }
    attempt = 0
    while True:
        attempt += 1
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _fail(f"the metadata server {name} did not answer within {timeout:g}s; {_RETRY_FIX}")
        _log.debug("requesting an identity token from the metadata server %s", name)
        try:
            # trust_env=False: the metadata server is link-local and must never be proxied.
            with httpx.Client(
                timeout=httpx.Timeout(remaining, connect=min(connect_timeout, remaining)),
                follow_redirects=False,
                trust_env=False,
            ) as client:
                response = client.get(url, headers=headers)
                body = response.read()
        except httpx.ConnectTimeout:
            raise _NotHere(
                f"{name} did not accept a connection within {connect_timeout:g}s: "
                "not on Google Cloud"
            ) from None
        except httpx.ConnectError as exc:
            raise _NotHere(
                f"cannot connect to {name} ({_os_reason(exc)}): not on Google Cloud"
            ) from None
        except httpx.TimeoutException:
            _fail(
                f"connected to the metadata server {name}, but it did not answer within "
                f"{timeout:g}s; {_RETRY_FIX}"
            )
        except httpx.TransportError as exc:
            if attempt == 1 and _pause_before_retry(deadline):
                continue
            _fail(
                f"connected to the metadata server {name}, but the exchange failed "
                f"({type(exc).__name__}: {exc}); {_RETRY_FIX}"
            )
        if (
            response.status_code in _RETRY_STATUSES
            and attempt == 1
            and _pause_before_retry(deadline)
        ):
            continue
        return _token_from_reply(response, body, name)


_RETRY_FIX = "retry; if it persists, check the workload's service account and the metadata server"


def _token_from_reply(response: httpx.Response, body: bytes, name: str) -> str:
    status = response.status_code
    if response.headers.get("Metadata-Flavor") != "Google":
        _fail(
            f"{name} answered HTTP {status} without the `Metadata-Flavor: Google` header, so it "
            "is not a Google metadata server; if this is not Google Cloud, something on this "
            f"network answers for {name}: set {HOST_VAR} correctly, or turn this plugin off "
            "(AGENT_SANDBOX_LOAD_PLUGINS lists the plugins to load)"
        )
    if 300 <= status < 400:
        _fail(f"the metadata server {name} answered HTTP {status} (a redirect); it is not followed")
    if status != 200:
        detail = _error_detail(body)
        _fail(
            f"the metadata server {name} answered HTTP {status}"
            f"{f' ({detail})' if detail else ''}; {_STATUS_FIX.get(status, _RETRY_FIX)}"
        )
    if len(body) > _MAX_REPLY_BYTES:
        _fail(
            f"the reply of the metadata server {name} is larger than {_MAX_REPLY_BYTES} bytes; "
            "expected a JWT"
        )
    token = body.strip().decode("ascii", "replace")
    if not token:
        _fail(f"the metadata server {name} returned an empty token; {_RETRY_FIX}", kind="empty")
    parts = token.split(".")
    if len(parts) != 3 or not all(part and set(part) <= _JWT_ALPHABET for part in parts[:2]):
        _fail(
            f"the metadata server {name} returned something that is not a JWT (expected three "
            f"dot-separated base64url parts); {_RETRY_FIX}",
            kind="malformed",
        )
    return token


_STATUS_FIX = {
    400: "the metadata server refused the request; check that the broker URL is a valid audience",
    403: (
        "the workload may not use its service account; on GKE with Workload Identity, bind the "
        "Kubernetes service account to a Google service account "
        "(roles/iam.workloadIdentityUser)"
    ),
    404: (
        "no service account is attached to this VM or workload; attach one (on GKE, enable "
        "Workload Identity for the node pool and annotate the Kubernetes service account)"
    ),
}


def _metadata_host(environ: Any) -> tuple[str, int, str]:
    """(hostname, port, host[:port] for messages) from ``GCE_METADATA_HOST`` or the default."""
    value = str(environ.get(HOST_VAR, "") or "").strip()
    if not value:
        return DEFAULT_METADATA_HOST, 80, DEFAULT_METADATA_HOST
    try:
        parts = urlsplit(f"//{value}")
        hostname, port = parts.hostname, parts.port
    except ValueError:
        hostname, port = None, None
    if not hostname or parts.netloc != value or "@" in value:
        _fail(
            f"{HOST_VAR}={value!r} is not host[:port] (for example 169.254.169.254 or "
            f"{DEFAULT_METADATA_HOST}:80, without scheme or path); fix or unset it",
            source=HOST_VAR,
        )
    return hostname, port or 80, _display(hostname, port or 80)


def _resolve(hostname: str, port: int, timeout: float) -> tuple[str, int]:
    """Resolve ``hostname`` within ``timeout`` (getaddrinfo itself has no timeout)."""
    try:
        return str(ipaddress.ip_address(hostname)), port
    except ValueError:
        pass
    outcome: list[Any] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            outcome.append(socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            outcome.append(exc)
        finally:
            done.set()

    threading.Thread(target=lookup, name=f"{PROVIDER_NAME}-resolve", daemon=True).start()
    if not done.wait(timeout):
        raise _NotHere(f"{hostname} did not resolve within {timeout:g}s: not on Google Cloud")
    result = outcome[0]
    if isinstance(result, OSError):
        reason = result.strerror or str(result)
        raise _NotHere(f"{hostname} does not resolve ({reason}): not on Google Cloud")
    if not result:
        raise _NotHere(f"{hostname} does not resolve (no address): not on Google Cloud")
    sockaddr = result[0][4]
    return str(sockaddr[0]).split("%", 1)[0], int(sockaddr[1])


def _display(hostname: str, port: int) -> str:
    host = f"[{hostname}]" if ":" in hostname else hostname
    return host if port == 80 else f"{host}:{port}"


def _os_reason(exc: BaseException) -> str:
    """The operating system's words for a failed connection (e.g. "Connection refused")."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    return str(exc) or type(exc).__name__


def _pause_before_retry(deadline: float) -> bool:
    if deadline - time.monotonic() <= _RETRY_PAUSE:
        return False
    time.sleep(_RETRY_PAUSE)
    return True


def _error_detail(body: bytes) -> str:
    text = " ".join(body[:1024].decode("utf-8", "replace").split())
    return text[:200] + ("..." if len(text) > 200 else "")


def _fail(message: str, *, source: str = "metadata server", kind: str = "") -> NoReturn:
    from k8s_agent_sandbox_awx import (
        CredentialSourceError,
        EmptyCredentialError,
        MalformedTokenError,
    )

    cls: type[CredentialSourceError] = CredentialSourceError
    if kind == "empty":
        cls = EmptyCredentialError
    elif kind == "malformed":
        cls = MalformedTokenError
    raise cls(f"{PROVIDER_NAME}: {message}", provider=PROVIDER_NAME, source=source)
