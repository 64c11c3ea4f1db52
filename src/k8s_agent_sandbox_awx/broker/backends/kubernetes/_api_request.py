"""One request of the broker's Kubernetes API client (:mod:`._api`) and the transport helpers
its request path uses: :class:`Call` (a verb, a resource, the HTTP parts), the bearer token
added per request (:class:`BearerAuth`: never in a message or a repr), the scrubbing of a
token from what the server echoes, and the readings of a failure (not sent, a certificate that
does not verify, ``Retry-After``, a refused credential). Imports nothing else of the package
but ``_api_config`` and ``_api_types``."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncGenerator, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from ._api_config import ExecCredential, KubeConfig, TokenFile, TokenSource
from ._api_types import Resource

__all__ = [
    "BearerAuth",
    "Call",
    "certificate_failure",
    "json_body",
    "not_sent",
    "retry_after",
    "scrub",
    "selectors",
    "unauthorized_hint",
]


# ------------------------------------------------------------------------------ requests


@dataclass(frozen=True)
class Call:
    """One API request: the Kubernetes verb (for messages and retries) and the HTTP parts."""

    verb: str
    method: str
    resource: Resource
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    params: Mapping[str, str] = field(default_factory=dict)
    body: bytes | None = None
    content_type: str | None = None
    idempotent: bool = False
    json_patch: bool = False
    secrets: tuple[str, ...] = ()  # to scrub from what the server says (a reviewed token)

    @property
    def path(self) -> str:
        return self.resource.path(self.namespace, self.name, self.subresource)

    def describe(self) -> str:
        what = f"{self.resource}/{self.subresource}" if self.subresource else str(self.resource)
        where = "/".join(p for p in (self.namespace, self.name) if p)
        return f"{self.verb} {what}" + (f" {where}" if where else "")


def json_body(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


class BearerAuth(httpx.Auth):
    """Adds ``Authorization: Bearer`` to each request, reading the token source each time. An
    exec plugin's token (``ExecCredential``) is awaited (the plugin may run), and a ``401`` to
    it runs the plugin again and sends the request once more with the new token."""

    def __init__(self, token: TokenSource) -> None:
        self._token = token
        self.last = ""

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        self.last = self._token.read()
        request.headers["Authorization"] = f"Bearer {self.last}"
        yield request

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        source = self._token
        if not isinstance(source, ExecCredential):
            self.last = source.read()
            request.headers["Authorization"] = f"Bearer {self.last}"
            yield request
            return
        self.last = used = await source.token()
        request.headers["Authorization"] = f"Bearer {used}"
        response = yield request
        if response.status_code == 401:
            self.last = fresh = await source.token(refused=used)
            if fresh != used:
                request.headers["Authorization"] = f"Bearer {fresh}"
                yield request

    def __repr__(self) -> str:
        return f"BearerAuth({self._token!r})"


def scrub(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret and len(secret) >= 8:
            text = text.replace(secret, "[redacted]")
    return text


def retry_after(headers: httpx.Headers) -> float | None:
    value = headers.get("retry-after", "").strip()
    try:
        return float(value) if value else None
    except ValueError:
        return None


def not_sent(exc: httpx.TransportError) -> bool:
    """The request cannot have reached the server: no connection was made."""
    return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)


def certificate_failure(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(
            seen
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def selectors(label_selector: str | None, field_selector: str | None) -> dict[str, str]:
    params: dict[str, str] = {}
    if label_selector:
        params["labelSelector"] = label_selector
    if field_selector:
        params["fieldSelector"] = field_selector
    return params


def unauthorized_hint(config: KubeConfig) -> str:
    """What to do about a 401: the credential of ``config`` was refused."""
    token = config.token
    if isinstance(token, ExecCredential):
        fix = (
            f"the token of the exec plugin {token.plugin.command!r} was refused, also "
            "after running it again: does the identity it logs in as have access to "
            "this cluster (its RBAC, or the cloud's access entries)?"
        )
    elif isinstance(token, TokenFile):
        fix = (
            f"is the token in {token.path} expired or revoked? It is read again for "
            "every request: replacing the file is enough"
        )
    elif token is not None:
        fix = f"is the token expired or revoked? Renew it in {token.source}"
    elif config.client_certificate:
        fix = "does the API server trust the client certificate's CA?"
    else:
        fix = "no credential is configured: give a token, a token file or a certificate"
    return f": the API server did not accept the credential of {config.source}: {fix}"
