"""What the local backend needs to run a sandbox's runtime: a :class:`RuntimeLauncher`.

The local backend (:class:`._backend.LocalBackend`, the broker's :class:`.._interface.Backend`
for host processes) keeps the claims itself and has each sandbox's runtime started by a
``RuntimeLauncher``: it turns a :class:`SandboxSpec` into a running runtime server that speaks the
legacy python-runtime protocol and returns a :class:`RuntimeHandle` (host and port) once the
runtime answers ``GET /``. The default one (``_processes.LocalProcessLauncher``) starts host
processes; ``LocalBroker(backend=...)`` takes another (docs/local-broker.md).
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["RuntimeHandle", "RuntimeLauncher", "RuntimeStartError", "SandboxBackend", "SandboxSpec"]


@dataclass(frozen=True)
class SandboxSpec:
    """What to start: the claim's name, namespace, template and the runtime's settings."""

    name: str
    namespace: str
    template: str
    env: Mapping[str, str] = field(default_factory=dict)
    """Of the create's ``env``, only the built-in runtime's own settings (``RUNTIME_SETTINGS``
    of ``runtime._env``): the rest is the environment of the sandbox's commands, which the
    broker sends the runtime with each command start (``X-Sandbox-Env``), never a runtime's
    own environment (a caller's ``PYTHONPATH`` or ``LD_PRELOAD`` would decide how it runs)."""
    command: str | Sequence[str] | None = None
    """Runtime command line for this template (``None``: the backend's default)."""
    network: bool = True
    """The sandbox may use the network (its policy's ``network``); ``False``: a backend that
    cannot cut it off refuses to start the sandbox."""


@dataclass
class RuntimeHandle:
    """A running runtime: where the broker's router reaches it (``host:port``, or the Unix
    socket ``uds`` when it has one: ``host`` and ``port`` then only name it in URLs)."""

    name: str
    host: str
    port: int
    base_dir: str
    pid: int | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    root: str | None = field(default=None, repr=False)
    uds: str | None = None
    runtime_id: int | None = field(default=None, repr=False)
    """The backend's own name for this runtime, never used again (unlike ``pid``: the local
    backend's fork-server request, by which its exit is reported)."""


class RuntimeStartError(Exception):
    """The runtime did not come up: ``reason`` is a CamelCase reason, ``message`` says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class RuntimeLauncher(Protocol):
    """What the local backend needs to run runtimes (all methods run on the broker's event
    loop).

    A sandbox is bound (its runtime has an address: ``/rpc`` status shows its name) when
    :meth:`start` returns, and Ready after that; a launcher that also has an ``async def
    ready(handle)`` is awaited in between (see :data:`READY_METHOD`)."""

    async def start(self, spec: SandboxSpec) -> RuntimeHandle:
        """Start the runtime and return once it answers ``GET /``; raise RuntimeStartError."""
        ...

    async def stop(self, handle: RuntimeHandle) -> None:
        """Stop the runtime and remove everything it left behind. The local backend calls it
        once per runtime (a second deletion of a sandbox waits for the first one's stop)."""
        ...

    def is_alive(self, handle: RuntimeHandle) -> bool: ...

    async def close(self) -> None:
        """Stop every runtime this backend started."""
        ...

    def kill_all_now(self) -> None:
        """Synchronous last-resort cleanup (no event loop): kill and remove everything."""
        ...


READY_METHOD = "ready"
"""The optional method of a :class:`RuntimeLauncher` the local backend awaits between binding a
started runtime and calling its sandbox Ready: ``async def ready(self, handle: RuntimeHandle)
-> None`` (raise RuntimeStartError: the sandbox fails). A backend without it is Ready as soon
as :meth:`RuntimeLauncher.start` returns."""

SandboxBackend = RuntimeLauncher
"""The deprecated name of :class:`RuntimeLauncher` (until issue 27: "backend" is the claims
contract, :class:`.._interface.Backend`, only); ``k8s_agent_sandbox_awx.testing`` keeps
exporting it for code written against it."""
