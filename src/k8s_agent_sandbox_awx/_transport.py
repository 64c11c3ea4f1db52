"""The sync I/O layer: one ``httpx.Client`` per client object, bearer auth, retries, timeouts.

Everything protocol-specific (what to send, how to read answers, what to retry) comes from
``_protocol``; this module only performs the requests.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable, Generator
from typing import Any

import httpx

from . import _protocol as proto
from ._auth import CredentialSource
from ._config import BrokerConnectionConfig
from ._exceptions import BrokerError, BrokerUnavailableError, ConfigurationError
from ._exceptions import RequestTimeoutError as _RequestTimeoutError
from ._version import __version__

__all__ = ["BearerAuth", "BrokerTransport", "ReplayableStream"]

logger = logging.getLogger("k8s_agent_sandbox_awx.transport")

_AUTH_RETRIED = "k8s_agent_sandbox_awx.auth_retried"
_REPLAYABLE = "k8s_agent_sandbox_awx.replayable"
_MAX_ERROR_BODY = 64 * 1024


class ReplayableStream(httpx.SyncByteStream):
    """Marker base for request bodies that can be sent again (``replayable`` says if so)."""

    replayable: bool = False


def _body_replayable(request: httpx.Request) -> bool:
    """Whether the body can be sent again; decided when the request was built (a transport may
    swap the stream later, e.g. a mock that reads it into memory)."""
    if _REPLAYABLE in request.extensions:
        return bool(request.extensions[_REPLAYABLE])
    return isinstance(request.stream, httpx.ByteStream)


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return (url.scheme, url.host, url.port)


class BearerAuth(httpx.Auth):
    """Asks the credential source for a token on every request (sent only to the broker's
    origin); on a 401 it invalidates the credential, re-reads it and retries once, if the body
    can be sent again."""

    def __init__(self, source: CredentialSource, audience: str) -> None:
        self._source = source
        self._audience = audience
        self._origin = _origin(httpx.URL(audience))

    def _authorize(self, request: httpx.Request) -> None:
        if _origin(request.url) != self._origin:
            raise BrokerError(
                f"Refusing to send the token to {request.url.scheme}://{request.url.host}: it is "
                f"not the broker's origin ({self._audience}). Tokens only go to the broker."
            )
        credential = self._source.get_credential(self._audience)
        request.headers["Authorization"] = f"Bearer {credential.token}"

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        self._authorize(request)
        response = yield request
        if response.status_code != 401:
            return
        self._source.invalidate(self._audience)
        if not _body_replayable(request):
            logger.info("401 from the broker; the body cannot be re-sent, not retrying")
            return
        logger.info("401 from the broker; re-reading the credential and retrying once")
        self._authorize(request)
        request.extensions = {**request.extensions, _AUTH_RETRIED: True}
        yield request


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


class BrokerTransport:
    """Sends ``RequestSpec``s to the broker with auth, retries and named timeouts."""

    def __init__(
        self,
        config: BrokerConnectionConfig,
        auth: CredentialSource,
        *,
        http_transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        retry: proto.RetryPolicy | None = None,
    ) -> None:
        self.config = config
        self.auth = auth
        self._sleep = sleep
        self.retry = retry or proto.RetryPolicy(
            max_attempts=config.max_attempts,
            backoff_base=config.backoff_base,
            backoff_max=config.backoff_max,
        )
        verify: ssl.SSLContext | bool = True
        if config.broker_url.startswith("https://"):
            verify = _ssl_context(config)
        self._client = httpx.Client(
            auth=BearerAuth(auth, config.audience),
            follow_redirects=False,
            verify=verify,
            timeout=httpx.Timeout(config.request_timeout),
            headers={"User-Agent": f"k8s-agent-sandbox-awx/{__version__}", **config.extra_headers},
            transport=http_transport,
        )

    @property
    def broker_url(self) -> str:
        return self.config.broker_url

    def close(self) -> None:
        self._client.close()

    def _timeout(self, spec: proto.RequestSpec) -> httpx.Timeout:
        t = self.config.request_timeout
        return httpx.Timeout(t, read=spec.read_timeout or t)

    def send(
        self,
        spec: proto.RequestSpec,
        *,
        stream: bool = False,
        body: Callable[[], httpx.SyncByteStream] | None = None,
        authenticate: bool = True,
    ) -> httpx.Response:
        """Send ``spec``; return a 2xx response (or a 404 when ``spec.not_found_ok``).

        With ``stream=True`` the caller must close the response. ``body`` builds the request
        stream (called once per attempt). Errors are raised as typed ``BrokerError``s.
        """
        url = self.config.broker_url + spec.path
        auth: httpx.Auth | Any = httpx.USE_CLIENT_DEFAULT if authenticate else _NoAuth()
        attempt = 0
        while True:
            attempt += 1
            request = self._client.build_request(
                spec.method,
                url,
                params=spec.params or None,
                headers=spec.headers,
                content=spec.content,
                timeout=self._timeout(spec),
            )
            if body is not None:
                request_body = body()
                request = httpx.Request(
                    request.method,
                    request.url,
                    headers=request.headers,
                    stream=request_body,
                    extensions={
                        **request.extensions,
                        _REPLAYABLE: bool(getattr(request_body, "replayable", False)),
                    },
                )
            try:
                response = self._client.send(request, stream=True, auth=auth)
            except httpx.TimeoutException as exc:
                if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
                    delay = self.retry.after_transport_error(spec, attempt, request_sent=False)
                    if delay is not None:
                        self._log_retry(spec, attempt, delay, type(exc).__name__)
                        self._sleep(delay)
                        continue
                raise self._timeout_error(spec, exc) from exc
            except httpx.TransportError as exc:
                sent = not isinstance(exc, httpx.ConnectError)
                delay = self.retry.after_transport_error(spec, attempt, request_sent=sent)
                if delay is not None:
                    self._log_retry(spec, attempt, delay, type(exc).__name__)
                    self._sleep(delay)
                    continue
                raise self._transport_error(spec, exc, sent) from exc
            status = response.status_code
            logger.debug("%s %s -> %s", spec.method, spec.path, status)
            if status < 300 or (status == 404 and spec.not_found_ok):
                if not stream:
                    self._read(response, spec)
                return response
            if status < 400:
                response.close()
                raise proto.error_from_response(status, response.headers, b"", spec=spec)
            delay = self.retry.after_status(spec, attempt, status, response.headers)
            if delay is not None and (body is None or _body_replayable(request)):
                response.close()
                self._log_retry(spec, attempt, delay, str(status))
                self._sleep(delay)
                continue
            error_body = self._read_error_body(response)
            raise proto.error_from_response(
                status,
                response.headers,
                error_body,
                spec=spec,
                retried_auth=bool(request.extensions.get(_AUTH_RETRIED)),
            )

    def _read(self, response: httpx.Response, spec: proto.RequestSpec) -> None:
        try:
            response.read()
        except httpx.TimeoutException as exc:
            raise self._timeout_error(spec, exc) from exc
        except httpx.TransportError as exc:
            raise self._transport_error(spec, exc, True) from exc
        finally:
            response.close()

    @staticmethod
    def _read_error_body(response: httpx.Response) -> bytes:
        data = bytearray()
        try:
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) >= _MAX_ERROR_BODY:
                    break
        except httpx.HTTPError:
            pass  # the status alone is reported
        finally:
            response.close()
        return bytes(data[:_MAX_ERROR_BODY])

    def _log_retry(self, spec: proto.RequestSpec, attempt: int, delay: float, why: str) -> None:
        logger.info(
            "%s %s: %s; retrying in %.2fs (attempt %d of %d)",
            spec.method,
            spec.path,
            why,
            delay,
            attempt + 1,
            self.retry.max_attempts,
        )

    def _timeout_error(
        self, spec: proto.RequestSpec, exc: httpx.TimeoutException
    ) -> _RequestTimeoutError:
        limit = spec.read_timeout or self.config.request_timeout
        if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
            limit = self.config.request_timeout
        return _RequestTimeoutError(
            f"Could not {spec.what}: no answer from the broker {self.broker_url} within "
            f"{limit:g}s ({type(exc).__name__}). Check the network path to the broker, or raise "
            "request_timeout in BrokerConnectionConfig.",
            timeout=limit,
            method=spec.method,
            path=spec.path,
        )

    def _transport_error(
        self, spec: proto.RequestSpec, exc: httpx.TransportError, sent: bool
    ) -> BrokerUnavailableError:
        if isinstance(exc, httpx.ConnectError):
            reason = str(exc) or type(exc).__name__
            hint = "Check the broker URL, that the broker is running, and the CA bundle."
            if "CERTIFICATE_VERIFY_FAILED" in reason:
                hint = (
                    "TLS verification failed: set AGENT_SANDBOX_CA_BUNDLE (or ca_cert=) to the "
                    "CA that signed the broker's certificate."
                )
            msg = (
                f"Could not {spec.what}: cannot connect to the broker {self.broker_url}: {reason}."
            )
            return BrokerUnavailableError(f"{msg} {hint}", method=spec.method, path=spec.path)
        note = ""
        if sent and not spec.retryable:
            note = (
                " The request may have reached the sandbox; it is not retried because it is not "
                "idempotent (a command could run twice)."
            )
        return BrokerUnavailableError(
            f"Could not {spec.what}: the connection to the broker failed "
            f"({type(exc).__name__}: {exc}).{note} Retry if that is safe.",
            method=spec.method,
            path=spec.path,
        )


class _NoAuth(httpx.Auth):
    """For ``GET /v1/healthz``: no token is sent."""

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers.pop("Authorization", None)
        yield request
