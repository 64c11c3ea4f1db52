"""A code context: one interpreter's state across executions, and how each execution ends.

A context runs at most one execution at a time (another one is refused, ``409
context_busy``). Its interpreter (:mod:`._interpreter`) starts with its first execution after
it was created or restarted. An execution ends when the kernel says it is done; when its time
limit passes, the interpreter's process group gets ``SIGINT`` (the cell's
``KeyboardInterrupt``, reported as a ``TimeoutError``) and, if that does not end it within
``interrupt_grace`` seconds, it is killed: the context is restarted (its state is lost) and
the execution's ``end`` says so. An interpreter that ends on its own (out of memory,
``os._exit``, killed from outside) ends the running execution with a ``ContextDied`` error;
between executions its end is reported by the next one, which does not run its code. Either
way the next execution starts a new interpreter.

Standard library only.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._command import _timestamp
from ._command_requests import CommandError
from ._env import command_environment
from ._execution import Execution, result_event
from ._interpreter import Interpreter, describe_status

DEFAULT_CONTEXT = "default"
"""The id of the context ``run_code`` uses when it names none (Python, in the base directory)."""
LANGUAGES = ("python",)
"""The languages a context runs."""
MAX_VALUE_CHARS = 64 * 1024
MAX_TRACEBACK_CHARS = 1024 * 1024
STOP_WAIT_SECONDS = 10.0
"""How long a restart or removal waits for the killed interpreter's end to be reported."""
START_WAIT_SECONDS = 30.0
"""How long an interrupt waits for a starting interpreter to take its cell (the ``SIGINT`` is
sent then, and its grace starts then) before the interpreter is killed."""


@dataclass(frozen=True)
class Place:
    """Where a context's interpreter runs: its working directory (``cwd`` as the caller named
    it, ``host_cwd`` on this host) and the variables over the commands' environment."""

    cwd: str
    host_cwd: str
    envs: dict[str, str]


