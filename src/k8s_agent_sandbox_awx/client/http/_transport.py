"""The sync I/O layer: a client object's requests through its ``Lease`` of the process's
shared ``httpx.Client`` for its settings (``_pool``).

Everything else (what to send, auth, retries, timeouts, errors) comes from ``_exchange`` and
the dialect; this module only performs the steps: sends, reads, credential fetches and sleeps.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

import httpx

from ..._driver import drive
from ...credentials._auth import CredentialSource
from ...errors import BrokerError, SandboxFailedError
from ..core._retry import RetryPolicy
from ..core._steps import Op
from ..wire import _protocol as proto
from ..wire._dialects import BrokerDialect
from ..wire._files_wire import DownloadMeter
from ._config import BrokerConnectionConfig
from ._exchange import (
    CHUNK_SIZE,
    CappedBody,
    Close,
    ExchangeStep,
    GetCredential,
    Read,
    ReadError,
    Send,
    Sleep,
    TransportBase,
    UploadBody,
    Within,
    only_call,
)
from ._pool import Lease

__all__ = ["BrokerTransport", "UploadStream"]

logger = logging.getLogger("k8s_agent_sandbox_awx.transport")

T = TypeVar("T")


class UploadStream(httpx.SyncByteStream):
    """A streamed upload body read from bytes or a binary file, chunk by chunk."""

    def __init__(self, body: UploadBody) -> None:
        self._body = body
        self.replayable = body.replayable

    def __iter__(self) -> Iterator[bytes]:
        body = self._body
        body.begin()
        yield body.framing.prefix
        yield from body.byte_chunks()
        if body.kind == "iter":
            for piece in body.content:
                if chunk := body.accept(piece):
                    yield chunk
        while want := body.want():
            if chunk := body.accept(body.content.read(want)):
                yield chunk
        yield body.framing.suffix


class _UntilDeadline(httpx.SyncByteStream):
    """An answer's body that stops arriving at ``deadline`` (``TimeoutError``)."""

    def __init__(self, stream: Any, deadline: float) -> None:
        self._stream = stream
        self._deadline = deadline

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._stream:
            if time.monotonic() > self._deadline:
                raise TimeoutError("its answer was still arriving at the deadline")
            yield chunk

    def close(self) -> None:
        self._stream.close()


