"""The one driver of step-by-step computations (no I/O of its own).

A computation is a generator that yields what it needs done (a request to send, a credential
to fetch, a pause) and receives the outcome; an exception raised while a step is performed
(a broker error, Ctrl-C, an ``asyncio`` cancellation) is thrown back into it, so its cleanup
decisions (delete the claim a failed create made) live with it. :func:`drive` performs the steps
with a sync function, :func:`adrive` with a coroutine function; both use one :class:`Stepper`.
Used by the operations (``_flow``, ``_command_ops``), the exchange (``_exchange``) and
credential discovery (``_chain``). :func:`iterate`/:func:`aiterate` drive a computation whose
``emitted`` steps are values for the caller: they are yielded (a command's output events).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from typing import Any, Generic, TypeVar

__all__ = ["Stepper", "Steps", "adrive", "aiterate", "drive", "iterate"]

S = TypeVar("S")
E = TypeVar("E")
T = TypeVar("T")
Steps = Generator[S, Any, T]


class Stepper(Generic[S, T]):
    """Advances a computation: set ``reply`` or ``error`` with the outcome of the last step,
    then :meth:`advance` returns the next step, or ``None`` when ``result`` is set."""

    __slots__ = ("_steps", "error", "reply", "result")

    def __init__(self, steps: Steps[S, T]) -> None:
        self._steps = steps
        self.reply: Any = None
        self.error: BaseException | None = None
        self.result: T

    def advance(self) -> S | None:
        error, self.error = self.error, None
        try:
            if error is not None:
                return self._steps.throw(error)
            return self._steps.send(self.reply)
        except StopIteration as stop:
            self.result = stop.value
            return None


def drive(steps: Steps[S, T], perform: Callable[[S], Any]) -> T:
    """Run ``steps`` synchronously; ``perform`` does one step."""
    stepper = Stepper(steps)
    while (step := stepper.advance()) is not None:
        try:
            stepper.reply = perform(step)
        except BaseException as exc:  # thrown into the computation, which decides
            stepper.error = exc
    return stepper.result


async def adrive(steps: Steps[S, T], perform: Callable[[S], Awaitable[Any]]) -> T:
    """Run ``steps`` on the event loop; ``perform`` does one step."""
    stepper = Stepper(steps)
    while (step := stepper.advance()) is not None:
        try:
            stepper.reply = await perform(step)
        except BaseException as exc:  # thrown into the computation, which decides
            stepper.error = exc
    return stepper.result


def iterate(
    steps: Steps[Any, T], perform: Callable[[Any], Any], emitted: type[E]
) -> Generator[E, None, T]:
    """Run ``steps`` synchronously, yielding the steps of type ``emitted`` to the caller instead
    of performing them (closing the iterator abandons the computation)."""
    stepper = Stepper(steps)
    while (step := stepper.advance()) is not None:
        if isinstance(step, emitted):
            yield step
            stepper.reply = None
            continue
        try:
            stepper.reply = perform(step)
        except BaseException as exc:  # thrown into the computation, which decides
            stepper.error = exc
    return stepper.result


async def aiterate(
    steps: Steps[Any, Any], perform: Callable[[Any], Awaitable[Any]], emitted: type[E]
) -> AsyncGenerator[E, None]:
    """:func:`iterate` on the event loop."""
    stepper = Stepper(steps)
    while (step := stepper.advance()) is not None:
        if isinstance(step, emitted):
            yield step
            stepper.reply = None
            continue
        try:
            stepper.reply = await perform(step)
        except BaseException as exc:  # thrown into the computation, which decides
            stepper.error = exc
