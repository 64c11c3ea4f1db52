"""``broker serve`` with a per-phase clock on its data plane, for bench_kube_hop.py.

Run: ``python bench/_timed_hop.py TIMINGS_FILE broker serve --config FILE``. Before the CLI
starts, wrappers are put around the steps of one data-plane request (nothing else changes):
the ASGI app (inside the probes), ``Forward.handle``, the token check (``Gate.authenticate``),
the sandbox's lookup (``Forward._lookup``: the claim cache, or the local registry), the rest of
the checks (``Forward._ready_sandbox`` without the lookup: owner, binding, scope, Ready), the
route (``Forward.route``), the send to the runtime until its answer's head
(``_forward._send_upstream``: a pooled connection, the request written, the runtime's own
work, the head read) and the relay of the body (``Relay.pump``).

For every data-plane request one JSON line is appended to ``TIMINGS_FILE`` (one ``write``,
after the answer's last bytes were handed to the server): ``{phase: [wall s, cpu s]}``, the
CPU being the broker thread's (``time.thread_time``): a loaded machine stretches the wall
times, hardly the CPU times. The benchmark never uses this in production configurations.
"""

from __future__ import annotations

import contextvars
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

from k8s_agent_sandbox_awx.broker.common import _gate
from k8s_agent_sandbox_awx.broker.dataplane import _forward, _relay
from k8s_agent_sandbox_awx.broker.server import _probes, _run
from k8s_agent_sandbox_awx.cli import _cli

_fd = -1
_marks: contextvars.ContextVar[dict[str, tuple[float, float, float, float]] | None] = (
    contextvars.ContextVar("marks", default=None)
)
_clock = time.perf_counter
_cpu = time.thread_time


def _mark(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def timed(*args: Any, **kwargs: Any) -> Any:
        marks = _marks.get()
        if marks is None:
            return await method(*args, **kwargs)
        w, c = _clock(), _cpu()
        try:
            return await method(*args, **kwargs)
        finally:
            marks[name] = (w, c, _clock(), _cpu())

    return timed


def _span(marks: dict[str, tuple[float, float, float, float]], a: str, b: str) -> list[float]:
    """Wall and CPU from the end of step ``a`` (``a^``: its start) to the start of ``b``
    (``b$``: its end)."""
    wa, ca = marks[a[:-1]][0:2] if a.endswith("^") else marks[a][2:4]
    wb, cb = marks[b[:-1]][2:4] if b.endswith("$") else marks[b][0:2]
    return [wb - wa, cb - ca]


PHASES = {
    "ASGI app -> the forward (probes, access log, routing)": ("app^", "handle"),
    "token check (verified-token memo, claim rules)": ("authenticate^", "authenticate$"),
    "sandbox lookup (claim cache / registry)": ("lookup^", "lookup$"),
    "owner, binding, scope and Ready checks": ("lookup", "ready$"),
    "route (the backend's address and client)": ("route^", "route$"),
    "request built (headers, URL, body)": ("route", "send"),
    "send -> answer's head (pooled connection, the runtime's own work)": ("send^", "send$"),
    "head checks, response start (and a whole body)": ("send", "pump"),
    "body relayed (when not whole)": ("pump^", "pump$"),
    "answer closed": ("pump", "handle$"),
    "the forward -> ASGI app's end (access log, metrics)": ("handle", "app$"),
}


def _emit(marks: dict[str, tuple[float, float, float, float]]) -> None:
    if not {"app", "handle", "authenticate", "lookup", "ready", "route", "send"} <= set(marks):
        return  # refused before the forward: not a forwarded request
    if "pump" not in marks:  # a whole body sent with no relay: "response start" has it all
        end = marks["handle"][2:4]
        marks["pump"] = (*end, *end)
    line = {name: _span(marks, a, b) for name, (a, b) in PHASES.items()}
    line["total in the ASGI app"] = _span(marks, "app^", "app$")
    os.write(_fd, (json.dumps(line) + "\n").encode())


def _timed_app(app: _probes.ASGIApp) -> _probes.ASGIApp:
    async def timed(scope: _probes.Scope, receive: _probes.Receive, send: _probes.Send) -> None:
        if scope["type"] != "http" or not any(k == b"x-sandbox-id" for k, _ in scope["headers"]):
            await app(scope, receive, send)
            return
        marks: dict[str, tuple[float, float, float, float]] = {}
        token = _marks.set(marks)
        w, c = _clock(), _cpu()
        try:
            await app(scope, receive, send)
        finally:
            marks["app"] = (w, c, _clock(), _cpu())
            _marks.reset(token)
            _emit(marks)

    return timed


def _install() -> None:
    def timed_probes(
        app: _probes.ASGIApp,
        ready: _probes.ReadinessCheck | None = None,
        degraded: _probes.ReadinessCheck | None = None,
    ) -> _probes.ASGIApp:
        return _probes.with_probes(_timed_app(app), ready, degraded)

    patches = [
        mock.patch.object(_forward.Forward, "handle", _mark("handle", _forward.Forward.handle)),
        mock.patch.object(
            _gate.Gate, "authenticate", _mark("authenticate", _gate.Gate.authenticate)
        ),
        mock.patch.object(_forward.Forward, "_lookup", _mark("lookup", _forward.Forward._lookup)),
        mock.patch.object(
            _forward.Forward, "_ready_sandbox", _mark("ready", _forward.Forward._ready_sandbox)
        ),
        mock.patch.object(_forward.Forward, "route", _mark("route", _forward.Forward.route)),
        mock.patch.object(_forward, "_send_upstream", _mark("send", _forward._send_upstream)),
        mock.patch.object(_relay.Relay, "pump", _mark("pump", _relay.Relay.pump)),
        mock.patch.object(_run, "with_probes", timed_probes),
    ]
    for patch in patches:  # for the process's life (never stopped)
        patch.start()


def _profiled(into: str) -> None:
    """``BENCH_PROFILE=FILE``: the event loop's thread under cProfile, its stats written to
    FILE.PID at exit (for finding where a phase's CPU goes; the timings are then inflated)."""
    import atexit
    import cProfile

    profile = cProfile.Profile()
    profile.enable()

    def written() -> None:
        profile.disable()
        profile.dump_stats(f"{into}.{os.getpid()}")

    atexit.register(written)


if __name__ == "__main__":
    _fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    _install()
    if os.environ.get("BENCH_PROFILE"):
        _profiled(os.environ["BENCH_PROFILE"])
    sys.exit(_cli.main(sys.argv[2:]))
