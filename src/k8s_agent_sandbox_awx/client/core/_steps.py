"""The one vocabulary of the client's operations (no I/O): what an operation may ask for, and
:data:`Op`, the one type of an operation.

An operation (create → wait → roll back, a file operation, a command's run) is a generator of
:data:`Step`s run by the one driver (``_driver``); it receives each step's outcome, and an error
raised while a step is performed is thrown back into it:

- a :class:`~..wire._protocol.Call`: one request and how to read its answer;
- :class:`OpenEvents`: open the NDJSON event stream of ``spec`` (closing the one before); the
  request is sent when the first event is asked for;
- :class:`NextEvent`: the next value of the open stream, ``None`` when it ended cleanly;
- :class:`Emit`: hand a value to the caller (a command's output event: a callback, or an
  iterator's consumer);
- :class:`Sleep`: wait (before re-requesting a stream that failed; the exchange's pause before
  a retry is the same step);
- :class:`Learned`: what the operation found out about the sandbox's runtime (a feature it
  has or lacks), for whoever keeps that knowledge: an operation never stores it itself.

The file and control-plane operations yield only calls (``transport.run`` performs them); a
command's operations are performed by the ``commands`` shells.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..._driver import Stepper, Steps
from ..wire import _protocol as proto
from ..wire._protocol import Call

__all__ = [
    "NEXT_EVENT",
    "Call",
    "Emit",
    "Learned",
    "NextEvent",
    "Op",
    "OpenEvents",
    "Sleep",
    "Step",
    "discard_answer",
    "learning",
]

E = TypeVar("E")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class OpenEvents:
    """Open the event stream of ``spec``."""

    spec: proto.RequestSpec
    json_answer: bool = False
    """An answer not labelled ``application/x-ndjson`` is one value (a runtime that does not
    stream it)."""


@dataclass(frozen=True, slots=True)
class NextEvent:
    """The next value of the open event stream (``None``: it ended)."""


@dataclass(frozen=True, slots=True)
class Emit(Generic[E]):
    """Hand ``event`` to the caller."""

    event: E


@dataclass(frozen=True, slots=True)
class Sleep:
    """Wait ``seconds``."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Learned:
    """The sandbox's runtime has (``present``) or lacks ``feature`` (``"managed_commands"``,
    ``"file_api"``): found out from an answer."""

    feature: str
    present: bool


NEXT_EVENT = NextEvent()
"""The one :class:`NextEvent` step (it carries nothing)."""


def discard_answer(reply: proto.Reply) -> None:
    """The answer reader of a :class:`Call` whose answer says no more than its success."""
    return None


Step = Call[Any] | OpenEvents | NextEvent | Emit[Any] | Sleep | Learned
Op = Steps[Step, T]
"""An operation: yields steps, receives their outcomes, returns ``T``."""


def learning(op: Op[T], record: Callable[[Learned], None]) -> Op[T]:
    """``op`` with what it learns handed to ``record`` (the keeper of that knowledge) as soon
    as it is yielded; every other step passes through, and what ``op`` is sent or thrown
    reaches it unchanged."""
    stepper = Stepper(op)
    while (step := stepper.advance()) is not None:
        if isinstance(step, Learned):
            record(step)
            stepper.reply = None
            continue
        try:
            stepper.reply = yield step
        except BaseException as exc:  # thrown into the operation, which decides
            stepper.error = exc
    return stepper.result
