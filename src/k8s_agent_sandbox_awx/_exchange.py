"""The HTTP exchange shared by the sync and the async transport, without doing any I/O.

``_protocol`` says what to send and how to read answers; this module adds what needs httpx
objects but still no I/O: the client settings (TLS, redirects, headers), bearer auth (one class
with a sync and an async flow over the same steps), building each attempt of a request, the
retry and failure decisions for an attempt's outcome, and the bookkeeping of streamed bodies
(upload framing and chunk accounting, capped error bodies, download limits). ``_transport`` and
``_async_transport`` only perform the sends, reads and sleeps.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import ssl
import urllib.request
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from . import _protocol as proto
from ._auth import CredentialSource
from ._config import ENV_TRUST_ENV_PROXIES, BrokerConnectionConfig
from ._credential import Credential
from ._exceptions import BrokerError, BrokerTLSError, BrokerUnavailableError, ConfigurationError
from ._exceptions import RequestTimeoutError as _RequestTimeoutError
from ._upstream import SandboxError
from ._version import __version__

__all__ = [
    "CHUNK_SIZE",
    "BearerAuth",
    "CappedBody",
    "DownloadMeter",
    "Exchange",
    "UploadBody",
    "client_settings",
    "plan_upload",
]

logger = logging.getLogger("k8s_agent_sandbox_awx.transport")

CHUNK_SIZE = 1024 * 1024
_AUTH_RETRIED = "k8s_agent_sandbox_awx.auth_retried"
_REPLAYABLE = "k8s_agent_sandbox_awx.replayable"
MAX_ERROR_BODY = 64 * 1024


def body_replayable(request: httpx.Request) -> bool:
    """Whether the body can be sent again; decided when the request was built (a transport may
    swap the stream later, e.g. a mock that reads it into memory)."""
    if _REPLAYABLE in request.extensions:
        return bool(request.extensions[_REPLAYABLE])
    return isinstance(request.stream, httpx.ByteStream)


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return (url.scheme, url.host, url.port)


# --------------------------------------------------------------------------------------------
# Auth


class BearerAuth(httpx.Auth):
    """Asks the credential source for a token on every request (sent only to the broker's
    origin); when the broker rejects the token (a 401 with a token code, see
    :func:`_protocol.is_token_rejection`) it invalidates the credential, re-reads it and
    retries once, if the body can be sent again. Any other 401 (a sandbox runtime's own,
    passed through by the broker) is an answer: no invalidation, never a replay. The sync
    client calls ``get_credential``, the async one ``aget_credential``; both run the same steps
    (:meth:`_steps`). ``read_body`` reads a 401's body for the decision: ``httpx.Response.read``
    from the sync transport, ``httpx.Response.aread`` (awaited) from the async one."""

    def __init__(
        self,
        source: CredentialSource,
        audience: str,
        *,
        read_body: Callable[[httpx.Response], Any],
    ) -> None:
        self._source = source
        self._audience = audience
        self._origin = _origin(httpx.URL(audience))
        self._read_body = read_body

    def _check_origin(self, request: httpx.Request) -> None:
        if _origin(request.url) != self._origin:
            raise BrokerError(
                f"Refusing to send the token to {request.url.scheme}://{request.url.host}: it is "
                f"not the broker's origin ({self._audience}). Tokens only go to the broker."
            )

    def _steps(
        self, request: httpx.Request
    ) -> Generator[httpx.Request | httpx.Response | None, Any, None]:
        """Yields ``None`` to ask for a credential (send it back), a request to send (send
        back its response) or a response whose body to read (send back the bytes). The origin
        is checked before any credential is asked for."""
        self._check_origin(request)
        credential: Credential = yield None
        request.headers["Authorization"] = f"Bearer {credential.token}"
        response = yield request
        if response.status_code != 401:
            return
        if not proto.is_token_rejection(response.status_code, (yield response)):
            logger.info("401 from behind the broker (not a token rejection); not retrying")
            return
        self._source.invalidate(self._audience)
        if not body_replayable(request):
            logger.info("401 from the broker; the body cannot be re-sent, not retrying")
            return
        logger.info("401 from the broker; re-reading the credential and retrying once")
        credential = yield None
        request.headers["Authorization"] = f"Bearer {credential.token}"
        request.extensions = {**request.extensions, _AUTH_RETRIED: True}
        yield request

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        steps = self._steps(request)
        step = next(steps)
        with contextlib.suppress(StopIteration):
            while True:
                if step is None:
                    step = steps.send(self._source.get_credential(self._audience))
                elif isinstance(step, httpx.Response):
                    step = steps.send(self._read_body(step))
                else:
                    step = steps.send((yield step))

    sync_auth_flow = auth_flow

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        steps = self._steps(request)
        step = next(steps)
        with contextlib.suppress(StopIteration):
            while True:
                if step is None:
                    reply: Any = await self._source.aget_credential(self._audience)
                elif isinstance(step, httpx.Response):
                    reply = await self._read_body(step)
                else:
                    reply = yield step
                step = steps.send(reply)


class NoAuth(httpx.Auth):
    """For ``GET /v1/healthz``: no token is sent."""

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers.pop("Authorization", None)
        yield request


# --------------------------------------------------------------------------------------------
# Client settings


def _ssl_context(config: BrokerConnectionConfig) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context(cafile=config.ca_cert)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigurationError(
            f"Could not load the CA bundle {config.ca_cert!r} ({exc}). Point ca_cert (or "
            "AGENT_SANDBOX_CA_BUNDLE) at a readable PEM file with the broker's CA certificate."
        ) from exc
    if config.client_cert:
        cert, key = config.client_cert
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(
                f"Could not load the client certificate {cert!r} with key {key!r} ({exc}). "
                "client_cert must be (certificate PEM path, private key PEM path)."
            ) from exc
    return context


_PROXY_SCHEMES = frozenset({"http", "https", "socks5", "socks5h"})


def _check_env_proxies() -> None:
    """Refuse, with a typed error naming the variable, a proxy from the environment that httpx
    cannot use: it would fail when the client is built (a raw ``ImportError`` for a SOCKS proxy
    without ``socksio``, a raw ``ValueError`` for another scheme), whatever the broker."""
    found = urllib.request.getproxies()
    if "*" in (host.strip() for host in found.get("no", "").split(",")):
        return  # NO_PROXY=*: httpx uses no proxy at all
    for key in ("https", "all", "http"):  # the variables httpx reads (it mounts all of them)
        value = found.get(key)
        if not value:
            continue
        names = [n for n in (f"{key}_proxy", f"{key.upper()}_PROXY") if os.environ.get(n)]
        name = names[0] if names else f"{key.upper()}_PROXY"
        scheme = value.partition("://")[0].lower() if "://" in value else "http"
        if scheme not in _PROXY_SCHEMES:
            problem = f"its scheme {scheme}:// is not a proxy scheme (http, https, socks5)"
        elif scheme.startswith("socks") and importlib.util.find_spec("socksio") is None:
            problem = "a SOCKS proxy needs the socksio package: pip install 'httpx[socks]'"
        else:
            continue
        shown = proto.redact_url(value, typed=True)
        raise ConfigurationError(
            f"The proxy {name}={shown!r} from the environment cannot be used: {problem}. "
            f"Fix or unset {name}, or set {ENV_TRUST_ENV_PROXIES}=0 to reach the broker "
            "without the environment's proxies."
        )


def client_settings(
    config: BrokerConnectionConfig,
    auth: CredentialSource,
    read_body: Callable[[httpx.Response], Any],
) -> dict[str, Any]:
    """Keyword arguments for ``httpx.Client``/``httpx.AsyncClient``: bearer auth (``read_body``:
    see :class:`BearerAuth`), TLS, never
    following redirects, proxies from the environment only where they may be used
    (:attr:`BrokerConnectionConfig.use_env_proxies`), the request timeout and the User-Agent."""
    verify: ssl.SSLContext | bool = True
    if config.broker_url.startswith("https://"):
        verify = _ssl_context(config)
    if config.use_env_proxies:
        _check_env_proxies()
    return {
        "auth": BearerAuth(auth, config.audience, read_body=read_body),
        "follow_redirects": False,
        "trust_env": config.use_env_proxies,  # httpx reads nothing else from it here
        "verify": verify,
        "timeout": httpx.Timeout(config.request_timeout),
        "limits": httpx.Limits(
            max_connections=config.max_connections,
            max_keepalive_connections=config.max_keepalive_connections,
        ),
        "headers": {"User-Agent": f"k8s-agent-sandbox-awx/{__version__}", **config.extra_headers},
    }


def retry_policy(config: BrokerConnectionConfig) -> proto.RetryPolicy:
    return proto.RetryPolicy(
        max_attempts=config.max_attempts,
        backoff_base=config.backoff_base,
        backoff_max=config.backoff_max,
    )


# --------------------------------------------------------------------------------------------
# One request and its attempts


class Exchange:
    """One logical request: builds each attempt, decides what an outcome means (done, retry
    after a delay, or a typed error). The transports call it around their sends and sleeps."""

    def __init__(
        self,
        client: httpx.Client | httpx.AsyncClient,
        config: BrokerConnectionConfig,
        retry: proto.RetryPolicy,
        spec: proto.RequestSpec,
        *,
        body: Any = None,
        authenticate: bool = True,
    ) -> None:
        self._client = client
        self.config = config
        self.retry = retry
        self.spec = spec
        self.body = body
        self.auth: Any = httpx.USE_CLIENT_DEFAULT if authenticate else NoAuth()
        self.attempt = 0
        self.request: httpx.Request | None = None
        self.reached = False
        """Whether an attempt may have reached the broker (it was sent, or answered)."""

    def next_request(self) -> httpx.Request:
        """The request for the next attempt."""
        self.attempt += 1
        spec = self.spec
        request = self._client.build_request(
            spec.method,
            self.config.broker_url + spec.path,
            params=spec.params or None,
            headers=spec.headers,
            content=spec.content,
            timeout=httpx.Timeout(
                self.config.request_timeout,
                read=spec.read_timeout or self.config.request_timeout,
            ),
        )
        if self.body is not None:
            replayable = bool(getattr(self.body, "replayable", False))
            if self.attempt > 1 and not replayable:
                raise BrokerError(
                    f"Could not {spec.what}: the upload stream was consumed and cannot be sent "
                    "again; pass bytes or a seekable file to allow a retry."
                )
            request = httpx.Request(
                request.method,
                request.url,
                headers=request.headers,
                stream=self.body,
                extensions={**request.extensions, _REPLAYABLE: replayable},
            )
        self.request = request
        return request

    def delay_after_error(self, exc: httpx.TransportError) -> float:
        """Seconds to wait before the next attempt after ``exc``; raises the typed error if the
        request must not (or can no longer) be retried."""
        spec = self.spec
        not_sent = isinstance(
            exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout | httpx.ProxyError
        )  # a ProxyError: the proxy refused the CONNECT tunnel, nothing went through it
        self.reached = self.reached or not not_sent
        if _certificate_failed(exc):
            raise self.tls_error(exc) from exc
        if isinstance(exc, httpx.TimeoutException) and not not_sent:
            raise self.timeout_error(exc) from exc
        delay = self.retry.after_transport_error(spec, self.attempt, request_sent=not not_sent)
        if delay is None:
            if isinstance(exc, httpx.TimeoutException):
                raise self.timeout_error(exc) from exc
            raise self.transport_error(exc, sent=not not_sent) from exc
        self._log_retry(delay, type(exc).__name__)
        return delay

    def succeeded(self, response: httpx.Response) -> bool:
        status = response.status_code
        return status < 300 or (status == 404 and self.spec.not_found_ok)

    def delay_after_response(self, response: httpx.Response) -> float | None:
        """Seconds to wait before retrying after an error ``response``; ``None``: no retry
        (a success, or an error to raise with :meth:`failure`)."""
        self.reached = True
        status = response.status_code
        if self.succeeded(response) or status < 400:
            return None
        delay = self.retry.after_status(self.spec, self.attempt, status, response.headers)
        if delay is None:
            return None
        request = self.request
        if self.body is not None and request is not None and not body_replayable(request):
            return None
        self._log_retry(delay, str(status))
        return delay

    def failure(self, response: httpx.Response, body: bytes) -> BrokerError:
        """The typed error for an unsuccessful ``response`` whose (capped) body is ``body``."""
        retried = bool(self.request is not None and self.request.extensions.get(_AUTH_RETRIED))
        status = response.status_code
        return proto.error_from_response(
            status,
            response.headers,
            body if status >= 400 else b"",
            spec=self.spec,
            retried_auth=retried,
            secrets=self._sent_token(),
        )

    def _sent_token(self) -> tuple[str, ...]:
        """The token the last attempt carried: redacted from messages about its outcome."""
        header = self.request.headers.get("Authorization", "") if self.request else ""
        token = header.partition(" ")[2].strip()
        return (token,) if token else ()

    def _reason(self, exc: httpx.TransportError) -> str:
        """A transport error's text (it may quote what the server sent), redacted."""
        return proto.redact_answer(str(exc) or type(exc).__name__, self._sent_token())

    def read_error(self, exc: httpx.TransportError) -> BrokerError:
        """The typed error for a failure while reading a successful response's body."""
        self.reached = True
        if isinstance(exc, httpx.TimeoutException):
            return self.timeout_error(exc)
        return self.transport_error(exc, sent=True)

    def _log_retry(self, delay: float, why: str) -> None:
        logger.info(
            "%s %s: %s; retrying in %.2fs (attempt %d of %d)",
            self.spec.method,
            self.spec.path,
            why,
            delay,
            self.attempt + 1,
            self.retry.max_attempts,
        )

    def timeout_error(self, exc: httpx.TimeoutException) -> _RequestTimeoutError:
        spec = self.spec
        limit = spec.read_timeout or self.config.request_timeout
        if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
            limit = self.config.request_timeout
        return _RequestTimeoutError(
            f"Could not {spec.what}: no answer from the broker {self.config.broker_url} within "
            f"{limit:g}s ({type(exc).__name__}). Check the network path to the broker, or raise "
            "request_timeout in BrokerConnectionConfig.",
            timeout=limit,
            method=spec.method,
            path=spec.path,
            request_sent=self.reached,
        )

    def tls_error(self, exc: httpx.TransportError) -> BrokerTLSError:
        """A certificate that does not verify: typed, never retried, nothing was sent."""
        spec = self.spec
        ca = self.config.ca_cert or "the system trust store"
        return BrokerTLSError(
            f"Could not {spec.what}: the TLS certificate of the broker {self.config.broker_url} "
            f"did not verify against {ca} ({self._reason(exc)}). Not retried: retrying cannot "
            "help. Set "
            "AGENT_SANDBOX_CA_BUNDLE (or ca_cert=) to the PEM file of the CA that signed the "
            "broker's certificate; if that is the right CA, check this machine's clock (a "
            "certificate is only valid between its dates) and that the broker URL names a host "
            "of the certificate.",
            method=spec.method,
            path=spec.path,
            request_sent=False,
        )

    def transport_error(self, exc: httpx.TransportError, *, sent: bool) -> BrokerUnavailableError:
        spec = self.spec
        broker = self.config.broker_url
        if isinstance(exc, httpx.ConnectError):
            reason = self._reason(exc)
            hint = "Check the broker URL, that the broker is running, and the CA bundle."
            msg = f"Could not {spec.what}: cannot connect to the broker {broker}: {reason}."
            return BrokerUnavailableError(
                f"{msg} {hint}", method=spec.method, path=spec.path, request_sent=self.reached
            )
        if isinstance(exc, httpx.ProxyError):
            return BrokerUnavailableError(
                f"Could not {spec.what}: the proxy refused to connect to the broker {broker} "
                f"({self._reason(exc)}); nothing reached the broker. The proxy comes from "
                "HTTPS_PROXY (or https_proxy, ALL_PROXY): check its address and credentials, or "
                f"list the broker's host in NO_PROXY, or set {ENV_TRUST_ENV_PROXIES}=0 to connect "
                "directly.",
                method=spec.method,
                path=spec.path,
                request_sent=self.reached,
            )
        note = ""
        if sent and not spec.retryable:
            note = (
                " The request may have reached the sandbox; it is not retried because it is not "
                "idempotent (a command could run twice)."
            )
        return BrokerUnavailableError(
            f"Could not {spec.what}: the connection to the broker failed "
            f"({type(exc).__name__}: {self._reason(exc)}).{note} Retry if that is safe.",
            method=spec.method,
            path=spec.path,
            request_sent=self.reached,
        )


