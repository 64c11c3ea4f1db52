"""``run_code`` in the local runtime: code contexts and their executions, and the ``/code`` API.

The wire protocol (docs/broker-api.md, "Code"; openapi.json):

- ``POST /code/execute`` ``{"code", "context_id"?, "language"?, "timeout"?, "envs"?,
  "request_id"?}`` -> ``{"execution_id", "context_id"}``; with ``Accept:
  application/x-ndjson`` that line, then the execution's events (:mod:`._execution`) until its
  ``end`` or ``max_duration`` (20 s). ``"timeout": "none"``: no time limit. A repeated
  ``request_id`` answers the same execution.
- ``GET /code/executions`` (``?request_id=R``: the one its start carried, or none),
  ``GET /code/executions/{id}``, ``GET /code/executions/{id}/events?after=SEQ&duration=S``,
  ``POST /code/executions/{id}/interrupt`` (``SIGINT``; the context is restarted if that does
  not end it within the grace time).
- ``POST /code/contexts`` ``{"language"?, "cwd"?, "envs"?}``, ``GET /code/contexts``,
  ``GET /code/contexts/{id}``, ``POST /code/contexts/{id}/restart``, ``POST
  /code/contexts/{id}/remove``.

The context ``default`` (Python in the base directory) always exists; at most
``max_contexts`` exist in all (``429 too_many_contexts``). Each context's interpreter is a
process of its own (:mod:`._interpreter`), started by its first execution: it ends with the
runtime (its process group is killed at exit), when the context is restarted or removed, and
after a time limit its ``SIGINT`` did not enforce (:mod:`._context`). Refusals are
``{"detail", "code"?}``; the codes are :data:`ERROR_CODES`. Standard library only.
"""

from __future__ import annotations

import math
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._command import positive_number
from ._command_requests import (
    CommandError,
    check_text,
    checked_envs,
    query_number,
    request_id_query,
    sandbox_env_of,
    working_directory,
)
from ._context import (
    DEFAULT_CONTEXT,
    LANGUAGES,
    START_WAIT_SECONDS,
    STOP_WAIT_SECONDS,
    Context,
    Place,
)
from ._context import kill_interpreter as _kill_interpreter
from ._execution import Execution, StreamSettings, stream
from ._http import Exchange, read_json, send_json

ERROR_CODES = {
    "context_not_found": 404,
    "execution_not_found": 404,
    "context_busy": 409,
    "too_many_contexts": 429,
    "unsupported_language": 400,
}
"""The refusals of the ``/code`` API with a code, and their HTTP status."""
NO_TIME_LIMIT = "none"
RETAINED_EXECUTIONS = 16
"""Ended executions kept (their events, for a stream that resumes), besides running ones."""
_EXECUTE_FIELDS = frozenset({"code", "context_id", "language", "timeout", "envs", "request_id"})
_CONTEXT_FIELDS = frozenset({"language", "cwd", "envs"})


@dataclass(frozen=True)
class CodeLimits:
    """The runtime's limits for code contexts (see :meth:`from_environ` for the variables)."""

    max_contexts: int = 8
    output_bytes: int = 8 * 1024 * 1024
    interrupt_grace: float = 3.0
    default_timeout: float = 300.0
    max_timeout: float = 300.0
    retention_seconds: float = 900.0
    heartbeat_seconds: float = 2.0
    max_duration: float = 20.0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], max_timeout: float) -> CodeLimits:
        """``SANDBOX_CODE_MAX_CONTEXTS``, ``SANDBOX_CODE_OUTPUT_LIMIT_BYTES``,
        ``SANDBOX_CODE_INTERRUPT_GRACE_SECONDS``; the time limit's cap is the commands'
        (``SANDBOX_EXEC_TIMEOUT_SECONDS``). A bad value is a ``ValueError``."""

        def number(name: str, default: float, kind: type[int] | type[float]) -> Any:
            return positive_number(environ, name, default, kind)

        return cls(
            max_contexts=number("SANDBOX_CODE_MAX_CONTEXTS", cls.max_contexts, int),
            output_bytes=number("SANDBOX_CODE_OUTPUT_LIMIT_BYTES", cls.output_bytes, int),
            interrupt_grace=number(
                "SANDBOX_CODE_INTERRUPT_GRACE_SECONDS", cls.interrupt_grace, float
            ),
            default_timeout=min(cls.default_timeout, max_timeout),
            max_timeout=max_timeout,
            heartbeat_seconds=number(
                "SANDBOX_COMMAND_HEARTBEAT_SECONDS", cls.heartbeat_seconds, float
            ),
        )


