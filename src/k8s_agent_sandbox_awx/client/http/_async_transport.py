"""The async I/O layer: a client object's requests through its ``AsyncLease`` of the running
loop's shared ``httpx.AsyncClient`` for its settings (``_async_pool``).

The counterpart of ``_transport`` for asyncio: it performs the same ``_exchange`` steps (auth,
retries, redirects, timeouts, errors) and the same ``_flow`` operations with ``await``. A call
marked ``cleanup`` (deleting a claim after a failed or cancelled create, killing on exit) runs in
its own task that a cancellation of the caller does not interrupt; the cancellation is re-raised
once the cleanup is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import httpx

from ..._driver import Stepper, adrive
from ...credentials._auth import CredentialSource
from ...errors import BrokerError, SandboxFailedError
from ..core._retry import RetryPolicy
from ..core._steps import Op
from ..wire import _protocol as proto
from ..wire._dialects import BrokerDialect
from ..wire._files_wire import DownloadMeter
from . import _exchange as ex
from ._async_pool import AsyncLease
from ._config import BrokerConnectionConfig

__all__ = ["AsyncBrokerTransport", "AsyncUploadStream"]

logger = logging.getLogger("k8s_agent_sandbox_awx.transport")

T = TypeVar("T")


class AsyncUploadStream(httpx.AsyncByteStream):
    """A streamed upload body: bytes, a sync binary file (read in a worker thread, so the
    event loop never waits for the disk), an iterator or an async iterable of bytes."""

    def __init__(self, body: ex.UploadBody) -> None:
        self._body = body
        self.replayable = body.replayable

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        body = self._body
        body.begin()
        yield body.framing.prefix
        for data in body.byte_chunks():
            yield data
        if body.kind == "aiter":
            async for piece in body.content:
                if data := body.accept(piece):
                    yield data
        elif body.kind == "iter":
            for piece in body.content:
                if data := body.accept(piece):
                    yield data
        while want := body.want():
            if data := body.accept(await asyncio.to_thread(body.content.read, want)):
                yield data
        yield body.framing.suffix


class AsyncBrokerTransport(ex.TransportBase):
    """Sends requests to the broker from an event loop (``httpx.AsyncClient``)."""

    def __init__(
        self,
        config: BrokerConnectionConfig,
        auth: CredentialSource,
        speaking: BrokerDialect,
        *,
        http_transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        retry: RetryPolicy | None = None,
    ) -> None:
        lease = AsyncLease(config, http_transport)
        super().__init__(config, auth, speaking, lease, retry)
        self._http = lease
        self._sleep = sleep
        self._cleanups: set[asyncio.Task[Any]] = set()

    @property
    def is_closed(self) -> bool:
        return self._http.closed

    async def close(self) -> None:
        """Close this client's connections (after any cleanup still running; the shared pool
        goes on for other clients)."""
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        await self._http.close()

    async def perform(self, step: ex.ExchangeStep) -> Any:
        """Perform one I/O step of an exchange."""
        match step:
            case ex.Send(request):
                return await self._http.send(request)
            case ex.GetCredential(audience):
                return self.primed() or await self.auth.aget_credential(audience)
            case ex.Read(response):
                try:
                    return await response.aread()
                finally:
                    await response.aclose()
            case ex.ReadError(response):
                return await self._error_body(response)
            case ex.Close(response):
                return await response.aclose()
            case ex.Sleep(seconds):
                return await self._sleep(seconds)
            case ex.Within(steps, seconds):  # cancelled at the deadline
                try:
                    return await asyncio.wait_for(adrive(steps, self.perform), seconds)
                except TimeoutError:
                    raise step.late() from None

    @staticmethod
    async def _error_body(response: httpx.Response) -> bytes:
        capped = ex.CappedBody()
        try:
            async for chunk in response.aiter_bytes():
                if capped.add(chunk):
                    break
        except httpx.HTTPError:
            pass  # the status alone is reported
        finally:
            await response.aclose()
        return capped.data

    async def send(
        self,
        spec: proto.RequestSpec,
        *,
        stream: bool = False,
        body: httpx.AsyncByteStream | None = None,
        authenticate: bool = True,
    ) -> httpx.Response:
        """Send ``spec`` (see ``BrokerTransport.send``). The exchange's two usual steps (the
        credential, the send) are performed here, the others by :meth:`perform`: what
        ``adrive(steps, self.perform)`` does, without a coroutine per step."""
        stepper = Stepper(self.exchange(spec, stream=stream, body=body, authenticate=authenticate))
        while (step := stepper.advance()) is not None:
            try:
                kind = type(step)
                if kind is ex.Send:
                    stepper.reply = await self._http.send(step.request)  # type: ignore[union-attr]
                elif kind is ex.GetCredential:
                    audience = step.audience  # type: ignore[union-attr]
                    stepper.reply = self.primed() or await self.auth.aget_credential(audience)
                else:
                    stepper.reply = await self.perform(step)
            except BaseException as exc:  # thrown into the exchange, which decides
                stepper.error = exc
        return stepper.result

    async def call(self, call: proto.Call[T], sent: list[str] | None = None) -> T:
        """Send one call and parse its answer; a cleanup call completes even if cancelled."""
        steps = self.call_steps(call, sent)
        if call.cleanup:
            return await self.complete(adrive(steps, self.perform))
        result: T = await adrive(steps, self.perform)
        return result

    async def run(self, op: Op[T]) -> T:
        """Run an operation whose steps are calls to its result (see
        ``BrokerTransport.run``)."""
        sent: list[str] = []
        try:
            return await adrive(op, lambda step: self.call(ex.only_call(step), sent))
        except (BrokerError, SandboxFailedError) as exc:
            proto.redact_sent(exc, sent)
            raise

    async def complete(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` to the end in its own task, even if the calling task is cancelled
        meanwhile (``asyncio.shield``, again after each cancellation); then re-raise the
        cancellation, or return the result."""
        task = asyncio.ensure_future(work)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        cancelled: asyncio.CancelledError | None = None
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError as exc:
                if task.cancelled():
                    raise
                cancelled = exc
            except BaseException:
                break  # the task's own error: raised by task.result() below
        if cancelled is not None:
            if not task.cancelled() and task.exception() is not None:
                logger.error("a cleanup failed while cancelled: %s", task.exception())
            raise cancelled
        return task.result()

    def upload_stream(self, body: ex.UploadBody) -> AsyncUploadStream:
        return AsyncUploadStream(body)

    async def stream(
        self, spec: proto.RequestSpec, meter: DownloadMeter, chunk_size: int | None = ex.CHUNK_SIZE
    ) -> AsyncGenerator[bytes, None]:
        """The answer to ``spec`` in chunks of ``chunk_size`` (``None``: each as it arrives);
        the request is sent on first iteration."""
        async with contextlib.aclosing(
            self.chunks(await self.send(spec, stream=True), meter, chunk_size)
        ) as it:
            async for chunk in it:
                yield chunk

    async def chunks(
        self, response: httpx.Response, meter: DownloadMeter, size: int | None = ex.CHUNK_SIZE
    ) -> AsyncGenerator[bytes, None]:
        """An open ``response``'s body in chunks of ``size`` bytes (``None``: as they arrive),
        counted by ``meter``; closed at the end."""
        try:
            async for chunk in response.aiter_bytes(size):
                yield meter.count(chunk)
        except httpx.TransportError as exc:
            raise meter.error(exc, timed_out=isinstance(exc, httpx.TimeoutException)) from exc
        finally:
            await response.aclose()

    async def events(
        self, spec: proto.RequestSpec, *, json_answer: bool = False
    ) -> AsyncGenerator[Any, None]:
        """The answer to ``spec`` as a stream of NDJSON values (see ``BrokerTransport.events``;
        ``contextlib.aclosing`` to stop early)."""
        response = await self.send(spec, stream=True)
        async with contextlib.aclosing(self._events(response, spec, json_answer)) as values:
            async for value in values:
                yield value

    async def open_events(
        self, spec: proto.RequestSpec, *, json_answer: bool = False
    ) -> ex.Answered | AsyncGenerator[Any, None]:
        """The answer to ``spec`` as NDJSON values (see :meth:`events`), sent now: an answer
        with a ``Content-Length`` (the streamed start of a run without callbacks, answered
        whole at the exit: ``Prefer: no-live-output``) read and decoded at once into an
        :class:`~._exchange.Answered`; any other (chunked: live output) the :meth:`events`
        stream of it, its values as their lines complete."""
        response = await self.send(spec, stream=True)
        if "content-length" not in response.headers:
            return self._events(response, spec, json_answer)
        decoder = proto.event_decoder(spec.what, response.headers.get("content-type"), json_answer)
        meter = DownloadMeter(spec, spec.path, None)
        values: list[Any] = []
        try:
            async for chunk in self.chunks(response, meter, None):  # one generator per answer
                values += decoder.feed(chunk)
            values += decoder.end()
        except Exception as exc:  # raised after the values before it, as the stream does
            return ex.Answered(values, exc)
        return ex.Answered(values)

    async def _events(
        self, response: httpx.Response, spec: proto.RequestSpec, json_answer: bool
    ) -> AsyncGenerator[Any, None]:
        decoder = proto.event_decoder(spec.what, response.headers.get("content-type"), json_answer)
        meter = DownloadMeter(spec, spec.path, None)
        async with contextlib.aclosing(self.chunks(response, meter, None)) as chunks:
            async for chunk in chunks:
                for value in decoder.feed(chunk):
                    yield value
        for value in decoder.end():
            yield value

    async def download(
        self,
        spec: proto.RequestSpec,
        meter: DownloadMeter,
        write: Callable[[bytes], Awaitable[Any]],
    ) -> int:
        """Stream the answer to ``spec`` into ``await write(chunk)``; the bytes written."""
        async with contextlib.aclosing(self.stream(spec, meter)) as chunks:
            async for chunk in chunks:
                await write(chunk)
        return meter.total