class Context:
    """One context: its interpreter (while it runs), the execution it runs, and what it must
    report at the next one."""

    def __init__(self, context_id: str, language: str, place: Place, grace: float) -> None:
        self.context_id = context_id
        self.language = language
        self.place = place
        self.grace = grace
        self.created_at = time.time()
        self.lock = threading.Condition()
        self.interpreter: Interpreter | None = None
        self.current: Execution | None = None
        self.execution_count = 0
        self.died: str | None = None
        """How its interpreter ended between executions (reported by the next one)."""
        self.stopping: str | None = None
        """Why its interpreter is being killed by the runtime (``restart``, ``remove``)."""
        self.ready: dict[str, Any] = {}

    # -- what the HTTP endpoints call ----------------------------------------------------------
    def begin(
        self,
        execution: Execution,
        code: str,
        envs: dict[str, str],
        sandbox_env: Mapping[str, str],
    ) -> None:
        """Run ``execution`` (``409 context_busy`` while another one runs); ``sandbox_env``:
        the sandbox's environment the start carried (:mod:`._env`), which an interpreter started
        for it gets under the context's ``envs``, as commands do."""
        interpreter = self._take(execution, sandbox_env)
        if interpreter is not None:  # sent unlocked: its reader needs the lock meanwhile
            request = {"type": "run", "id": execution.execution_id, "code": code, "envs": envs}
            interpreter.send({**request, "max_bytes": execution.limit_bytes})
            interpreter.wake()  # its reader takes the new deadline

    def _take(self, execution: Execution, sandbox_env: Mapping[str, str]) -> Interpreter | None:
        """Make ``execution`` the running one: the interpreter to send it to, ``None`` when it
        ended at once (a death to report, an interpreter that cannot start)."""
        with self.lock:
            running = self.current
            if running is not None:
                raise CommandError(
                    409,
                    f"context {self.context_id!r} is running execution "
                    f"{running.execution_id!r}; wait for it to end, interrupt it, or run "
                    "this code in another context (create_code_context)",
                    code="context_busy",
                    context_id=self.context_id,
                    execution_id=running.execution_id,
                )
            if self.died is not None:
                why, self.died = self.died, None
                self._failed(execution, "ContextDied", why, "context_died", restarted=True)
                return None
            if self.interpreter is None and not self._start(execution, sandbox_env):
                return None
            self.current = execution
            execution.deadline = time.monotonic() + execution.timeout
            return self.interpreter

    def _start(self, execution: Execution, sandbox_env: Mapping[str, str]) -> bool:
        env = command_environment(os.environ, sandbox_env, self.place.envs)
        interpreter = Interpreter(self.context_id, self.place.host_cwd, env, self)
        try:
            interpreter.start()
        except (OSError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or exc
            self._failed(
                execution,
                "ContextStartError",
                f"the interpreter of context {self.context_id!r} could not be started: {why}",
                "failed",
            )
            return False
        self.interpreter = interpreter
        self.ready = {}
        return True

    def interrupt(self, execution: Execution) -> None:
        """``SIGINT`` to the running ``execution`` (then, past the grace, its context is
        restarted); nothing to do once it ended."""
        with self.lock:
            if self.current is not execution or execution.interrupted is not None:
                return
            self._interrupt(execution, "request")

    def stop(self, why: str) -> None:
        """Kill the interpreter (``restart`` or ``remove``) and wait until its end is
        reported; what it ran ends, and nothing is reported at the next execution."""
        with self.lock:
            self.died = None
            interpreter = self.interpreter
            if interpreter is None:
                return
            self.stopping = why
            interpreter.kill()
            self.lock.wait_for(lambda: self.interpreter is not interpreter, STOP_WAIT_SECONDS)

    def summary(self) -> dict[str, Any]:
        with self.lock:
            if self.interpreter is None:
                state = "not_started"
            else:
                state = "busy" if self.current is not None else "idle"
            return {
                "id": self.context_id,
                "language": self.language,
                "cwd": self.place.cwd,
                "state": state,
                "pid": self.interpreter.pid if self.interpreter is not None else None,
                "execution_count": self.execution_count,
                "python": self.ready.get("python"),
                "formatter": self.ready.get("formatter"),
                "created_at": _timestamp(self.created_at),
            }

    # -- what its interpreter's reader calls (the Sink) ----------------------------------------
    def output(self, kind: str, text: str) -> None:
        with self.lock:
            execution = self.current
        if execution is not None:  # between executions: nobody's (a cell's leftover thread)
            execution.add({"type": kind, "data": text, "timestamp": time.time_ns()}, output=True)

    def message(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        with self.lock:
            if kind == "ready":
                self.ready = message
                return
            execution = self.current
            if execution is None or message.get("id") != execution.execution_id:
                return
            if kind == "started":
                self._started(execution)
            elif kind == "done":
                self._done(execution, message.get("execution_count"))
        if kind == "result" and isinstance(message.get("data"), dict):
            execution.add(result_event(message["data"], bool(message.get("main"))))
        elif kind == "error":
            execution.add(self._error_event(execution, message))

    def _started(self, execution: Execution) -> None:
        """The kernel has the cell: an interrupt that came before goes to it now (the caller
        holds the lock)."""
        execution.started = True
        if execution.signal_pending and self.interpreter is not None:
            execution.signal_pending = False
            execution.kill_at = time.monotonic() + self.grace  # the grace starts with the signal
            self.interpreter.signal(signal.SIGINT)

    def _done(self, execution: Execution, count: Any) -> None:
        if isinstance(count, int) and not isinstance(count, bool):
            self.execution_count = execution.execution_count = count
        state = "done"
        if execution.interrupted is not None and execution.errored:
            state = "timed_out" if execution.interrupted == "timeout" else "interrupted"
        self.current = None
        execution.end(state)

    def _error_event(self, execution: Execution, message: dict[str, Any]) -> dict[str, Any]:
        name = str(message.get("name") or "Error")
        value = str(message.get("value") or "")[:MAX_VALUE_CHARS]
        traceback = str(message.get("traceback") or "")[:MAX_TRACEBACK_CHARS]
        if execution.interrupted == "timeout" and name == "KeyboardInterrupt":
            name = "TimeoutError"
            value = (
                f"the execution ran longer than its time limit of {execution.timeout:g} s and "
                "was interrupted (SIGINT); the context keeps its state"
            )
        return {"type": "error", "name": name, "value": value, "traceback": traceback}

    def tick(self) -> float | None:
        now = time.monotonic()
        with self.lock:
            execution, interpreter = self.current, self.interpreter
            if execution is None or interpreter is None:
                return None
            if execution.kill_at is not None:
                if now < execution.kill_at:
                    return execution.kill_at - now
                execution.kill_at = None
                interpreter.kill()  # the exit is reported: the context restarts
                return None
            if now >= execution.deadline:
                self._interrupt(execution, "timeout")
                return self.grace
            return None if execution.deadline == float("inf") else execution.deadline - now

    def _interrupt(self, execution: Execution, why: str) -> None:
        """The caller holds the lock."""
        execution.interrupted = why
        assert self.interpreter is not None
        if execution.started:
            execution.kill_at = time.monotonic() + self.grace
            self.interpreter.signal(signal.SIGINT)
        else:  # the kernel has not read the cell yet: a SIGINT now would be lost
            execution.kill_at = time.monotonic() + START_WAIT_SECONDS + self.grace
            execution.signal_pending = True
        self.interpreter.wake()

    def exited(self, status: int) -> None:
        with self.lock:
            execution, self.current = self.current, None
            stopping, self.stopping = self.stopping, None
            self.interpreter = None
            self.ready = {}
            how = describe_status(status)
            if execution is not None:
                self._ended_with(execution, stopping, how)
            elif stopping is None:
                self.died = (
                    f"the interpreter of context {self.context_id!r} {how} after its last "
                    "execution (out of memory, os._exit, or killed from outside?); its state is "
                    "lost and this code was not run: run it again (a new interpreter starts), "
                    "redefining what it needs"
                )
            self.lock.notify_all()

    def _ended_with(self, execution: Execution, stopping: str | None, how: str) -> None:
        """The interpreter ended while ``execution`` ran (the caller holds the lock)."""
        if execution.interrupted == "timeout":
            self._failed(
                execution,
                "TimeoutError",
                f"the execution ran longer than its time limit of {execution.timeout:g} s and "
                f"did not stop within {self.grace:g} s of SIGINT: its context was restarted "
                "(its state is lost)",
                "timed_out",
                restarted=True,
            )
        elif execution.interrupted == "request":
            self._failed(
                execution,
                "KeyboardInterrupt",
                f"the execution was interrupted and did not stop within {self.grace:g} s of "
                "SIGINT: its context was restarted (its state is lost)",
                "interrupted",
                restarted=True,
            )
        elif stopping is not None:
            self._failed(
                execution,
                "ContextRestarted" if stopping == "restart" else "ContextRemoved",
                f"context {self.context_id!r} was {stopping}d while this execution ran",
                "interrupted",
                restarted=True,
            )
        else:
            self._failed(
                execution,
                "ContextDied",
                f"the interpreter of context {self.context_id!r} {how} during this execution "
                "(out of memory, os._exit, or killed from outside?); its state is lost: the "
                "next execution starts a new interpreter",
                "context_died",
                restarted=True,
            )

    @staticmethod
    def _failed(
        execution: Execution, name: str, value: str, state: str, *, restarted: bool = False
    ) -> None:
        execution.add({"type": "error", "name": name, "value": value, "traceback": ""})
        execution.end(state, restarted=restarted)


def kill_interpreter(context: Context) -> None:
    """SIGKILL the context's interpreter group now (the runtime is going away)."""
    interpreter = context.interpreter
    if interpreter is not None:
        interpreter.kill()