_MANAGERS: list[CodeManager] = []


def kill_all() -> None:
    """Kill every context's interpreter (the runtime is going away)."""
    for manager in list(_MANAGERS):
        with manager.lock:
            contexts = list(manager.contexts.values())
        for context in contexts:
            _kill_interpreter(context)


class CodeManager:
    """The code contexts and executions of one runtime (one sandbox)."""

    def __init__(self, base_dir: str, limits: CodeLimits) -> None:
        self.base_dir = base_dir
        self.limits = limits
        self.lock = threading.Lock()
        self.contexts: dict[str, Context] = {}
        self.executions: dict[str, Execution] = {}
        self.by_request: dict[str, str] = {}
        self._context(DEFAULT_CONTEXT, LANGUAGES[0], Place("/app", base_dir, {}))
        _MANAGERS.append(self)

    def _context(self, context_id: str, language: str, place: Place) -> Context:
        context = Context(context_id, language, place, self.limits.interrupt_grace)
        self.contexts[context_id] = context
        return context

    # -- HTTP routing --------------------------------------------------------------------------
    def handle(self, exchange: Exchange, method: str) -> None:
        """Answer one request whose path is under ``/code/``."""
        split = urllib.parse.urlsplit(exchange.path)
        parts = split.path.split("/")[2:]  # "", "code", ...
        query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
        try:
            body = _body(exchange) if method == "POST" else {}
            route = _ROUTES.get((method, parts[0], len(parts)))
            if route is None or (len(parts) == 3 and parts[2] not in _ACTIONS[parts[0]]):
                raise CommandError(404, f"no route for {method} {split.path}")
            route(self, exchange, parts[1:], body, query)
        except CommandError as exc:
            send_json(exchange, exc.status, exc.body)

    # -- executions ----------------------------------------------------------------------------
    def execute(
        self, exchange: Exchange, parts: list[str], body: dict[str, Any], query: Any
    ) -> None:
        sandbox_env = sandbox_env_of(exchange)
        execution, code, envs, new = self._register(body)
        context = self._get_context(execution.context_id)
        if new:
            try:
                context.begin(execution, code, envs, sandbox_env)
            except CommandError:
                self._forget(execution)
                raise
        started = {"execution_id": execution.execution_id, "context_id": execution.context_id}
        if "application/x-ndjson" not in (exchange.headers.get("Accept") or ""):
            send_json(exchange, 200, started)
            return
        stream(exchange, execution, 0, self._stream_settings(self.limits.max_duration), started)

    def _register(self, body: dict[str, Any]) -> tuple[Execution, str, dict[str, str], bool]:
        """The execution ``body`` asks for, registered (or the one its ``request_id`` started
        before: then ``False``), its code and envs."""
        request = _execute_request(body, self.limits)
        with self.lock:
            self._sweep()
            request_id = request["request_id"]
            if request_id is not None and request_id in self.by_request:
                existing = self.executions[self.by_request[request_id]]
                if existing.request != request:
                    raise CommandError(
                        409,
                        f"request_id {request_id!r} was already used for other code; use a "
                        "new request id for a new execution",
                    )
                return existing, request["code"], request["envs"], False
            context_id = request["context_id"] or DEFAULT_CONTEXT
            context = self.contexts.get(context_id)
            if context is None:
                raise _no_context(context_id)
            if request["language"] not in (None, context.language):
                raise CommandError(
                    400,
                    f"context {context_id!r} runs {context.language}, not "
                    f"{request['language']}; leave language out, or run the code in a "
                    f"{request['language']} context",
                )
            execution = Execution(
                execution_id=str(uuid.uuid4()),
                context_id=context_id,
                request_id=request_id,
                request=request,
                timeout=request["timeout"],
                limit_bytes=self.limits.output_bytes,
            )
            self.executions[execution.execution_id] = execution
            if request_id is not None:
                self.by_request[request_id] = execution.execution_id
        return execution, request["code"], request["envs"], True

    def _sweep(self) -> None:
        """Forget ended executions past the retention time or beyond the most kept (the
        caller holds the lock)."""
        horizon = time.time() - self.limits.retention_seconds
        ended = [e for e in self.executions.values() if e.ended_at is not None]
        ended.sort(key=lambda e: e.ended_at or 0.0)
        for index, execution in enumerate(ended):
            if (execution.ended_at or 0.0) < horizon or index < len(ended) - RETAINED_EXECUTIONS:
                self._forget_locked(execution)

    def _forget(self, execution: Execution) -> None:
        with self.lock:
            self._forget_locked(execution)

    def _forget_locked(self, execution: Execution) -> None:
        self.executions.pop(execution.execution_id, None)
        if execution.request_id is not None:
            self.by_request.pop(execution.request_id, None)

    def _get_execution(self, execution_id: str) -> Execution:
        with self.lock:
            execution = self.executions.get(execution_id)
        if execution is None:
            raise CommandError(
                404,
                f"no execution {execution_id!r} in this sandbox (ended executions are kept "
                f"{self.limits.retention_seconds:g} s, at most {RETAINED_EXECUTIONS})",
                code="execution_not_found",
            )
        return execution

    def list_executions(
        self, exchange: Exchange, parts: list[str], body: dict[str, Any], query: Any
    ) -> None:
        request_id = request_id_query(query)
        with self.lock:
            self._sweep()
            if request_id is None:
                found = sorted(self.executions.values(), key=lambda e: e.started_at)
            else:
                one = self.executions.get(self.by_request.get(request_id, ""))
                found = [one] if one is not None else []
        send_json(exchange, 200, {"executions": [e.summary() for e in found]})

    def execution_status(
        self, exchange: Exchange, parts: list[str], body: dict[str, Any], query: Any
    ) -> None:
        send_json(exchange, 200, self._get_execution(parts[0]).summary())

    def events(
        self, exchange: Exchange, parts: list[str], body: dict[str, Any], query: Any
    ) -> None:
        execution = self._get_execution(parts[0])
        after = query_number(query, "after", 0, int)
        duration = query_number(query, "duration", self.limits.max_duration, float)
        if not 0 <= after <= execution.last_seq:
            raise CommandError(
                400,
                f"query 'after'={after} must be from 0 to the last event's seq "
                f"({execution.last_seq})",
                last_seq=execution.last_seq,
            )
        if not 0 <= duration <= self.limits.max_duration:
            raise CommandError(
                400,
                f"query 'duration' must be a number of seconds from 0 to "
                f"{self.limits.max_duration:g}",
            )
        stream(exchange, execution, after, self._stream_settings(duration))

    def interrupt(
        self, exchange: Exchange, parts: list[str], body: dict[str, Any], query: Any
    ) -> None:
        """``SIGINT`` to a running execution; answers once it ended (at most the grace time
        and the restart later), with its summary."""
        execution = self._get_execution(parts[0])
        starting = not execution.started  # the signal waits for the interpreter to take the cell
        self._get_context(execution.context_id).interrupt(execution)
        wait = self.limits.interrupt_grace + STOP_WAIT_SECONDS
        with execution.cond:
            execution.cond.wait_for(
                lambda: execution.ended, wait + (START_WAIT_SECONDS if starting else 0.0)
            )
        send_json(exchange, 200, execution.summary())

    def _stream_settings(self, duration: float) -> StreamSettings:
        return StreamSettings(duration, self.limits.heartbeat_seconds)

    # -- contexts ------------------------------------------------------------------------------
    def _get_context(self, context_id: str) -> Context:
        with self.lock:
            context = self.contexts.get(context_id)
        if context is None:
            raise _no_context(context_id)
        return context

    def create_context(
        self, exchange: Exchange, parts: list[str], body: dict[str, Any], query: Any
    ) -> None:
        _unknown(body, _CONTEXT_FIELDS)
        language = _language(body.get("language"))
        cwd = body.get("cwd")
        place = Place(
            cwd if isinstance(cwd, str) else "/app",
            working_directory(cwd, self.base_dir),
            checked_envs(body.get("envs") or {}),
        )
        with self.lock:
            if len(self.contexts) >= self.limits.max_contexts:
                raise CommandError(
                    429,
                    f"too many code contexts: this sandbox has at most "
                    f"{self.limits.max_contexts} (the default one included; "
                    "SANDBOX_CODE_MAX_CONTEXTS); remove one (remove_code_context) or run "
                    "the code in an existing one",
                    code="too_many_contexts",
                    limit=self.limits.max_contexts,
                )
            context = self._context(str(uuid.uuid4()), language, place)
        send_json(exchange, 200, context.summary())

    def list_contexts(
        self, exchange: Exchange, parts: list[str], body: dict[str, Any], query: Any
    ) -> None:
        with self.lock:
            contexts = sorted(self.contexts.values(), key=lambda c: c.created_at)
        send_json(exchange, 200, {"contexts": [c.summary() for c in contexts]})

    def context_status(
        self, exchange: Exchange, parts: list[str], body: dict[str, Any], query: Any
    ) -> None:
        send_json(exchange, 200, self._get_context(parts[0]).summary())

    def context_action(
        self, exchange: Exchange, parts: list[str], body: dict[str, Any], query: Any
    ) -> None:
        """``restart`` (a new interpreter at the next execution) or ``remove`` (the default
        context is restarted: it always exists)."""
        context = self._get_context(parts[0])
        action = parts[1]
        context.stop(action if context.context_id != DEFAULT_CONTEXT else "restart")
        if action == "restart" or context.context_id == DEFAULT_CONTEXT:
            send_json(exchange, 200, context.summary())
            return
        with self.lock:
            self.contexts.pop(context.context_id, None)
        send_json(exchange, 200, {"id": context.context_id, "removed": True})


