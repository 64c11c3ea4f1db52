"""``broker serve``'s answers: the head is held until the first body write and sent with it
(``server._httptools.HeadHeld``: one TLS record and one ``send`` for a small answer), and
nothing else changes: the bytes' order, a ``100 Continue`` sent at once, a head whose body does
not follow in the event loop's turn sent at its end, a close that sends what is held first."""

from __future__ import annotations

import asyncio

from k8s_agent_sandbox_awx.broker.server._httptools import HeadHeld


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 7


HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


def _held() -> tuple[HeadHeld, _Transport]:
    inner = _Transport()
    return HeadHeld(inner, asyncio.get_running_loop()), inner  # type: ignore[arg-type]


def test_a_head_and_its_body_are_one_write_then_writes_pass() -> None:
    async def main() -> None:
        held, inner = _held()
        held.write(HEAD)
        assert inner.writes == []
        held.write(b"ok")
        held.write(b"more")
        assert inner.writes == [HEAD + b"ok", b"more"]
        await asyncio.sleep(0)  # the turn's end: nothing left to send
        assert inner.writes == [HEAD + b"ok", b"more"]
        assert held.get_write_buffer_size() == 7 and not held.is_closing()

    asyncio.run(main())


def test_a_head_whose_body_does_not_follow_is_sent_at_the_turns_end() -> None:
    async def main() -> None:
        held, inner = _held()
        held.write(HEAD)
        await asyncio.sleep(0)
        assert inner.writes == [HEAD]
        held.write(b"ok")
        assert inner.writes == [HEAD, b"ok"]

    asyncio.run(main())


def test_a_100_continue_is_sent_at_once_and_the_head_after_it_held() -> None:
    async def main() -> None:
        held, inner = _held()
        held.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        assert inner.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
        held.write(HEAD)
        held.write(b"ok")
        assert inner.writes[1:] == [HEAD + b"ok"]

    asyncio.run(main())


def test_a_close_sends_the_held_head_first() -> None:
    async def main() -> None:
        held, inner = _held()
        held.write(HEAD)
        held.close()
        assert inner.writes == [HEAD] and inner.closed
        await asyncio.sleep(0)  # nothing written after the close
        assert inner.writes == [HEAD]

    asyncio.run(main())
