"""The program a code context's interpreter runs: it executes cells, one at a time, and keeps
their state (``sandbox.run_code``; docs/broker-api.md, "Code").

It is not imported by the runtime: :mod:`._interpreter` runs this file's source text in the
sandbox's own Python (``python3 -c SOURCE agent-sandbox-code-context ID FD``, started as managed
commands are, with their user, working directory and environment), so that what the user
installed there (``pip install matplotlib``) is what the cells import. It speaks JSON lines
over the socket ``FD``, one of a pair the runtime holds the other end of:

- to the runtime, once: ``{"type": "ready", "pid", "python", "formatter"}``;
- from the runtime: ``{"type": "run", "id", "code", "envs", "max_bytes"}``, a cell;
- to the runtime, per cell: ``{"type": "started", "id"}`` once it has it (the runtime sends
  its interrupts from then on), ``{"type": "result", "id", "main", "data": {MIME: value}}`` (the
  value of the last expression, each ``display(obj)`` and each matplotlib figure),
  ``{"type": "error", "id", "name", "value", "traceback"}``, then
  ``{"type": "done", "id", "execution_count"}``.

What the cell prints goes to the process's own stdout and stderr (file descriptors 1 and 2: a
line when it ends, a partial line within 50 ms), which the runtime reads: a subprocess's output
is the cell's too. ``SIGINT``
raises ``KeyboardInterrupt`` in a running cell only (the runtime's interrupt; one that comes
after ``started``, before the cell's code runs, raises when it starts); between cells it is
ignored. Formatting follows IPython's display protocol (``_repr_html_``, ``_repr_png_``,
``_repr_mimebundle_``, ...): with IPython installed in the sandbox, its ``DisplayFormatter``
(and ``IPython.display.display`` shows here); without it, the same methods read by the
standard library. Standard library only; it runs on Python 3.8 and later.
"""

from __future__ import annotations

import ast
import base64
import builtins
import contextlib
import importlib
import io
import json
import linecache
import os
import platform
import signal
import socket
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable
from typing import Any

ARGV_MARKER = "agent-sandbox-code-context"
"""The argument before the context's id: the interpreter's command line names its context."""
KERNEL_FILE = (lambda: None).__code__.co_filename
"""The file name of this program's own frames (``<string>``: run with ``-c``): left out of
tracebacks."""

_REPR_METHODS = (
    ("text/html", "_repr_html_"),
    ("text/markdown", "_repr_markdown_"),
    ("image/svg+xml", "_repr_svg_"),
    ("image/png", "_repr_png_"),
    ("image/jpeg", "_repr_jpeg_"),
    ("application/pdf", "_repr_pdf_"),
    ("text/latex", "_repr_latex_"),
    ("application/json", "_repr_json_"),
    ("application/javascript", "_repr_javascript_"),
)
"""The display protocol's methods and the MIME type of what each returns."""
_BINARY = ("image/png", "image/jpeg", "application/pdf")
"""MIME types whose values travel base64-encoded (bytes from a ``_repr_*_``)."""


class _State:
    in_cell = False
    """Whether user code runs now: only then does ``SIGINT`` raise ``KeyboardInterrupt``."""
    armed = False
    """Whether a cell was received and said ``started`` (its code may not run yet)."""
    pending = False
    """A ``SIGINT`` came for the received cell before its code ran: it raises when it starts."""


def _on_sigint(signum: int, frame: Any) -> None:
    if _State.in_cell:
        raise KeyboardInterrupt
    if _State.armed:
        _State.pending = True  # never raised here: this program may be writing a message


class Channel:
    """The JSON lines to and from the runtime over the socket at ``fd``."""

    def __init__(self, fd: int) -> None:
        self._sock = socket.socket(fileno=fd)
        self._reader = self._sock.makefile("rb")
        self._lock = threading.Lock()  # display() may be called from a cell's own threads

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":"), default=repr).encode() + b"\n"
        with self._lock:
            self._sock.sendall(data)

    def receive(self) -> dict[str, Any] | None:
        """The next request, ``None`` once the runtime closed its end."""
        while True:
            line = self._reader.readline()
            if not line:
                return None
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                return message


