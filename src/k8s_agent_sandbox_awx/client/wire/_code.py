"""``run_code`` on the wire: the runtime's ``/code`` requests, their answers, and the values
users get (no I/O).

The requests (docs/broker-api.md, "Code") go to the sandbox's runtime behind the broker like
every data-plane request (:mod:`._dataplane`: the dialect's routing headers, the broker's
``commands`` scope). The values are E2B's code interpreter's, by name and meaning:
:class:`Execution` (``results``, ``logs``, ``error``, ``execution_count``, ``text``),
:class:`Result` (``text``, ``html``, ``png``, ... of one value shown), :class:`Logs`,
:class:`ExecutionError` (``name``, ``value``, ``traceback``), :class:`OutputMessage` (what the
output callbacks get) and :class:`CodeContext` (E2B's ``Context``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from ...errors import BrokerError, UnsupportedByRuntimeError
from ._commands_wire import (
    EVENTS_DURATION,
    EVENTS_READ_MARGIN,
    LEGACY_NOT_FOUND,
    LOOKUP_TIMEOUT,
    STREAMED_START_ACCEPT,
)
from ._dataplane import DataTarget, data_request
from ._protocol import RequestSpec, json_body, protocol_error

__all__ = [
    "RESULT_FORMATS",
    "CodeContext",
    "Execution",
    "ExecutionError",
    "Logs",
    "OutputMessage",
    "Result",
]

RUN_CODE = "run_code"
"""The feature ``/code`` is (what :class:`UnsupportedByRuntimeError` names)."""
RESULT_FORMATS = (
    "text",
    "html",
    "markdown",
    "svg",
    "png",
    "jpeg",
    "pdf",
    "latex",
    "json",
    "javascript",
)
"""The representations a :class:`Result` may carry (``png``, ``jpeg``, ``pdf``: base64)."""
_PROTOCOL = "the runtime's code protocol"


class OutputMessage(str):
    """One chunk of a running execution's output, as ``on_stdout``/``on_stderr`` get it: the
    text itself (a ``str``: ``print`` it, concatenate it), with E2B's ``line`` (the same text),
    ``timestamp`` (nanoseconds since the epoch, when the runtime read it) and ``error``
    (``True`` on stderr)."""

    timestamp: int
    error: bool

    def __new__(cls, line: str, timestamp: int = 0, error: bool = False) -> OutputMessage:
        message = super().__new__(cls, line)
        message.timestamp = timestamp
        message.error = error
        return message

    @property
    def line(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"OutputMessage({str(self)!r}, timestamp={self.timestamp}, error={self.error})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (OutputMessage, (str(self), self.timestamp, self.error))


@dataclass(frozen=True)
class ExecutionError:
    """The exception the code raised: its class ``name`` (``"NameError"``), ``value`` (its
    message) and ``traceback`` (as Python prints it, the cell's frames only). Also the
    runtime's own ends of an execution: ``TimeoutError`` (its time limit passed),
    ``ContextDied`` (the interpreter ended: its state is lost), ``ContextRestarted``,
    ``ContextRemoved``, ``ContextStartError``."""

    name: str
    value: str
    traceback: str

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "value": self.value, "traceback": self.traceback})


@dataclass(frozen=True, repr=False)
class Result:
    """One value the code showed: the value of its last expression (``is_main_result``), each
    ``display(obj)``, each matplotlib figure. ``text`` is its ``repr`` (IPython's, where the
    sandbox has IPython); the others are set where the value offers them (the display
    protocol: ``_repr_html_``, ``_repr_png_``, ...; ``png``, ``jpeg`` and ``pdf`` base64).
    ``extra``: other MIME types; ``dropped``: representations left out for the runtime's
    output limit."""

    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = None
    jpeg: str | None = None
    pdf: str | None = None
    latex: str | None = None
    json: Any = None
    javascript: str | None = None
    is_main_result: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()

    def formats(self) -> list[str]:
        """The representations it has (``["text", "png"]``), then its ``extra`` types."""
        return [name for name in RESULT_FORMATS if getattr(self, name) is not None] + list(
            self.extra
        )

    def __repr__(self) -> str:
        if self.text is not None:
            return f"Result({self.text!r}, formats={self.formats()})"
        return f"Result(formats={self.formats()})"

    def to_dict(self) -> dict[str, Any]:
        """Its representations as a dict (``is_main_result`` included), for JSON."""
        out: dict[str, Any] = {
            name: getattr(self, name) for name in RESULT_FORMATS if getattr(self, name) is not None
        }
        if self.extra:
            out["extra"] = dict(self.extra)
        out["is_main_result"] = self.is_main_result
        return out


@dataclass(frozen=True)
class Logs:
    """What the code printed: ``stdout`` and ``stderr`` as the chunks they arrived in (E2B's
    lists of strings; ``"".join(logs.stdout)`` is the whole output)."""

    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Execution:
    """What ``run_code`` returns. An exception in the code is its ``error``, not an exception
    of the SDK. ``results``: the values shown (:class:`Result`), ``text``: the main result's
    text; ``logs``: the output; ``execution_count``: the context's count of executions.
    ``timed_out``: the time limit passed (``error`` says how it ended); ``restarted``: the
    context's interpreter was restarted, so its state is lost; ``output_truncated``: output
    beyond the runtime's limit was left out."""

    results: list[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: ExecutionError | None = None
    execution_count: int | None = None
    execution_id: str | None = None
    context_id: str | None = None
    timed_out: bool = False
    restarted: bool = False
    output_truncated: bool = False

    @property
    def text(self) -> str | None:
        """The text of the main result (the value of the code's last expression), if any."""
        for result in self.results:
            if result.is_main_result:
                return result.text
        return None

    def to_json(self) -> str:
        """The execution as JSON: its results, logs and error."""
        return json.dumps(
            {
                "results": [result.to_dict() for result in self.results],
                "logs": {"stdout": self.logs.stdout, "stderr": self.logs.stderr},
                "error": None if self.error is None else json.loads(self.error.to_json()),
                "execution_count": self.execution_count,
            }
        )


@dataclass(frozen=True)
class CodeContext:
    """A code context: an interpreter's state of its own (E2B's ``Context``). ``id`` names it
    (``"default"``: the context ``run_code`` uses without one); ``state`` is
    ``not_started`` (its interpreter starts with its first execution), ``idle`` or ``busy``."""

    id: str
    language: str
    cwd: str
    state: str = "not_started"
    execution_count: int = 0
    pid: int | None = None
    """The interpreter's process id as the sandbox sees it (``None`` before it started)."""


# --------------------------------------------------------------------------------------------
# Requests


def _path(kind: str, ident: str, tail: str = "") -> str:
    if not isinstance(ident, str) or not ident or len(ident) > 255:
        raise ValueError(f"A {kind} id must be a non-empty string, got {ident!r}.")
    return f"/code/{kind}s/{quote(ident, safe='')}{tail}"


def execute(target: DataTarget, body: Mapping[str, Any]) -> RequestSpec:
    """``POST /code/execute``, the streamed start (never retried: code must not run twice;
    ``body`` carries a fresh ``request_id``)."""
    spec = data_request(
        "POST",
        "/code/execute",
        "run code",
        target,
        headers={"Accept": STREAMED_START_ACCEPT},
        read_timeout=EVENTS_DURATION + EVENTS_READ_MARGIN,
        retryable=False,
    )
    return json_body(spec, dict(body))


def execution_events(
    target: DataTarget, execution_id: str, after: int, duration: float = EVENTS_DURATION
) -> RequestSpec:
    """``GET /code/executions/{id}/events``: the events after ``after`` for ``duration`` s."""
    return data_request(
        "GET",
        _path("execution", execution_id, "/events"),
        f"follow execution {execution_id!r}",
        target,
        params={"after": str(after), "duration": f"{duration:.3f}".rstrip("0").rstrip(".")},
        read_timeout=duration + EVENTS_READ_MARGIN,
    )


def find_execution(target: DataTarget, request_id: str) -> RequestSpec:
    """``GET /code/executions?request_id=``: the execution a start with ``request_id`` began
    (one short attempt: the cleanup of an interrupted start)."""
    return data_request(
        "GET",
        "/code/executions",
        f"find the execution started with request_id {request_id!r}",
        target,
        params={"request_id": request_id},
        retryable=False,
        read_timeout=LOOKUP_TIMEOUT,
    )


def interrupt_execution(target: DataTarget, execution_id: str) -> RequestSpec:
    """``POST /code/executions/{id}/interrupt`` (safe to repeat: an ended one stays ended)."""
    path = _path("execution", execution_id, "/interrupt")
    return data_request("POST", path, f"interrupt execution {execution_id!r}", target)


def create_context(target: DataTarget, body: Mapping[str, Any]) -> RequestSpec:
    spec = data_request("POST", "/code/contexts", "create a code context", target)
    return json_body(spec, dict(body))


def list_contexts(target: DataTarget) -> RequestSpec:
    return data_request("GET", "/code/contexts", "list the code contexts", target)


def context_action(target: DataTarget, context_id: str, action: str) -> RequestSpec:
    """``POST /code/contexts/{id}/restart`` or ``/remove`` (retried: repeating either one
    leaves the context as one would)."""
    path = _path("context", context_id, f"/{action}")
    spec = data_request(
        "POST", path, f"{action} code context {context_id!r}", target, retryable=True
    )
    return json_body(spec, {})


# --------------------------------------------------------------------------------------------
# Answers


def parse_started(obj: Any) -> tuple[str, str]:
    """``(execution_id, context_id)`` of a start's first line."""
    if isinstance(obj, dict):
        execution_id, context_id = obj.get("execution_id"), obj.get("context_id")
        if isinstance(execution_id, str) and execution_id and isinstance(context_id, str):
            return execution_id, context_id
    raise protocol_error("run code", "the answer has no execution_id", _PROTOCOL)


def parse_context(obj: Any, what: str = "read a code context") -> CodeContext:
    try:
        if not isinstance(obj, dict):
            raise TypeError("not a JSON object")
        pid = obj.get("pid")
        return CodeContext(
            id=str(obj["id"]),
            language=str(obj.get("language") or "python"),
            cwd=str(obj.get("cwd") or ""),
            state=str(obj.get("state") or "not_started"),
            execution_count=int(obj.get("execution_count") or 0),
            pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise protocol_error(what, f"bad code context ({exc!r})", _PROTOCOL) from exc


def parse_context_list(obj: Any) -> list[CodeContext]:
    what = "list the code contexts"
    items = obj.get("contexts") if isinstance(obj, dict) else None
    if not isinstance(items, list):
        raise protocol_error(what, 'expected {"contexts": [...]}', _PROTOCOL)
    return [parse_context(item, what) for item in items]


def parse_execution_ids(obj: Any, request_id: str) -> list[tuple[str, str]]:
    """``(execution_id, state)`` of the listed executions whose start carried ``request_id``."""
    items = obj.get("executions") if isinstance(obj, dict) else None
    if not isinstance(items, list):
        raise protocol_error("find an execution", 'expected {"executions": [...]}', _PROTOCOL)
    return [
        (str(item.get("execution_id")), str(item.get("state")))
        for item in items
        if isinstance(item, dict) and item.get("request_id") == request_id
    ]


def result_of(event: Mapping[str, Any]) -> Result:
    """A ``result`` event as a :class:`Result`."""
    values = {name: event[name] for name in RESULT_FORMATS if event.get(name) is not None}
    for name in RESULT_FORMATS:
        if name != "json" and name in values and not isinstance(values[name], str):
            values[name] = str(values[name])
    extra = event.get("extra")
    dropped = event.get("dropped")
    return Result(
        **values,
        is_main_result=event.get("is_main_result") is True,
        extra=dict(extra) if isinstance(extra, dict) else {},
        dropped=tuple(str(d) for d in dropped) if isinstance(dropped, list) else (),
    )


def error_of(event: Mapping[str, Any]) -> ExecutionError:
    return ExecutionError(
        name=str(event.get("name") or "Error"),
        value=str(event.get("value") or ""),
        traceback=str(event.get("traceback") or ""),
    )


# --------------------------------------------------------------------------------------------
# Refusals


def lacks_code(exc: BaseException) -> bool:
    """The answer of a runtime without ``/code``: a ``404`` without a broker code whose detail
    is the upstream python runtime's (FastAPI's ``Not Found``) or an older local runtime's
    (``no route for ...``)."""
    if not isinstance(exc, BrokerError) or exc.status_code != 404 or exc.code is not None:
        return False
    detail = exc.detail or ""
    return detail == LEGACY_NOT_FOUND or detail.startswith("no route for ")


def unsupported(target: DataTarget, operation: str) -> UnsupportedByRuntimeError:
    return UnsupportedByRuntimeError(
        f"{operation} cannot run in sandbox {target.sandbox_id!r}: its runtime has no code "
        "contexts (/code answered 404: upstream's python runtime, an older runtime, or a "
        "deployed /rpc broker's runtime). run_code needs the local broker's runtime or its "
        'image (deploy/runtime; see broker-api.md, "Code"). Nothing was run. Run Python '
        'with sandbox.commands.run("python3 -c ...") there (no state is kept between '
        "commands), or recreate the sandbox from a template whose runtime is up to date.",
        options=(RUN_CODE,),
    )


def refusal(target: DataTarget, operation: str) -> Callable[[Exception], Exception | None]:
    """The ``fail`` of a ``/code`` request: a runtime without it is
    :class:`UnsupportedByRuntimeError` naming ``operation``."""

    def fail(exc: Exception) -> Exception | None:
        return unsupported(target, operation) if lacks_code(exc) else None

    return fail
