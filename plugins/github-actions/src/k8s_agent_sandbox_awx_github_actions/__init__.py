"""GitHub Actions OIDC credential provider for ``k8s_agent_sandbox_awx``.

Registered under the entry-point group ``k8s_agent_sandbox_awx.providers`` as ``github-actions``.
Inside a GitHub Actions job whose workflow grants ``permissions: id-token: write``, it asks the
Actions token service for an OIDC token whose audience is the broker URL.

Importing this module is cheap: httpx and the error classes are imported on first fetch.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from k8s_agent_sandbox_awx import Credential, CredentialRequest, ProviderInfo, hookimpl

if TYPE_CHECKING:
    import httpx

__all__ = [
    "PROVIDER_NAME",
    "agent_sandbox_get_credential",
    "agent_sandbox_provider_info",
    "build_token_url",
]
__version__ = "0.1.0"

PROVIDER_NAME = "github-actions"
"""The entry-point name; also ``Credential.provider`` for tokens from this plugin."""

ACTIONS_VAR = "GITHUB_ACTIONS"
REQUEST_URL_VAR = "ACTIONS_ID_TOKEN_REQUEST_URL"
REQUEST_TOKEN_VAR = "ACTIONS_ID_TOKEN_REQUEST_TOKEN"  # noqa: S105 - a variable name

_PERMISSIONS_FIX = (
    "add `permissions: id-token: write` to the workflow or to this job (pull_request runs from "
    "forks never get one); to use another identity in this job instead, set "
    "AGENT_SANDBOX_TOKEN or AGENT_SANDBOX_TOKEN_FILE (consulted before plugins)"
)
_RETRY_STATUSES = frozenset({500, 502, 503, 504})
_RETRY_PAUSE = 0.2  # seconds before the single retry of a transient failure
_MAX_REPLY_BYTES = 64 * 1024
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})

_log = logging.getLogger(__name__)


@hookimpl
def agent_sandbox_provider_info() -> ProviderInfo:
    return ProviderInfo(
        # An environment-variable check costs nothing, and a job that asks for an OIDC token
        # means it: consult this provider before the network-probing ones.
        priority=100,
        hint="in a GitHub Actions job, grant `permissions: id-token: write`",
        description="GitHub Actions OIDC token requested with the broker URL as audience",
    )


@hookimpl
def agent_sandbox_get_credential(request: CredentialRequest) -> Credential | None:
    environ = request.environ
    if not environ.get(ACTIONS_VAR):
        request.not_here(f"{ACTIONS_VAR} is not set")
        return None
    request_url = environ.get(REQUEST_URL_VAR, "").strip()
    request_token = environ.get(REQUEST_TOKEN_VAR, "").strip()
    missing = [
        name
        for name, value in ((REQUEST_URL_VAR, request_url), (REQUEST_TOKEN_VAR, request_token))
        if not value
    ]
    if missing:
        _fail(
            f"running in GitHub Actions ({ACTIONS_VAR} is set) but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: the job may not request an OIDC "
            f"token; {_PERMISSIONS_FIX}",
            source=missing[0],
        )
    token = fetch_token(request_url, request_token, request.audience, request.timeout)
    return Credential(
        token,
        provider=PROVIDER_NAME,
        file_backed=False,
        source=f"{REQUEST_URL_VAR} ({_endpoint_name(request_url)})",
    )


def build_token_url(request_url: str, audience: str) -> str:
    """Return ``request_url`` with ``audience`` set in its query, keeping every other parameter.

    The URL GitHub hands out already has a query (``api-version=...``); the parameter is merged
    with a URL parser, replacing an ``audience`` already present. The fragment is dropped.
    """
    parts = urlsplit(request_url)
    query = [
        (key, value)
        for key, value in parse_qsl(parts.query, keep_blank_values=True)
        if key != "audience"
    ]
    query.append(("audience", audience))
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))


def fetch_token(request_url: str, request_token: str, audience: str, timeout: float) -> str:
    """Ask the Actions token service for a token for ``audience``; return the JWT.

    Every failure raises ``CredentialSourceError`` naming the endpoint's host (never a token).
    A transient failure (a 5xx reply, a dropped or refused connection) is retried once within
    ``timeout``; a redirect is never followed, so the request token cannot reach another host.
    """
    import httpx

    host = _check_request_url(request_url)
    url = build_token_url(request_url, audience)
    headers = {
        "Authorization": f"bearer {request_token}",
        "Accept": "application/json",
        "User-Agent": f"k8s-agent-sandbox-awx-github-actions/{__version__}",
    }
    deadline = time.monotonic() + timeout
    attempt = 0
    while True:
        attempt += 1
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _fail(_timeout_message(host, timeout), source=REQUEST_URL_VAR)
        _log.debug("requesting a GitHub Actions OIDC token from %s (attempt %d)", host, attempt)
        try:
            with httpx.Client(
                timeout=httpx.Timeout(remaining),
                follow_redirects=False,
                # Proxy variables apply (self-hosted runners behind a proxy), except to loopback.
                trust_env=urlsplit(request_url).hostname not in _LOOPBACK_HOSTS,
            ) as client:
                response = client.get(url, headers=headers)
                body = response.read()
        except httpx.TimeoutException:
            _fail(_timeout_message(host, timeout), source=REQUEST_URL_VAR)
        except httpx.TransportError as exc:
            if attempt == 1 and _pause_before_retry(deadline):
                continue
            _fail(
                f"could not reach the GitHub Actions token service at {host} "
                f"({type(exc).__name__}: {_redact(str(exc), request_token)}); "
                "check the runner's network access to GitHub",
                source=REQUEST_URL_VAR,
            )
        if (
            response.status_code in _RETRY_STATUSES
            and attempt == 1
            and _pause_before_retry(deadline)
        ):
            continue
        return _token_from_reply(response, body, host, request_token)


def _token_from_reply(response: httpx.Response, body: bytes, host: str, request_token: str) -> str:
    status = response.status_code
    if 300 <= status < 400:
        _fail(
            f"the GitHub Actions token service at {host} answered HTTP {status} (a redirect); "
            "it is not followed so that the request token never reaches another host; "
            f"check {REQUEST_URL_VAR}",
            source=REQUEST_URL_VAR,
        )
    if status != 200:
        detail = _error_detail(body, request_token)
        fix = (
            f"the request token is valid only inside the job that received it; {_PERMISSIONS_FIX}"
            if status in (401, 403)
            else "retry the job; if it persists, check GitHub's status page"
        )
        _fail(
            f"the GitHub Actions token service at {host} answered HTTP {status}"
            f"{f' ({detail})' if detail else ''}; {fix}",
            source=REQUEST_URL_VAR,
        )
    if len(body) > _MAX_REPLY_BYTES:
        _fail(
            f"the reply of the GitHub Actions token service at {host} is larger than "
            f"{_MAX_REPLY_BYTES} bytes; expected a small JSON object with a `value` field",
            source=REQUEST_URL_VAR,
        )
    import json

    try:
        data = json.loads(body)
    except ValueError:
        _fail(
            f"the reply of the GitHub Actions token service at {host} is not JSON; "
            f"expected an object with a `value` field; check {REQUEST_URL_VAR}",
            source=REQUEST_URL_VAR,
        )
    if not isinstance(data, dict) or "value" not in data:
        _fail(
            f"the reply of the GitHub Actions token service at {host} has no `value` field; "
            f"expected a JSON object with the token in `value`; check {REQUEST_URL_VAR}",
            source=REQUEST_URL_VAR,
        )
    value = data["value"]
    if not isinstance(value, str) or not value.strip():
        _fail(
            f"the GitHub Actions token service at {host} returned an empty or non-string "
            "`value`; retry the job",
            source=REQUEST_URL_VAR,
            kind="empty",
        )
    token = value.strip()
    if token.count(".") != 2 or any(c.isspace() for c in token):
        _fail(
            f"the `value` returned by the GitHub Actions token service at {host} is not a JWT "
            "(expected three dot-separated parts); retry the job",
            source=REQUEST_URL_VAR,
            kind="malformed",
        )
    return token


def _timeout_message(host: str, timeout: float) -> str:
    return (
        f"the GitHub Actions token service at {host} did not answer within {timeout:g}s; retry "
        "the job, or raise the credential timeout (DefaultCredentials(timeout=...))"
    )


def _check_request_url(request_url: str) -> str:
    """Validate ``ACTIONS_ID_TOKEN_REQUEST_URL``; return its host[:port] for messages."""
    try:
        parts = urlsplit(request_url)
        hostname = parts.hostname
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        parts, hostname = urlsplit(""), None
    if parts.scheme not in ("https", "http") or not hostname:
        _fail(
            f"{REQUEST_URL_VAR} is not an http(s) URL with a host; it is set by the GitHub "
            "runner: do not override it",
            source=REQUEST_URL_VAR,
        )
    host = _endpoint_name(request_url)
    if parts.scheme == "http" and hostname not in _LOOPBACK_HOSTS:
        _fail(
            f"{REQUEST_URL_VAR} points at {host} over plain http; the request token is only "
            "sent over https (or to a loopback address); it is set by the GitHub runner: do "
            "not override it",
            source=REQUEST_URL_VAR,
        )
    if parts.username is not None or parts.password is not None:
        _fail(
            f"{REQUEST_URL_VAR} carries user information; it is set by the GitHub runner: do "
            "not override it",
            source=REQUEST_URL_VAR,
        )
    return host


def _endpoint_name(url: str) -> str:
    """host[:port] of ``url`` without user information, for messages."""
    try:
        parts = urlsplit(url)
        hostname = parts.hostname or "?"
        port = parts.port
    except ValueError:
        return "?"
    if ":" in hostname:
        hostname = f"[{hostname}]"
    return f"{hostname}:{port}" if port else hostname


def _pause_before_retry(deadline: float) -> bool:
    if deadline - time.monotonic() <= _RETRY_PAUSE:
        return False
    time.sleep(_RETRY_PAUSE)
    return True


def _error_detail(body: bytes, request_token: str) -> str:
    """A short, redacted excerpt of an error reply (its JSON `message` when there is one)."""
    import json

    text = body[:2048].decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        for key in ("message", "error_description", "error"):
            if isinstance(data.get(key), str):
                text = data[key]
                break
    text = " ".join(_redact(text, request_token).split())
    return text[:200] + ("..." if len(text) > 200 else "")


def _redact(text: str, secret: str) -> str:
    return text.replace(secret, "<redacted>") if secret else text


def _fail(message: str, *, source: str, kind: str = "") -> NoReturn:
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