Route = Callable[[CodeManager, Exchange, list[str], dict[str, Any], Any], None]
_ROUTES: dict[tuple[str, str, int], Route] = {
    ("POST", "execute", 1): CodeManager.execute,
    ("GET", "executions", 1): CodeManager.list_executions,
    ("GET", "executions", 2): CodeManager.execution_status,
    ("GET", "executions", 3): CodeManager.events,
    ("POST", "executions", 3): CodeManager.interrupt,
    ("POST", "contexts", 1): CodeManager.create_context,
    ("GET", "contexts", 1): CodeManager.list_contexts,
    ("GET", "contexts", 2): CodeManager.context_status,
    ("POST", "contexts", 3): CodeManager.context_action,
}
"""The routes by method, the path's segment after ``/code/`` and the number of segments."""
_ACTIONS = {"executions": ("events", "interrupt"), "contexts": ("restart", "remove")}
"""What may follow an id (``GET`` events, ``POST`` interrupt / restart / remove)."""


def _body(exchange: Exchange) -> dict[str, Any]:
    try:
        body = read_json(exchange)
    except (ValueError, ConnectionError) as exc:
        exchange.close_connection = True
        raise CommandError(400, f"the body must be a JSON object: {exc}") from None
    if not isinstance(body, dict):
        raise CommandError(400, "the body must be a JSON object")
    return body


