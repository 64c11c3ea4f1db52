"""The ports a policy lets its callers reach in their sandboxes (``Policy.ports``).

A policy's ``ports`` is a list of ports and ranges: ``[8000, "3000-3999"]`` (an int, a digit
string, or ``"LOW-HIGH"``, inclusive, each within 1..65535). The default is
:data:`DEFAULT_PORTS`, every unprivileged port; ``[]`` allows none (no port requests at all).
The runtime's own port (8888) is never a user port, whatever the list says: a data-plane
request to it is a runtime API request (docs/broker-api.md, "Ports").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_PORTS: tuple[int | str, ...] = ("1024-65535",)
"""Every unprivileged port (a sandbox's dev server, notebook, language server...)."""


@dataclass(frozen=True)
class PortRanges:
    """Inclusive ``(low, high)`` ranges, parsed and checked by :func:`parse_ports`."""

    ranges: tuple[tuple[int, int], ...]

    def allows(self, port: int) -> bool:
        return any(low <= port <= high for low, high in self.ranges)

    def describe(self) -> list[int | str]:
        """The ranges as a policy writes them (``[8000, "3000-3999"]``)."""
        return [low if low == high else f"{low}-{high}" for low, high in self.ranges]


def parse_ports(value: object, what: str = "Policy.ports") -> PortRanges:
    """``value`` (a list of ports and ``"LOW-HIGH"`` ranges) as :class:`PortRanges`; a
    ``ValueError`` naming ``what``, the entry and the rule otherwise."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(
            f'{what} must be a list of ports and ranges, e.g. [8000, "3000-3999"], not {value!r}'
        )
    return PortRanges(tuple(_entry(item, what) for item in value))


def _entry(item: object, what: str) -> tuple[int, int]:
    rule = (
        f"{what}: {item!r} is not a port or a range; write a port (8000) or an inclusive "
        'range ("3000-3999"), each from 1 to 65535'
    )
    if isinstance(item, bool):
        raise ValueError(rule)
    if isinstance(item, int):
        low = high = item
    elif isinstance(item, str) and item.strip().isdigit():
        low = high = int(item)
    elif isinstance(item, str) and item.count("-") == 1:
        first, _, last = (part.strip() for part in item.partition("-"))
        if not (first.isdigit() and last.isdigit()):
            raise ValueError(rule)
        low, high = int(first), int(last)
    else:
        raise ValueError(rule)
    if not 1 <= low <= high <= 65535:
        raise ValueError(rule)
    return (low, high)