def _certificate_failed(exc: BaseException) -> bool:
    """Whether a transport error was caused by a certificate that did not verify."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLCertVerificationError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


class CappedBody:
    """Collects at most ``MAX_ERROR_BODY`` bytes of an error response."""

    def __init__(self) -> None:
        self._data = bytearray()

    def add(self, chunk: bytes) -> bool:
        """Add ``chunk``; ``True`` once enough was collected."""
        self._data += chunk
        return len(self._data) >= MAX_ERROR_BODY

    @property
    def data(self) -> bytes:
        return bytes(self._data[:MAX_ERROR_BODY])


# --------------------------------------------------------------------------------------------
# Streamed bodies


class DownloadMeter:
    """Counts a streamed download, enforces ``max_bytes`` and names a broken stream's error."""

    def __init__(self, spec: proto.RequestSpec, src: str, max_bytes: int | None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}.")
        self.spec = spec
        self.src = src
        self.max_bytes = max_bytes
        self.total = 0

    def count(self, chunk: bytes) -> bytes:
        if self.max_bytes is not None and self.total + len(chunk) > self.max_bytes:
            raise SandboxError(
                f"The file {self.src!r} is larger than max_bytes={self.max_bytes}; raise the limit."
            )
        self.total += len(chunk)
        return chunk

    def error(self, exc: httpx.TransportError) -> BrokerError:
        spec = self.spec
        if isinstance(exc, httpx.TimeoutException):
            return _RequestTimeoutError(
                f"Could not read {self.src!r}: the download stalled after {self.total} bytes. "
                "Retry, or pass a larger timeout=.",
                method=spec.method,
                path=spec.path,
            )
        return BrokerUnavailableError(
            f"Could not read {self.src!r}: the connection broke after {self.total} bytes "
            f"({type(exc).__name__}). Retry the download.",
            method=spec.method,
            path=spec.path,
        )


