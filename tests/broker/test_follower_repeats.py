"""A reader that never moves its cursor cannot hold a command (the review of issue 19 item 2:
a raw client that read every stream to its end and asked for ``after=0`` again pinned the live
window at 0, and backpressure then stopped the command for as long as it did so).

The runtime's follower bookkeeping (``_command.Command.follow``/``unfollow``), in this process:
a reader may come back with the cursor its previous stream continued from (that stream's
events were lost on the way) twice in a row and still hold the command; the next such request
does not hold (it neither makes the command wait nor pins the window beyond its bound: what it
then loses is the usual 410). Moving the cursor, or a stream that sent nothing, starts over.
The end-to-end case: tests/broker/test_command_abuse.py; honest readers that are cut:
tests/broker/test_managed_commands.py (overlapping followers lose nothing).
"""

from __future__ import annotations

from k8s_agent_sandbox_awx.broker.runtime import _command as _cmd

GRACE = _cmd.FOLLOWER_GRACE_SECONDS


def _command() -> _cmd.Command:
    return _cmd.Command(
        command_id="c1",
        request_id=None,
        request={},
        argv=["true"],
        cwd="/",
        timeout=60.0,
        stdin_requested=False,
        started_at=0.0,
    )


def _streams(command: _cmd.Command, ranges: list[tuple[int, int]]) -> list[bool]:
    """Whether each stream holds, for streams continuing from ``after`` that were sent up to
    ``sent`` (one after the other: each ends before the next request)."""
    holds = []
    with command.cond:  # as the runtime calls them
        for after, sent in ranges:
            follower = command.follow(after)
            holds.append(follower.holds)
            follower.cursor = sent
            command.unfollow(follower, GRACE)
    return holds


def test_a_reader_that_never_moves_its_cursor_stops_holding() -> None:
    assert _cmd.REPEATS_THAT_HOLD == 2
    assert _streams(_command(), [(0, 10)] * 5) == [True, True, True, False, False]


def test_moving_the_cursor_starts_over() -> None:
    command = _command()
    assert _streams(command, [(0, 10), (0, 10), (0, 10), (10, 20)]) == [True] * 4
    assert _streams(command, [(10, 20), (10, 20), (10, 20)]) == [True, True, False]


def test_a_stream_that_sent_nothing_is_no_repeat() -> None:
    """An idle command: every stream ends with heartbeats only, the cursor stays."""
    assert _streams(_command(), [(7, 7)] * 6) == [True] * 6


def test_a_follower_that_does_not_hold_never_makes_the_command_wait() -> None:
    limits = _cmd.Limits(output_bytes=10, window_bytes=100, unacked_bytes=1000)
    command = _command()
    _streams(command, [(0, 1)] * 3)
    with command.cond:
        replaying = command.follow(0)  # the fourth from 0: it reads, never acknowledges
        assert not replaying.holds
        for _ in range(200):  # 2,000 bytes of output it was not sent
            command.append("stdout", "x" * 10, 10, limits)
        assert not command.evict(limits)  # no backpressure
    assert command.window_size <= limits.window_bytes + limits.unacked_bytes
