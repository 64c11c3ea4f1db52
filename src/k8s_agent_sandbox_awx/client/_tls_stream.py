"""A TLS connection one thread may read while another writes: the port forward's upstream.

An :class:`ssl.SSLSocket` must not be read in one thread while another thread writes to it:
CPython releases the GIL around ``SSL_read`` and ``SSL_write``, so both run at once on one
OpenSSL connection object, which is not thread-safe (the forwarder crashed so, once). Here the
TLS state is an :class:`ssl.SSLObject` over two memory buffers (:class:`ssl.MemoryBIO`), used
only under a lock and never while waiting for the network; the socket's reads and writes happen
outside that lock. So a reader waiting for the peer never holds up a writer, and a writer held
up by a peer that stops reading never holds up the reader (the peer may be waiting for that
reader to read: an echo does); the write's time limit (``SO_SNDTIMEO``, set on
:attr:`TlsStream.raw`) cuts a connection whose peer never reads again.

The bytes the TLS layer produces leave in the order it produced them: whoever sends takes them
from the outgoing buffer under a second lock (``_sending``) and keeps sending until the buffer
is empty, and looks again after it lets go of the lock, so nothing that a thread which did not
wait for the lock put in is left behind (a reader answering the peer never waits for it).
"""

from __future__ import annotations

import socket
import ssl
import threading
import time

__all__ = ["TlsStream"]

_CHUNK = 64 * 1024


class TlsStream:
    """TLS over the connected socket ``raw`` (its handshake done by :meth:`handshake`), with
    the socket methods the forwarder uses: ``recv``, ``sendall``, ``shutdown``, ``close``.

    ``recv`` returns ``b""`` at the end of the stream (the peer's ``close_notify``, or the
    connection closed without one, as :class:`ssl.SSLSocket` does by default); a broken
    stream raises :class:`ssl.SSLError` or :class:`OSError`."""

    def __init__(self, raw: socket.socket, context: ssl.SSLContext, server_hostname: str) -> None:
        self.raw = raw
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(
            self._incoming, self._outgoing, server_hostname=server_hostname
        )
        self._state = threading.Lock()  # the SSLObject and both buffers
        self._sending = threading.Lock()  # the socket's writes, in the buffer's order

    def handshake(self, seconds: float) -> None:
        """Complete the TLS handshake within ``seconds`` in all (one deadline, not one per read:
        a peer that trickles its handshake is cut off then, :class:`TimeoutError`)."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                with self._state:
                    self._tls.do_handshake()
            except ssl.SSLWantReadError:
                self._until(deadline)
                self._flush()
                self._until(deadline)
                if not self._fill():
                    raise ConnectionError("the broker closed the connection during TLS") from None
                continue
            self._until(deadline)
            self._flush()
            return

    def _until(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the TLS handshake with the broker did not complete in time")
        self.raw.settimeout(left)

    def recv(self, size: int, /) -> bytes:
        """At most ``size`` bytes of plaintext, waiting for the peer if none is buffered."""
        while True:
            with self._state:
                before = self._outgoing.pending
                try:
                    data: bytes | None = self._tls.read(size)
                except ssl.SSLWantReadError:
                    data = None
                except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                    data = b""
                answered = self._outgoing.pending > before
            if answered:  # reading made TLS output (a key update's answer): it goes out now,
                self._flush(wait=False)  # or with the writer's bytes if a write is under way
            if data is not None:
                return data
            self._fill()  # at the end, the next read says so (write_eof)

    def sendall(self, data: bytes, /) -> None:
        """Encrypt all of ``data`` and send it (blocking while the peer does not read)."""
        view = memoryview(data)
        for start in range(0, len(view), _CHUNK):
            with self._state:
                self._tls.write(view[start : start + _CHUNK])
            self._flush()

    def _fill(self) -> bool:
        """Read from the socket into the incoming buffer; ``False`` at its end."""
        chunk = self.raw.recv(_CHUNK)
        with self._state:
            if chunk:
                self._incoming.write(chunk)
            else:
                self._incoming.write_eof()
        return bool(chunk)

    def _flush(self, *, wait: bool = True) -> None:
        """Send everything in the outgoing buffer. ``wait=False``: unless another thread is
        sending (it sends this too: a sender looks at the buffer again after it stops), so a
        reader is never held by a write that a peer which stops reading holds up."""
        while self._sending.acquire(blocking=wait):
            try:
                while True:
                    with self._state:
                        data = self._outgoing.read()
                    if not data:
                        break
                    self.raw.sendall(data)
            finally:
                self._sending.release()
            with self._state:  # what a thread that did not wait put in meanwhile
                if not self._outgoing.pending:
                    return
            wait = False

    def shutdown(self, how: int, /) -> None:
        """Shut the socket down (no ``close_notify``: the forwarder ends both directions)."""
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()

    def __repr__(self) -> str:
        return f"TlsStream({self.raw!r})"