class BrokerTransport(TransportBase):
    """Sends requests to the broker: performs the steps of ``_exchange`` with ``httpx.Client``."""

    def __init__(
        self,
        config: BrokerConnectionConfig,
        auth: CredentialSource,
        speaking: BrokerDialect,
        *,
        http_transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        retry: RetryPolicy | None = None,
    ) -> None:
        lease = Lease(config, http_transport)
        super().__init__(config, auth, speaking, lease, retry)
        self._http = lease
        self._sleep = sleep
        self._within = threading.Lock()  # held while a Within's helper thread runs

    @property
    def is_closed(self) -> bool:
        return self._http.closed

    def close(self) -> None:
        """Close this client's connections (the shared pool goes on for other clients)."""
        self._http.close()

    def perform(self, step: ExchangeStep) -> Any:
        """Perform one I/O step of an exchange."""
        match step:
            case Send(request):
                return self._http.send(request)
            case GetCredential(audience):
                return self.primed() or self.auth.get_credential(audience)
            case Read(response):
                try:
                    return response.read()
                finally:
                    response.close()
            case ReadError(response):
                return self._error_body(response)
            case Close(response):
                return response.close()
            case Sleep(seconds):
                return self._sleep(seconds)
            case Within():
                return self._bounded(step)

    def _bounded(self, step: Within) -> Any:
        """Perform ``step.steps`` in a helper thread, waiting for it at most ``step.seconds``;
        a late one runs on to its end alone (reading no answer past the deadline) and only one
        runs at a time: while it does, the next is refused at once."""
        if not self._within.acquire(blocking=False):
            raise TimeoutError("the previous one has not ended yet")
        deadline = time.monotonic() + step.seconds
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(drive(step.steps, lambda s: self._perform_by(s, deadline)))
            except BaseException as exc:  # handed to the waiter, if it still waits
                done.set_exception(exc)
            finally:
                self._within.release()

        threading.Thread(target=run, name="agent-sandbox-bounded", daemon=True).start()
        try:
            return done.result(timeout=step.seconds)
        except concurrent.futures.TimeoutError:
            raise step.late() from None

    def _perform_by(self, step: ExchangeStep, deadline: float) -> Any:
        """:meth:`perform`, reading an answer's body no longer than until ``deadline``."""
        if isinstance(step, Read | ReadError):
            step.response.stream = _UntilDeadline(step.response.stream, deadline)
        return self.perform(step)

    @staticmethod
    def _error_body(response: httpx.Response) -> bytes:
        capped = CappedBody()
        try:
            for chunk in response.iter_bytes():
                if capped.add(chunk):
                    break
        except httpx.HTTPError:
            pass  # the status alone is reported
        finally:
            response.close()
        return capped.data

    def send(
        self,
        spec: proto.RequestSpec,
        *,
        stream: bool = False,
        body: Any = None,
        authenticate: bool = True,
    ) -> httpx.Response:
        """Send ``spec``; the response (read, unless ``stream``: then the caller closes it)."""
        steps = self.exchange(spec, stream=stream, body=body, authenticate=authenticate)
        return drive(steps, self.perform)

    def call(self, call: proto.Call[T], sent: list[str] | None = None) -> T:
        """Send one call and parse its answer (``sent``: see ``call_steps``)."""
        result: T = drive(self.call_steps(call, sent), self.perform)
        return result

    def run(self, op: Op[T]) -> T:
        """Run an operation whose steps are calls (``_flow``, ``_fsapi``) to its result; an
        error it builds from an answer never shows a token its requests carried."""
        sent: list[str] = []
        try:
            return drive(op, lambda step: self.call(only_call(step), sent))
        except (BrokerError, SandboxFailedError) as exc:
            proto.redact_sent(exc, sent)
            raise

    def upload_stream(self, body: UploadBody) -> UploadStream:
        return UploadStream(body)

    def stream(
        self, spec: proto.RequestSpec, meter: DownloadMeter, chunk_size: int | None = CHUNK_SIZE
    ) -> Generator[bytes, None, None]:
        """The answer to ``spec`` in chunks of ``chunk_size`` (``None``: each as it arrives);
        the request is sent on first iteration."""
        yield from self.chunks(self.send(spec, stream=True), meter, chunk_size)

    def chunks(
        self, response: httpx.Response, meter: DownloadMeter, size: int | None = CHUNK_SIZE
    ) -> Generator[bytes, None, None]:
        """An open ``response``'s body in chunks of ``size`` bytes (``None``: as they arrive),
        counted by ``meter``; closed at the end."""
        try:
            for chunk in response.iter_bytes(size):
                yield meter.count(chunk)
        except httpx.TransportError as exc:
            raise meter.error(exc, timed_out=isinstance(exc, httpx.TimeoutException)) from exc
        finally:
            response.close()

    def events(
        self, spec: proto.RequestSpec, *, json_answer: bool = False
    ) -> Generator[Any, None, None]:
        """The answer to ``spec`` as a stream of NDJSON values, each as soon as its line is
        complete (the request is sent on first iteration; close the generator to stop).
        ``json_answer``: an answer not labelled ``application/x-ndjson`` is one value."""
        response = self.send(spec, stream=True)
        content_type = response.headers.get("content-type")
        decoder = proto.event_decoder(spec.what, content_type, json_answer)
        meter = DownloadMeter(spec, spec.path, None)
        with contextlib.closing(self.chunks(response, meter, None)) as chunks:  # not held back
            for chunk in chunks:
                yield from decoder.feed(chunk)
        yield from decoder.end()

    def download(self, spec: proto.RequestSpec, meter: DownloadMeter, out: Any) -> int:
        """Stream the answer to ``spec`` into ``out.write``; the bytes written."""
        with contextlib.closing(self.stream(spec, meter)) as chunks:
            for chunk in chunks:
                out.write(chunk)
        return meter.total
