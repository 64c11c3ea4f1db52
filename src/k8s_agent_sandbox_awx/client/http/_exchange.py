"""One request's attempts, shared by the sync and the async transport, without any I/O.

:class:`Exchange` is the one request path: it builds each attempt of a :class:`RequestSpec`,
adds the bearer token (asked from the credential source before every attempt; sent only to the
broker's origin; after the broker's 401 the credential is re-read and the request sent once
more if its body can be), lets the one :class:`RetryPolicy` decide retries, applies the named
timeouts and maps failures to typed errors through the dialect. It is a generator of I/O
steps (:class:`Send`, :class:`GetCredential`, :class:`Sleep`, :class:`Read`,
:class:`ReadError`, :class:`Close`, and :class:`Within` for a bounded side request) run by
``_driver``; ``_transport`` and ``_async_transport``
perform them with ``httpx.Client`` / ``httpx.AsyncClient``. Also here: the bookkeeping of
streamed bodies (upload framing, download limits, capped error bodies); the client's settings
(TLS, redirects, headers, proxies) are ``_client_settings``.
"""

from __future__ import annotations

import copy
import functools
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import httpx

from ..._driver import Steps
from ..._fix import Fix, Setting
from ..._local_dev import stopped_dev_at
from ...credentials._credential import Credential
from ...errors import BrokerError, BrokerTLSError, BrokerUnavailableError, SandboxFailedError
from ...errors import RequestTimeoutError as _RequestTimeoutError
from ..core._retry import RetryPolicy, SingleAttempt
from ..core._steps import Sleep, Step
from ..core._upload import CHUNK_SIZE, UploadBody
from ..wire import _protocol as proto
from ..wire._dataplane import DataTarget, Keepalive, KeptAlive
from ..wire._dialect import Dialect
from ..wire._dialects import BrokerDialect
from ._client_settings import build_request, retry_policy
from ._config import ENV_TRUST_ENV_PROXIES, BrokerConnectionConfig

__all__ = [
    "CHUNK_SIZE",
    "Answered",
    "CappedBody",
    "Close",
    "Exchange",
    "GetCredential",
    "Read",
    "ReadError",
    "Send",
    "Sleep",
    "UploadBody",
    "Within",
    "only_call",
]

logger = logging.getLogger("k8s_agent_sandbox_awx.transport")

MAX_ERROR_BODY = 64 * 1024
KEEPALIVE_TIMEOUT = 2.0
"""Seconds the activity keepalive's extension may take in all (one attempt, ``request_timeout``
if that is shorter; :class:`Within`): it never delays the data-plane request it rides on by
more, however slowly the control plane answers."""
PRIMED_SECONDS = 30.0
"""How long a credential fetched before the dialect probe may be used by the first request."""
_BUSY = frozenset({408, 429})
"""Answers to a probe that say the broker is busy, not what it serves: not an answer."""


def certificate_failed(exc: BaseException) -> bool:
    """Whether a transport error was caused by a certificate that did not verify."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLCertVerificationError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return (url.scheme, url.host, url.port)


@functools.lru_cache(maxsize=64)
def _audience_origin(audience: str) -> tuple[str, str, int | None]:
    """The origin of the audience (the broker URL), parsed once, not at every request."""
    return _origin(httpx.URL(audience))


# --------------------------------------------------------------------------------------------
# The I/O steps an exchange asks for


@dataclass(frozen=True, slots=True)
class GetCredential:
    """Ask the credential source for a token for ``audience``."""

    audience: str


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``request``; the answer: the response with its body not read yet."""

    request: httpx.Request


@dataclass(frozen=True, slots=True)
class Read:
    """Read ``response``'s body whole, then close it."""

    response: httpx.Response


@dataclass(frozen=True, slots=True)
class ReadError:
    """Read at most ``MAX_ERROR_BODY`` bytes of an error ``response`` and close it; the
    answer: those bytes (a broken read gives what arrived)."""

    response: httpx.Response


@dataclass(frozen=True, slots=True)
class Close:
    """Close ``response`` unread."""

    response: httpx.Response


