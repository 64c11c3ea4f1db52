"""List-and-watch with a local store, and a work queue: the stand-in controller's plumbing.

``Informer`` keeps a store of one collection (all namespaces or one) as client-go's informers
do: it lists, then watches from the list's ``resourceVersion`` and applies each event to the
store before calling the handler with ``(type, object, previous)``. When the watch ends (the
server's ``timeoutSeconds``) it resumes from the last ``resourceVersion`` it saw; a ``410``
(an ``ERROR`` event with code 410, as 1.20 sends for a too-old version, e.g. after the API
server restarted) or a broken connection (the server went away) makes it list again, and the
difference between the store and the new list is delivered as events, so that an object deleted
while the watch was down still arrives as ``DELETED``. ``stop()`` is bounded: it shuts the
watch's socket down, which ends the blocking read at once.

``WorkQueue`` is a small workqueue: keys are deduplicated, delayed adds keep the earliest due
time, a key being processed is not handed out twice (an add meanwhile runs it again after).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import httpx

from tests._support.kube import KubeError

log = logging.getLogger("tests.standin")

Key = tuple[Any, ...]
"""A work queue key: ``(kind of work, *its arguments)``."""
Handler = Callable[[str, dict[str, Any], dict[str, Any] | None], None]
"""``(event type, object, the stored object it replaces or None)``."""

WATCH_SECONDS = 30
_BACKOFF_MAX = 1.0


def store_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    metadata = obj.get("metadata") or {}
    return str(metadata.get("namespace", "")), str(metadata["name"])


class Informer:
    """List, watch, keep a store, deliver events; see the module docstring."""

    def __init__(
        self,
        name: str,
        client: Callable[[], httpx.Client],
        path: str,
        handler: Handler,
        *,
        on_relist: Callable[[], None] | None = None,
    ) -> None:
        self.name, self.path = name, path
        self._client_factory, self._handler, self._on_relist = client, handler, on_relist
        self._store: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.synced = threading.Event()
        self._response: httpx.Response | None = None
        self._resume_from: str | None = None
        self._force_version: str | None = None
        self.relists = 0
        self._thread = threading.Thread(target=self._run, name=f"informer-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._interrupt()
        self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._store.values())

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._store.get((namespace, name))

    def expire(self) -> None:
        """Resume the watch from ``resourceVersion`` 1, far older than the server's window:
        the server answers 410 Gone and the informer lists again (the real path)."""
        self._force_version = "1"
        self._interrupt()

    def _interrupt(self) -> None:
        response = self._response
        if response is None:
            return
        with contextlib.suppress(Exception):
            stream = response.extensions["network_stream"]
            stream.get_extra_info("socket").shutdown(socket.SHUT_RDWR)

    # ---------------------------------------------------------------------- the loop

    def _run(self) -> None:
        backoff = 0.05
        with self._client_factory() as client:
            while not self._stopping.is_set():
                try:
                    if self._resume_from is None:
                        self._relist(client)
                    self._watch(client)
                    backoff = 0.05
                except (httpx.HTTPError, KubeError, OSError, ValueError) as exc:
                    if self._stopping.is_set():
                        return
                    if self._force_version is not None:  # expire() broke the watch on purpose
                        continue
                    log.info("informer %s: %s; listing again in %.2f s", self.name, exc, backoff)
                    self._resume_from = None
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX)

    def _relist(self, client: httpx.Client) -> None:
        response = client.get(self.path)
        if response.is_error:
            raise KubeError("LIST", self.path, response)
        body = response.json()
        fresh = {store_key(item): item for item in body.get("items") or []}
        with self._lock:
            previous, self._store = self._store, dict(fresh)
        for key, old in previous.items():
            if key not in fresh:
                self._deliver("DELETED", old, old)
        for key, obj in fresh.items():
            stored = previous.get(key)
            if stored is None:
                self._deliver("ADDED", obj, None)
            elif stored["metadata"].get("resourceVersion") != obj["metadata"]["resourceVersion"]:
                self._deliver("MODIFIED", obj, stored)
        self._resume_from = str(body["metadata"]["resourceVersion"])
        self.relists += 1
        self.synced.set()
        if self._on_relist is not None:
            self._on_relist()

    def _watch(self, client: httpx.Client) -> None:
        version = self._force_version or self._resume_from
        self._force_version = None
        params = {
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
            "resourceVersion": str(version),
        }
        with client.stream("GET", self.path, params=params, timeout=WATCH_SECONDS + 15) as r:
            if r.is_error:
                r.read()
                raise KubeError("WATCH", self.path, r)
            self._response = r
            if self._stopping.is_set() or self._force_version is not None:
                self._response = None
                return  # stop() or expire() came before the socket could be shut down
            try:
                for event in _events(r.iter_lines()):
                    if self._stopping.is_set() or not self._apply(event):
                        return
            finally:
                self._response = None

    def _apply(self, event: dict[str, Any]) -> bool:
        """Apply one event; False when the watch must end (410: list again)."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                log.info("informer %s: %s; listing again", self.name, obj.get("message"))
                self._resume_from = None
                return False
            raise ValueError(f"watch error on {self.path}: {obj}")
        self._resume_from = str(obj["metadata"]["resourceVersion"])
        if kind == "BOOKMARK":
            return True
        key = store_key(obj)
        with self._lock:
            old = self._store.get(key)
            if kind == "DELETED":
                self._store.pop(key, None)
            else:
                self._store[key] = obj
        self._deliver(str(kind), obj, old)
        return True

    def _deliver(self, kind: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        try:
            self._handler(kind, obj, old)
        except Exception:  # a handler's bug must not stop the watch
            log.exception("informer %s: the handler failed on %s", self.name, kind)


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.strip():
            yield json.loads(line)


class WorkQueue:
    """Deduplicated keys, delayed adds, one hand-out per key at a time (see the module
    docstring). ``get(allowed)`` hands out the first ready key ``allowed`` accepts."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._ready: list[Key] = []
        self._queued: set[Key] = set()
        self._delayed: list[tuple[float, int, Key]] = []
        self._due: dict[Key, float] = {}
        self._processing: set[Key] = set()
        self._again: set[Key] = set()
        self._seq = itertools.count()
        self._closed = False

    def add(self, key: Key, after: float = 0.0) -> None:
        with self._cv:
            if after > 0:
                due = time.monotonic() + after
                if key in self._queued or self._due.get(key, float("inf")) <= due:
                    return
                self._due[key] = due
                heapq.heappush(self._delayed, (due, next(self._seq), key))
            elif key in self._processing:
                self._again.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._ready.append(key)
            self._cv.notify_all()

    def get(self, allowed: Callable[[Key], bool], timeout: float) -> Key | None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._closed:
                self._promote()
                for index, key in enumerate(self._ready):
                    if allowed(key):
                        del self._ready[index]
                        self._queued.discard(key)
                        self._processing.add(key)
                        return key
                wait = deadline - time.monotonic()
                if self._delayed:
                    wait = min(wait, self._delayed[0][0] - time.monotonic())
                if deadline <= time.monotonic():
                    return None
                self._cv.wait(max(wait, 0.001))
            return None

    def _promote(self) -> None:
        now = time.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            due, _, key = heapq.heappop(self._delayed)
            if self._due.get(key) != due:
                continue  # superseded by an earlier one
            del self._due[key]
            if key in self._processing:
                self._again.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._ready.append(key)

    def done(self, key: Key) -> None:
        with self._cv:
            self._processing.discard(key)
            if key in self._again:
                self._again.discard(key)
                if key not in self._queued:
                    self._queued.add(key)
                    self._ready.append(key)
            self._cv.notify_all()

    def idle(self) -> bool:
        with self._cv:
            return not self._ready and not self._processing

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
