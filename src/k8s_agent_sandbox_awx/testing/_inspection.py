"""``LocalBroker.inspect``: what the local broker holds, read for a test's assertions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..broker.backends.local._backend import LocalBackend
from ..broker.control._v1 import sandbox_json


class Inspection:
    """The broker's state, read-only, for assertions: ``broker.inspect``.

    The SandboxClaims it created (``claims``), its live sandboxes as the API shows them
    (``sandboxes``), and per sandbox how many commands reached its runtime
    (``execution_count``) and its runtime's pid (``runtime_pid``). Every method that takes a
    sandbox name also takes an ``/rpc`` claim name (``sandbox_name`` maps one to the other).
    Usable while the broker runs; thread-safe.
    """

    def __init__(self, store: Callable[[], LocalBackend]) -> None:
        self._store = store  # the running broker's local backend (RuntimeError when stopped)

    def __repr__(self) -> str:
        return "Inspection()"

    def claims(self, *, include_deleted: bool = False) -> list[dict[str, Any]]:
        """The SandboxClaim manifests the broker created (live ones; all with include_deleted)."""
        store = self._store()
        with store.lock:
            store.prune_deleted()
            records = list(store.history) if include_deleted else list(store.sandboxes.values())
        return [r.manifest() for r in records]

    def sandboxes(self) -> list[dict[str, Any]]:
        """Every live sandbox as the API returns it (all owners)."""
        store = self._store()
        with store.lock:
            return [sandbox_json(r.state()) for r in store.sandboxes.values()]

    def sandbox_name(self, name: str) -> str:
        """The sandbox ``name`` names: under ``/rpc`` the client's ``Sandbox.name`` is the
        claim name create returned (``broker-…``), which this maps to the sandbox bound to it;
        any other name is returned as it is. Every method of the broker's parts that takes a
        sandbox name (or ``sandbox=``) accepts either."""
        store = self._store()
        with store.lock:
            store.prune_deleted()
            bound = next((r.name for r in store.history if r.claim_name == name), None)
        return bound or name

    def execution_count(self, name: str) -> int:
        """How many command-running requests (``POST /execute``, ``POST /commands``, ``POST
        /code/execute``) the broker forwarded to sandbox ``name``: refused ones count too, as
        they reached the runtime."""
        store = self._store()
        name = self.sandbox_name(name)
        with store.lock:
            store.prune_deleted()
            record = store.sandboxes.get(name) or next(
                (r for r in store.history if r.name == name), None
            )
        if record is None:
            raise KeyError(f"no sandbox named {name!r}")
        return record.executions

    def runtime_pid(self, name: str) -> int | None:
        """The pid of sandbox ``name``'s runtime process (``None`` before it started)."""
        store = self._store()
        name = self.sandbox_name(name)
        with store.lock:
            record = store.sandboxes.get(name)
        return record.handle.pid if record is not None and record.handle is not None else None