def _unknown(body: dict[str, Any], fields: frozenset[str]) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise CommandError(400, f"unknown field(s) {unknown}: the fields are {sorted(fields)}")


def _language(language: Any) -> str:
    if language is None:
        return LANGUAGES[0]
    if language not in LANGUAGES:
        raise CommandError(
            400,
            f"field 'language': {language!r} is not a language this runtime runs "
            f"({', '.join(LANGUAGES)}); run other languages with commands.run",
            code="unsupported_language",
        )
    return str(language)


def _execute_request(body: dict[str, Any], limits: CodeLimits) -> dict[str, Any]:
    """``POST /code/execute``'s body, checked field by field."""
    _unknown(body, _EXECUTE_FIELDS)
    code = body.get("code")
    if not isinstance(code, str):
        raise CommandError(400, "field 'code' must be a string (the code to run)")
    check_text("code", code)
    context_id = body.get("context_id")
    if context_id is not None and (not isinstance(context_id, str) or not context_id):
        raise CommandError(400, "field 'context_id' must be a context's id")
    request_id = body.get("request_id")
    if request_id is not None and (
        not isinstance(request_id, str) or not 0 < len(request_id) <= 255
    ):
        raise CommandError(400, "field 'request_id' must be a string of 1 to 255 characters")
    language = body.get("language")
    return {
        "code": code,
        "context_id": context_id,
        "language": None if language is None else _language(language),
        "timeout": _timeout(body.get("timeout"), limits),
        "envs": checked_envs(body.get("envs") or {}),
        "request_id": request_id,
    }


def _timeout(timeout: Any, limits: CodeLimits) -> float:
    if timeout is None:
        return limits.default_timeout
    if timeout == NO_TIME_LIMIT:
        return math.inf
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout <= limits.max_timeout
    ):
        raise CommandError(
            400,
            f"field 'timeout' must be a number of seconds above 0 and at most "
            f"{limits.max_timeout:g} (this runtime's SANDBOX_EXEC_TIMEOUT_SECONDS), or "
            f"{NO_TIME_LIMIT!r} for no time limit",
        )
    return float(timeout)


def _no_context(context_id: str) -> CommandError:
    return CommandError(
        404,
        f"no code context {context_id!r} in this sandbox (removed, or never created here); "
        "list them with list_code_contexts, or create one with create_code_context",
        code="context_not_found",
        context_id=context_id,
    )