def _standard_format(obj: Any) -> dict[str, Any]:
    """The display protocol read without IPython: ``_repr_mimebundle_``, then each
    ``_repr_*_`` method, and ``repr`` as ``text/plain``."""
    data: dict[str, Any] = {}
    if not isinstance(obj, type):  # a class's _repr_*_ are functions, not its display
        bundle = _call(obj, "_repr_mimebundle_", include=None, exclude=None)
        if isinstance(bundle, tuple) and bundle:
            bundle = bundle[0]
        if isinstance(bundle, dict):
            data.update(bundle)
        for mime, name in _REPR_METHODS:
            if mime not in data:
                value = _call(obj, name)
                if isinstance(value, tuple) and value:
                    value = value[0]  # (data, metadata)
                if value is not None:
                    data[mime] = value
    if "text/plain" not in data:
        data["text/plain"] = repr(obj)
    return data


def _call(obj: Any, name: str, **kwargs: Any) -> Any:
    """``obj.name(**kwargs)``, or ``None`` when it has no such method or it fails (a broken
    representation is left out, as IPython leaves it out)."""
    try:
        method = getattr(obj, name, None)
        return method(**kwargs) if callable(method) else None
    except Exception:
        return None


def _ipython_formatter() -> Callable[[Any], dict[str, Any]] | None:
    """IPython's ``DisplayFormatter`` when the sandbox has IPython, else ``None``."""
    try:
        formatters = importlib.import_module("IPython.core.formatters")
        formatter = formatters.DisplayFormatter()
    except Exception:
        return None

    def format_with_ipython(obj: Any) -> dict[str, Any]:
        data, _metadata = formatter.format(obj)
        return dict(data)

    return format_with_ipython


class Formatter:
    """How values become display bundles: IPython's formatter once it is imported (in a
    thread of its own from the start, as importing IPython takes a good part of a second and
    a cell that shows nothing need not wait for it), else the standard library's reading of
    the display protocol. ``on_ready`` is called with its kind once it is known."""

    def __init__(
        self, display: Callable[..., None], on_ready: Callable[[str], None] | None = None
    ) -> None:
        self._ready = threading.Event()
        self._ipython: Callable[[Any], dict[str, Any]] | None = None
        self._display = display
        self._on_ready = on_ready
        threading.Thread(target=self._load, name="formatter", daemon=True).start()

    def _load(self) -> None:
        try:
            with warnings.catch_warnings():  # IPython's deprecations are not the cell's
                warnings.simplefilter("ignore")
                self._ipython = _ipython_formatter()
                if self._ipython is not None:
                    _patch_ipython_display(self._display)
        finally:
            self._ready.set()
        if self._on_ready is not None:
            self._on_ready(self.kind)

    @property
    def kind(self) -> str:
        """``ipython`` or ``standard`` (known once the import of IPython was tried)."""
        self._ready.wait()
        return "ipython" if self._ipython is not None else "standard"

    def wait(self) -> None:
        self._ready.wait()

    def __call__(self, obj: Any) -> dict[str, Any]:
        self._ready.wait()
        if _is_figure(obj):
            return _figure_bundle(obj)
        return self._ipython(obj) if self._ipython is not None else _standard_format(obj)


def _is_figure(obj: Any) -> bool:
    kind = type(obj)
    return kind.__name__ == "Figure" and kind.__module__.startswith("matplotlib")


def _figure_bundle(figure: Any) -> dict[str, Any]:
    """A matplotlib figure as a PNG (what IPython's inline backend shows)."""
    out = io.BytesIO()
    figure.savefig(out, format="png", bbox_inches="tight")
    return {"text/plain": repr(figure), "image/png": out.getvalue()}


