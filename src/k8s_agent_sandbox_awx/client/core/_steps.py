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

The file and control-plane operations yield only calls (``transport.run`` performs them); a
command's operations are performed by the ``commands`` shells.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..._driver import Steps
from ..wire import _protocol as proto
from ..wire._protocol import Call

__all__ = [
    "Call",
    "Emit",
    "NextEvent",
    "Op",
    "OpenEvents",
    "Sleep",
    "Step",
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


Step = Call[Any] | OpenEvents | NextEvent | Emit[Any] | Sleep
Op = Steps[Step, T]
"""An operation: yields steps, receives their outcomes, returns ``T``."""