@dataclass(frozen=True, slots=True)
class Within:
    """Perform ``steps`` (a whole exchange) to its result within ``seconds`` in all, not per
    read; past them raise ``TimeoutError`` (:meth:`late`) and give it up: the async transport
    cancels it, the sync one leaves it to end on its own (in a helper thread, reading no answer
    past the same deadline)."""

    steps: Steps[ExchangeStep, Any]
    seconds: float

    def late(self) -> TimeoutError:
        return TimeoutError(f"no answer within {self.seconds:g} s in all")


ExchangeStep = GetCredential | Send | Read | ReadError | Close | Sleep | Within
"""What an exchange asks for (``Sleep``, before the next attempt, is the operations' step;
``Within``, a side request bounded in all: the keepalive's extension)."""


def only_call(step: Step) -> proto.Call[Any]:
    """``step``, a call: what ``transport.run`` performs (the commands shells perform the
    event-stream steps)."""
    if not isinstance(step, proto.Call):
        raise TypeError(
            f"transport.run() performs calls only, not {type(step).__name__}: run a command's "
            "operation with the commands shell's performer."
        )
    return step


# --------------------------------------------------------------------------------------------
# One request and its attempts


class Exchange:
    """One logical request: builds each attempt, authorizes it, decides what an outcome means
    (done, retry after a delay, or a typed error). :meth:`steps` is the whole exchange."""

    def __init__(
        self,
        client: httpx.Client | httpx.AsyncClient,
        config: BrokerConnectionConfig,
        retry: RetryPolicy,
        dialect: Dialect,
        spec: proto.RequestSpec,
        *,
        invalidate: Callable[[str], None],
        body: Any = None,
        authenticate: bool = True,
        timeout: float | None = None,
    ) -> None:
        self._client = client
        self.config = config
        self.timeout = timeout or config.request_timeout
        """The request timeout (connect, and each read/write unless ``spec.read_timeout``)."""
        self.retry = retry
        self.dialect = dialect
        self.spec = spec
        self.body = body
        self.authenticate = authenticate and not spec.probe
        self._invalidate = invalidate
        self.attempt = 0
        self.auth_retried = False
        self.request: httpx.Request | None = None
        self.error_body: bytes | None = None
        """An error answer's body already read (to decide about a 401)."""
        self.reached = False
        """Whether an attempt may have reached the broker (it was sent, or answered)."""

    @property
    def replayable(self) -> bool:
        """Whether the body can be sent again (bytes, or a rewindable upload)."""
        return self.body is None or bool(getattr(self.body, "replayable", False))

    def steps(self, *, stream: bool = False) -> Steps[ExchangeStep, httpx.Response]:
        """The exchange: a 2xx response (or a 404 when ``spec.not_found_ok``), read unless
        ``stream`` (then the caller closes it); errors raised as typed ``BrokerError``s."""
        if self.spec.delay > 0:
            yield Sleep(self.spec.delay)
        while True:
            request = self.next_request()
            try:
                response = yield from self._send(request)
            except httpx.TransportError as exc:
                yield Sleep(self.delay_after_error(exc))
                continue
            delay = self.delay_after_response(response)
            if delay is None:
                break
            yield Close(response)
            yield Sleep(delay)
        if not self.succeeded(response):
            body = self.error_body
            if body is None:
                body = yield ReadError(response)
            raise self.failure(response, body)
        if not stream:
            try:
                yield Read(response)
            except httpx.TransportError as exc:
                raise self.read_error(exc) from exc
        return response

    def _send(self, request: httpx.Request) -> Steps[ExchangeStep, httpx.Response]:
        """One attempt, with the token; after the broker's 401, once more with a re-read one."""
        if self.authenticate:
            self._check_origin(request)
            self._authorize(request, (yield GetCredential(self.config.audience)))
        response: httpx.Response = yield Send(request)
        logger.debug("%s %s -> %s", self.spec.method, self.spec.path, response.status_code)
        if response.status_code != 401 or not self.authenticate:
            return response
        self.error_body = yield ReadError(response)  # read (capped) and closed
        if not self.dialect.token_rejected(401, response.headers, self.error_body, self.spec):
            logger.info("401 from behind the broker (not a token rejection); not retrying")
            return response
        self._invalidate(self.config.audience)
        if not self.retry.after_unauthorized(retried=self.auth_retried, replayable=self.replayable):
            logger.info("401 from the broker; the body cannot be re-sent, not retrying")
            return response
        logger.info("401 from the broker; re-reading the credential and retrying once")
        self.auth_retried, self.error_body = True, None
        self._authorize(request, (yield GetCredential(self.config.audience)))
        retried: httpx.Response = yield Send(request)
        return retried

    def _check_origin(self, request: httpx.Request) -> None:
        audience = self.config.audience
        if _origin(request.url) != _audience_origin(audience):
            raise BrokerError(
                f"Refusing to send the token to {request.url.scheme}://{request.url.host}: it is "
                f"not the broker's origin ({audience}). Tokens only go to the broker."
            )

    @staticmethod
    def _authorize(request: httpx.Request, credential: Credential) -> None:
        request.headers["Authorization"] = f"Bearer {credential.token}"

    def next_request(self) -> httpx.Request:
        """The request for the next attempt."""
        self.attempt += 1
        self.error_body = None
        spec = self.spec
        if self.body is not None and self.attempt > 1 and not self.replayable:
            raise BrokerError(
                f"Could not {spec.what}: the upload stream was consumed and cannot be sent "
                "again; pass bytes or a seekable file to allow a retry."
            )
        request = build_request(
            self._client,
            spec.method,
            self.config.broker_url + spec.path,
            params=spec.params or None,
            headers=spec.headers,
            content=spec.content,
            timeout=httpx.Timeout(self.timeout, read=spec.read_timeout or self.timeout),
        )
        if self.body is not None:
            request = httpx.Request(
                request.method,
                request.url,
                headers=request.headers,
                stream=self.body,
                extensions=request.extensions,
            )
        self.request = request
        return request

    def delay_after_error(self, exc: httpx.TransportError) -> float:
        """Seconds to wait before the next attempt after ``exc``; raises the typed error if the
        request must not (or can no longer) be retried."""
        sent = not isinstance(
            exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout | httpx.ProxyError
        )  # a ProxyError: the proxy refused the CONNECT tunnel, nothing went through it
        self.reached = self.reached or sent
        permanent = certificate_failed(exc)
        timed_out = isinstance(exc, httpx.TimeoutException)
        delay = self.retry.after_transport_error(
            self.spec, self.attempt, request_sent=sent, timed_out=timed_out, permanent=permanent
        )
        if delay is None:
            if permanent:
                raise self.tls_error(exc) from exc
            if isinstance(exc, httpx.TimeoutException):
                raise self.timeout_error(exc) from exc
            raise self.transport_error(exc, sent=sent) from exc
        self._log_retry(delay, type(exc).__name__)
        return delay

    def succeeded(self, response: httpx.Response) -> bool:
        status = response.status_code
        if self.spec.probe:  # 408/429: busy, which tells nothing (a 429 is retried); a 3xx
            return status < 300 or (400 <= status < 500 and status not in _BUSY)  # is an error
        return status < 300 or (status == 404 and self.spec.not_found_ok)

    def delay_after_response(self, response: httpx.Response) -> float | None:
        """Seconds to wait before retrying after an error ``response``; ``None``: no retry
        (a success, or an error to raise with :meth:`failure`)."""
        self.reached = True
        status = response.status_code
        if self.succeeded(response) or status < 400:
            return None
        delay = self.retry.after_status(self.spec, self.attempt, status, response.headers)
        if delay is not None:
            self._log_retry(delay, str(status))
        return delay

    def failure(self, response: httpx.Response, body: bytes) -> BrokerError:
        """The typed error for an unsuccessful ``response`` whose (capped) body is ``body``."""
        status = response.status_code
        return self.dialect.error(
            status,
            response.headers,
            body if status >= 400 else b"",
            spec=self.spec,
            retried_auth=self.auth_retried,
            secrets=self._sent_token(),
        )

    def _sent_token(self) -> tuple[str, ...]:
        """The token the last attempt carried: redacted from messages about its outcome."""
        token = proto.sent_token(self.request.headers) if self.request else ""
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
        limit = spec.read_timeout or self.timeout
        if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
            limit = self.timeout
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
            "help.",
            fix=Fix(
                "Set ",
                Setting("ca_bundle", or_env=True),
                " to the PEM file of the CA that signed the broker's certificate; if that is "
                "the right CA, check this machine's clock (a certificate is only valid between "
                "its dates) and that the broker URL names a host of the certificate.",
            ),
            method=spec.method,
            path=spec.path,
            request_sent=False,
        )

    def transport_error(self, exc: httpx.TransportError, *, sent: bool) -> BrokerUnavailableError:
        spec = self.spec
        broker = self.config.broker_url
        if isinstance(exc, httpx.ConnectError):
            reason = self._reason(exc)
            # what the user must fix first: the broker is not there (not the step that met it)
            msg = f"Cannot connect to the broker at {broker}: {reason} (to {spec.what})."
            dev = stopped_dev_at(broker, self.config.ca_cert)  # `agent-sandbox-awx dev`'s URL
            check = Fix("Check ", Setting("broker_url", or_env=True), " and that the broker runs.")
            return BrokerUnavailableError(
                f"{msg} {dev}" if dev else msg,
                fix=None if dev else check,
                method=spec.method,
                path=spec.path,
                request_sent=self.reached,
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
        if broker.startswith("http://") and isinstance(exc, httpx.RemoteProtocolError):
            https = "https://" + broker[len("http://") :]
            return BrokerUnavailableError(
                f"Could not {spec.what}: the server at {broker} closed the connection without "
                f"an HTTP answer ({self._reason(exc)}): it may speak HTTPS, which a plain "
                "http:// URL does not; retrying the same URL cannot help.",
                fix=Fix(
                    "Use its https:// URL: ",
                    Setting("broker_url", https),
                    " (with the CA bundle that signed its certificate: ",
                    Setting("ca_bundle"),
                    ").",
                ),
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


class Answered:
    """An event stream's answer read whole (``open_events``): its values in order, then
    ``error`` (the break that ended the read early: raised after the values that arrived
    before it) or the end (``None``)."""

    __slots__ = ("_error", "_values")

    def __init__(self, values: list[Any], error: BaseException | None = None) -> None:
        self._values = values
        self._values.reverse()
        self._error = error

    def next(self) -> Any:
        """The next value; ``None`` at the end; the break once the values are out."""
        if self._values:
            return self._values.pop()
        error, self._error = self._error, None
        if error is not None:
            raise error
        return None


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
# What the sync and the async transport share


class TransportBase:
    """The configuration, credential source, dialect and retry policy of one transport, and
    the steps of its requests; the subclasses add only the I/O (``perform``)."""

    def __init__(
        self,
        config: BrokerConnectionConfig,
        auth: Any,
        speaking: BrokerDialect,
        connections: Any,
        retry: RetryPolicy | None,
    ) -> None:
        self.config = config
        self.auth = auth
        self.speaking = speaking
        """The dialect spoken (the client's: one owner), which maps the answers."""
        self.retry = retry or retry_policy(config)
        self._connections = connections
        """The client object's ``Lease`` / ``AsyncLease``: ``.client`` builds the requests."""
        self._primed: tuple[Credential, float] | None = None
        self._kept: KeptAlive | None = None
        """The kept-alive sandbox whose data plane this twin serves (:meth:`to`)."""

    @property
    def dialect(self) -> Dialect:
        return self.speaking.current

    @property
    def broker_url(self) -> str:
        return self.config.broker_url

    def prime(self, credential: Credential) -> None:
        """Hand ``credential`` (just fetched: before the dialect probe) to the next request for
        the broker's audience, so that it is not fetched twice (used within
        :data:`PRIMED_SECONDS`, else fetched again)."""
        self._primed = (credential, time.monotonic())

    def primed(self) -> Credential | None:
        """The credential :meth:`prime` handed over, once (``None``: fetch one)."""
        primed, self._primed = self._primed, None
        if primed is None or time.monotonic() - primed[1] > PRIMED_SECONDS:
            return None
        return primed[0]

    def exchange(
        self,
        spec: proto.RequestSpec,
        *,
        stream: bool = False,
        body: Any = None,
        authenticate: bool = True,
    ) -> Steps[ExchangeStep, httpx.Response]:
        """The steps of sending ``spec`` (see :meth:`Exchange.steps`); a data-plane request
        of a kept-alive sandbox (:meth:`to`) extends its lifetime first when that is due."""
        exchange = Exchange(
            self._connections.client,
            self.config,
            self.retry,
            self.dialect,
            spec,
            invalidate=self.auth.invalidate,
            body=body,
            authenticate=authenticate,
        )
        steps = exchange.steps(stream=stream)
        if self._kept is None or not (spec.data_plane and exchange.authenticate):
            return steps
        return self._kept_alive(self._kept, steps)

    def to(self, target: DataTarget) -> Self:
        """This transport for the data plane of one sandbox (``target``): itself, or for a
        kept-alive target (:class:`KeptAlive`) a twin that shares everything (the connections,
        the credential source, the retry policy, the dialect) and extends the sandbox's
        lifetime before a data-plane request when the target says it is due."""
        if not isinstance(target, KeptAlive):
            return self
        twin = copy.copy(self)
        twin._kept, twin._primed = target, None
        return twin

    def _kept_alive(
        self, kept: KeptAlive, steps: Steps[ExchangeStep, httpx.Response]
    ) -> Steps[ExchangeStep, httpx.Response]:
        extension = kept.due()
        if extension is not None:
            yield from self._extend(kept.keepalive, extension)
        return (yield from steps)

    def _extend(self, keepalive: Keepalive, call: proto.Call[Any]) -> Steps[ExchangeStep, None]:
        """Extend the sandbox's lifetime before a data-plane request, best effort: one attempt
        within :data:`KEEPALIVE_TIMEOUT` in all (:class:`Within`), never retried (it must not
        delay the request it rides on); a failure is logged, never fails the request, and the
        next request tries again (an interruption still propagates)."""
        budget = min(KEEPALIVE_TIMEOUT, self.config.request_timeout)
        try:
            extend = Exchange(
                self._connections.client,
                self.config,
                SingleAttempt(),
                self.dialect,
                call.spec,
                invalidate=self.auth.invalidate,
                timeout=budget,
            )
            keepalive.extended(call.parse((yield Within(extend.steps(), budget))).expires_at)
        except Exception as exc:
            keepalive.failed()
            logger.warning(
                "keepalive of sandbox %s failed (ignored): %s (tried again at the next request)",
                keepalive.name,
                exc,
            )
        else:
            logger.debug("keepalive: sandbox %s extended by %ss", keepalive.name, keepalive.seconds)

    def upload_stream(self, body: UploadBody) -> Any:
        """``body`` as this transport's httpx stream."""
        raise NotImplementedError

    def call_steps(
        self, call: proto.Call[Any], sent: list[str] | None = None
    ) -> Steps[ExchangeStep, Any]:
        """The steps of one :class:`Call`: send, then parse (or map the failure). The token the
        request carried is added to ``sent`` and never shows in an error about the answer."""
        body = None if call.body is None else self.upload_stream(call.body)
        try:
            response = yield from self.exchange(call.spec, stream=call.stream, body=body)
        except Exception as exc:
            self.speaking.note(call.spec, exc)
            mapped = call.fail(exc) if call.fail is not None else None
            if mapped is None:
                raise
            raise mapped from exc
        token = proto.sent_token(response.request.headers)
        if sent is not None:
            sent.append(token)
        try:
            result = call.parse(response)
        except (BrokerError, SandboxFailedError) as exc:
            proto.redact_sent(exc, (token,))
            raise
        self.speaking.confirm(call.spec, response.status_code)
        return result
