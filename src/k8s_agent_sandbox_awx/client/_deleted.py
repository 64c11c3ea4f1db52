"""The sandboxes this process deleted (issue 30): ``Sandbox.kill(name)`` on the class deletes
through a client of its own, so the readers of the same process that follow a background
command or a terminal of that sandbox (through its handle's client) learn of it only from a
``404``. A reader whose sandbox this process deleted ends quietly (its ``wait()`` still
raises); one whose sandbox vanished otherwise still says so. Bounded: the latest
:data:`REMEMBERED` names."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from .._upstream import SandboxNotFoundError

__all__ = ["REMEMBERED", "deleted_here", "ends_quietly", "mark_deleted"]

REMEMBERED = 4096
_LOCK = threading.Lock()
_NAMES: OrderedDict[str, None] = OrderedDict()


def mark_deleted(name: str) -> None:
    """Remember that this process deleted sandbox ``name``."""
    with _LOCK:
        _NAMES[name] = None
        _NAMES.move_to_end(name)
        while len(_NAMES) > REMEMBERED:
            _NAMES.popitem(last=False)


def _names_of(target: Any) -> set[str]:
    """The names a data target knows its sandbox by (its claim, its router id, its
    keepalive's), the wrapped target's too."""
    names = set()
    for each in (target, getattr(target, "target", None)):
        for value in (
            getattr(each, "claim_name", None),
            getattr(each, "sandbox_id", None),
            getattr(getattr(each, "keepalive", None), "name", None),
        ):
            if isinstance(value, str) and value:
                names.add(value)
    return names


def deleted_here(target: Any) -> bool:
    """Whether this process deleted the sandbox of data target ``target``."""
    names = _names_of(target)
    with _LOCK:
        return any(name in _NAMES for name in names)


def ends_quietly(target: Any, exc: BaseException) -> bool:
    """Whether a reader of ``target`` that failed with ``exc`` should end without a warning:
    its sandbox is gone (``404``, being deleted) because this process deleted it."""
    return isinstance(exc, SandboxNotFoundError) and deleted_here(target)