def _check_binary_reader(content: Any) -> None:
    if isinstance(content, io.TextIOBase):
        raise TypeError("File content must be opened in binary mode ('rb'), not text mode.")
    if not callable(getattr(content, "read", None)):
        raise TypeError(
            "File content must be bytes, str, a binary file object or (async client only) an "
            f"async iterable of bytes, got {type(content).__name__}."
        )


def _start_and_size(content: Any) -> tuple[int | None, int | None]:
    """(start position, remaining size) of a seekable file; (None, None) otherwise."""
    try:
        if not content.seekable():
            return None, None
        start = content.tell()
        end = content.seek(0, io.SEEK_END)
        content.seek(start)
        return int(start), int(end - start)
    except (AttributeError, OSError, ValueError):
        return None, None


@dataclass
class UploadBody:
    """The streamed multipart body of one upload: framing + the content in chunks, never all
    at once. ``content`` is bytes, a binary reader (``read(n)``), or ``None`` for a stream the
    async I/O layer iterates itself (chunks passed through :meth:`accept`)."""

    framing: proto.Multipart
    content: Any
    start: int | None
    size: int | None
    """Declared in Content-Length: exactly this many content bytes are sent (``None``: chunked)."""
    replayable: bool = False
    _consumed: bool = False
    _remaining: int | None = None
    _done: bool = False

    def begin(self) -> None:
        """Start (again): refuse a consumed one-shot stream, rewind a seekable file."""
        if self._consumed and not self.replayable:
            raise httpx.StreamConsumed()
        self._consumed = True
        self._remaining = self.size
        self._done = not callable(getattr(self.content, "read", None))  # bytes: byte_chunks()
        if self.start is not None:
            self.content.seek(self.start)

    def byte_chunks(self) -> Iterator[bytes]:
        view = memoryview(self.content)
        for offset in range(0, len(view), CHUNK_SIZE):
            yield bytes(view[offset : offset + CHUNK_SIZE])

    def want(self) -> int:
        """How many bytes to read next from a reader; 0 when done."""
        if self._done:
            return 0
        return CHUNK_SIZE if self._remaining is None else min(CHUNK_SIZE, self._remaining)

    def accept(self, chunk: Any) -> bytes:
        """Check a chunk read from the content; an empty chunk ends it."""
        if not isinstance(chunk, bytes | bytearray | memoryview):
            raise TypeError("The file object's read() must return bytes (open it 'rb').")
        if not chunk:
            self._done = True
            if self._remaining:
                raise ValueError(
                    f"The file shrank by {self._remaining} bytes while it was uploaded; upload "
                    "a file that does not change during the upload."
                )
            return b""
        if self._remaining is not None:
            self._remaining -= len(chunk)
            self._done = self._remaining <= 0
        return bytes(chunk)


