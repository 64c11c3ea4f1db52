"""The async I/O layer: one ``httpx.AsyncClient`` per client object.

The counterpart of ``_transport`` for asyncio: the same ``_exchange`` decisions (auth, retries,
redirects, timeouts, errors) and the same ``_flow`` operations, performed with ``await``. A call
marked ``cleanup`` (deleting a claim after a failed or cancelled create, killing on exit) runs in
its own task that a cancellation of the caller does not interrupt; the cancellation is re-raised
once the cleanup is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Coroutine
from typing import Any

import httpx

from . import _exchange as ex
from . import _flow as flow
from . import _protocol as proto
from ._auth import CredentialSource
from ._config import BrokerConnectionConfig

__all__ = ["AsyncBrokerTransport", "AsyncUploadStream", "adrive"]

logger = logging.getLogger("k8s_agent_sandbox_awx.transport")


async def adrive(op: flow.Op[flow.T], perform: Callable[[flow.Call], Awaitable[Any]]) -> flow.T:
    """Run ``op`` on the event loop; ``perform`` sends one call (the async ``flow.drive``)."""
    stepper = flow.Stepper(op)
    call = stepper.advance()
    while call is not None:
        try:
            stepper.reply = await perform(call)
        except BaseException as exc:  # thrown into the operation, which decides
            stepper.error = exc
        call = stepper.advance()
    return stepper.result


class AsyncUploadStream(httpx.AsyncByteStream):
    """A streamed upload body: bytes, a sync binary file (read in a worker thread, so the
    event loop never waits for the disk) or an async iterable of bytes."""

    def __init__(self, body: ex.UploadBody, source: AsyncIterable[Any] | None = None) -> None:
        self._body = body
        self._source = source
        self.replayable = body.replayable

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        body = self._body
        body.begin()
        yield body.framing.prefix
        if self._source is not None:
            async for piece in self._source:
                if data := body.accept(piece):
                    yield data
        elif isinstance(body.content, bytes):
            for data in body.byte_chunks():
                yield data
        while want := body.want():
            if data := body.accept(await asyncio.to_thread(body.content.read, want)):
                yield data
        yield body.framing.suffix


class AsyncBrokerTransport:
    """Sends ``RequestSpec``s to the broker from an event loop."""

    def __init__(
        self,
        config: BrokerConnectionConfig,
        auth: CredentialSource,
        *,
        http_transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        retry: proto.RetryPolicy | None = None,
    ) -> None:
        self.config = config
        self.auth = auth
        self._sleep = sleep
        self.retry = retry or ex.retry_policy(config)
        self._client = httpx.AsyncClient(
            transport=http_transport, **ex.client_settings(config, auth, httpx.Response.aread)
        )
        self._cleanups: set[asyncio.Task[Any]] = set()

    @property
    def broker_url(self) -> str:
        return self.config.broker_url

    @property
    def is_closed(self) -> bool:
        return self._client.is_closed

    async def close(self) -> None:
        """Close the connections (after any cleanup still running)."""
        if self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        await self._client.aclose()

    async def perform(self, call: flow.Call) -> httpx.Response:
        """Perform one call of an operation; a cleanup call completes even if cancelled."""
        if call.cleanup:
            return await self.complete(self.send(call.spec))
        return await self.send(call.spec)

    async def run(self, op: flow.Op[flow.T]) -> flow.T:
        """Run an operation of ``_flow`` to its result."""
        return await adrive(op, self.perform)

    async def complete(self, work: Coroutine[Any, Any, flow.T]) -> flow.T:
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

    async def send(
        self,
        spec: proto.RequestSpec,
        *,
        stream: bool = False,
        body: httpx.AsyncByteStream | None = None,
        authenticate: bool = True,
    ) -> httpx.Response:
        """Send ``spec`` (see ``BrokerTransport.send``)."""
        exchange = ex.Exchange(
            self._client, self.config, self.retry, spec, body=body, authenticate=authenticate
        )
        response = await self._attempts(exchange)
        if not exchange.succeeded(response):
            raise exchange.failure(response, await self._error_body(response))
        if not stream:
            try:
                await response.aread()
            except httpx.TransportError as exc:
                raise exchange.read_error(exc) from exc
            finally:
                await response.aclose()
        return response

    async def _attempts(self, exchange: ex.Exchange) -> httpx.Response:
        """Send until an answer that is not retried (retries sleep without blocking)."""
        while True:
            request = exchange.next_request()
            try:
                response = await self._client.send(request, stream=True, auth=exchange.auth)
            except httpx.TransportError as exc:
                await self._sleep(exchange.delay_after_error(exc))
                continue
            delay = exchange.delay_after_response(response)
            if delay is None:
                return response
            await response.aclose()
            await self._sleep(delay)

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

    async def stream(
        self, spec: proto.RequestSpec, meter: ex.DownloadMeter
    ) -> AsyncGenerator[bytes, None]:
        """The answer to ``spec`` in chunks (the request is sent on first iteration)."""
        response = await self.send(spec, stream=True)
        try:
            async for chunk in response.aiter_bytes(ex.CHUNK_SIZE):
                yield meter.count(chunk)
        except httpx.TransportError as exc:
            raise meter.error(exc) from exc
        finally:
            await response.aclose()

    async def download(
        self,
        spec: proto.RequestSpec,
        meter: ex.DownloadMeter,
        write: Callable[[bytes], Awaitable[Any]],
    ) -> int:
        """Stream the answer to ``spec`` into ``await write(chunk)``; the bytes written."""
        async with contextlib.aclosing(self.stream(spec, meter)) as chunks:
            async for chunk in chunks:
                await write(chunk)
        return meter.total