def _clean(data: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """``data`` as JSON can carry it (bytes base64-encoded), without the representations that
    would make it larger than ``max_bytes`` (their MIME types are listed in ``_dropped``)."""
    out: dict[str, Any] = {}
    dropped: list[str] = []
    size = 0
    for mime, value in data.items():
        if isinstance(value, (bytes, bytearray)):
            value = base64.b64encode(bytes(value)).decode("ascii")
        elif mime in _BINARY and isinstance(value, str):
            value = value.strip()  # already base64 (IPython.display.Image(..., embed=True))
        try:
            length = len(json.dumps(value))
        except (TypeError, ValueError):
            value, length = repr(value), len(repr(value))
        if size + length > max_bytes and mime != "text/plain":
            dropped.append(mime)
            continue
        out[mime] = value if mime != "text/plain" else str(value)[:max_bytes]
        size += length
    if dropped:
        out["_dropped"] = dropped
    return out


class Shell:
    """The cells' namespace (a ``__main__`` module of its own) and how a cell runs."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.count = 0
        self.main = types.ModuleType("__main__")
        self.main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = self.main  # pickle finds the cells' classes
        self.request: dict[str, Any] = {}
        self.shown: list[Any] = []
        """The figures the running cell showed (held: an id could be a later figure's)."""
        builtins.display = self.display  # type: ignore[attr-defined]  # IPython's builtin
        self.formatter = Formatter(self.display, self._ready)
        self.flusher = _Flusher()
        sys.meta_path.insert(0, _PyplotHook(self.show_figures))

    def _ready(self, formatter: str) -> None:
        ready = {"type": "ready", "pid": os.getpid(), "python": platform.python_version()}
        self.channel.send({**ready, "formatter": formatter})

    def format(self, obj: Any) -> dict[str, Any]:
        if _is_figure(obj):
            self.shown.append(obj)
        return self.formatter(obj)

    def display(self, *objs: Any, **_options: Any) -> None:
        """``display(obj, ...)``: each object as a result of the running cell."""
        for obj in objs:
            self._result(obj, main=False)

    def _result(self, obj: Any, *, main: bool) -> None:
        data = _clean(self.format(obj), int(self.request.get("max_bytes") or 2**24))
        self.channel.send(
            {"type": "result", "id": self.request.get("id"), "main": main, "data": data}
        )

    def show_figures(self, *_args: Any, **_kwargs: Any) -> None:
        """``pyplot.show()``, and the end of each cell: the open figures as results (those the
        cell displayed already left out), then closed."""
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is None:
            return
        try:
            figures = [pyplot.figure(num) for num in pyplot.get_fignums()]
        except Exception:
            return
        for figure in figures:
            if not any(figure is shown for shown in self.shown):
                self._result(figure, main=False)
        with contextlib.suppress(Exception):
            pyplot.close("all")

    def run(self, request: dict[str, Any]) -> None:
        """Run one cell, report what it showed and raised, then ``done``."""
        self.count += 1
        self.request, self.shown = request, []
        _State.armed, _State.pending = True, False
        self.channel.send({"type": "started", "id": request.get("id")})  # SIGINT may come now
        envs = request.get("envs") or {}
        saved = {name: os.environ.get(name) for name in envs}
        try:
            os.environ.update(envs)
            self._execute(str(request.get("code") or ""))
            self.show_figures()
        except BaseException as exc:  # the display of a result failed, or was interrupted
            self._error(exc)
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            _flush()
            _State.armed = _State.pending = False
        self.channel.send({"type": "done", "id": request.get("id"), "execution_count": self.count})

    def _execute(self, code: str) -> None:
        if "IPython" in code:
            self.formatter.wait()  # its display is patched before the cell imports it
        filename = f"<cell {self.count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        try:
            tree = ast.parse(code, filename, "exec")
        except SyntaxError as exc:  # the cell's line, not the compiler's frames
            self._error(exc.with_traceback(None))
            return
        last: ast.Expression | None = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
            last = ast.Expression(tree.body.pop().value)  # type: ignore[attr-defined]
        namespace = self.main.__dict__
        try:
            body = compile(tree, filename, "exec", dont_inherit=True)
            tail = None if last is None else compile(last, filename, "eval", dont_inherit=True)
            _State.in_cell = True
            self.flusher.running.set()
            try:
                if _State.pending:
                    raise KeyboardInterrupt  # interrupted before its code ran
                exec(body, namespace)  # noqa: S102 - the cell: the caller's own code
                value = None if tail is None else eval(tail, namespace)  # noqa: S307
            finally:
                _State.in_cell = False
                self.flusher.running.clear()
        except BaseException as exc:  # the cell's error is a result (SystemExit too)
            self._error(exc)
            return
        if value is not None:
            namespace["_"] = value
            self._result(value, main=True)

    def _error(self, exc: BaseException) -> None:
        self.channel.send(
            {
                "type": "error",
                "id": self.request.get("id"),
                "name": type(exc).__name__,
                "value": str(exc),
                "traceback": "".join(_own_frames_left_out(exc).format()),
            }
        )


def _own_frames_left_out(exc: BaseException) -> traceback.TracebackException:
    """``exc``'s traceback without this program's frames (and those of the exceptions it
    was raised from): the cell's own, as IPython shows them."""
    shown = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    seen: set[int] = set()
    pending = [shown]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        frames = [frame for frame in current.stack if frame.filename != KERNEL_FILE]
        current.stack = traceback.StackSummary.from_list(frames)
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
    return shown


def _patch_ipython_display(display: Callable[..., None]) -> None:
    """``IPython.display.display`` (and where IPython defines it) shows here: IPython's own
    needs a running IPython shell, which this is not."""
    for name in ("IPython.core.display_functions", "IPython.display"):
        with contextlib.suppress(Exception):
            module = importlib.import_module(name)
            if hasattr(module, "display"):
                module.display = display  # type: ignore[attr-defined]


class _PyplotHook:
    """An import hook: once ``matplotlib.pyplot`` is imported, its ``show`` hands the figures
    to the cell (a sandbox has no screen: showing a figure is returning it)."""

    def __init__(self, show: Callable[..., None]) -> None:
        self._show = show

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "matplotlib.pyplot":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self._show)
                return spec
        return None


class _PatchingLoader:
    def __init__(self, loader: Any, show: Callable[..., None]) -> None:
        self._loader = loader
        self._show = show

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        module.show = self._show


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


FLUSH_SECONDS = 0.05
"""How long a line the cell has not ended yet (``print(".", end="")``) waits before it is
sent: a line is sent as one piece when it ends, a partial one within this time."""


def _line_buffered(fd: int) -> io.TextIOWrapper:
    """A text stream on ``fd`` that sends each line when it ends (UTF-8, backslash escapes for
    what UTF-8 cannot carry); :class:`_Flusher` sends a partial line soon after."""
    raw = io.FileIO(fd, "wb", closefd=False)
    return io.TextIOWrapper(
        io.BufferedWriter(raw), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )


class _Flusher:
    """While a cell runs, flushes its output streams every :data:`FLUSH_SECONDS` (what it
    printed without a newline is live too)."""

    def __init__(self) -> None:
        self.running = threading.Event()
        threading.Thread(target=self._run, name="flusher", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.running.wait()
            time.sleep(FLUSH_SECONDS)
            _flush()


def main(argv: list[str]) -> int:
    """Serve the runtime on the socket whose number is the last argument."""
    fd = int(argv[-1])
    os.set_inheritable(fd, False)  # what a cell starts (os.system) never holds the socket
    sys.argv = [""]
    sys.stdout = sys.__stdout__ = _line_buffered(1)  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = _line_buffered(2)  # type: ignore[misc]
    signal.signal(signal.SIGINT, _on_sigint)
    channel = Channel(fd)
    shell = Shell(channel)
    while True:
        request = channel.receive()
        if request is None:
            return 0
        if request.get("type") == "run":
            shell.run(request)


if __name__ == "__main__":
    if sys.path and sys.path[0] == "":
        sys.path[0] = os.getcwd()  # the cells import from their working directory, as in Jupyter
    sys.exit(main(sys.argv))