def plan_upload(
    router: proto.RouterTarget,
    dest: str,
    content: Any,
    timeout: float | None,
    *,
    streamed: bool = False,
) -> tuple[proto.RequestSpec, UploadBody]:
    """The request and body of ``files.write``: ``content`` is bytes-like, str, a binary
    reader, or (``streamed=True``) a stream the I/O layer iterates itself."""
    body: Any
    if streamed:
        body = None
    elif isinstance(content, str):
        body = content.encode("utf-8")
    elif isinstance(content, bytearray | memoryview):
        body = bytes(content)
    elif isinstance(content, bytes):
        body = content
    else:
        _check_binary_reader(content)
        body = content
    framing = proto.multipart_framing(dest)
    spec = proto.upload(router, dest, framing)
    if timeout is not None:
        spec.read_timeout = float(timeout)
    if isinstance(body, bytes):
        start: int | None = None
        size: int | None = len(body)
    elif body is None:
        start, size = None, None
    else:
        start, size = _start_and_size(body)
    if size is not None:
        spec.headers["Content-Length"] = str(framing.length(size))
    else:
        spec.headers["Transfer-Encoding"] = "chunked"
    upload = UploadBody(framing, body, start, size)
    upload.replayable = isinstance(body, bytes) or start is not None
    spec.retryable = upload.replayable
    return spec, upload
