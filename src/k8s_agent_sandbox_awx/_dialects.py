"""The registry of broker dialects: adding one is one module plus one line here."""

from __future__ import annotations

from ._dialect import Dialect
from ._dialect_v1 import V1Dialect
from .errors import ConfigurationError

__all__ = ["DEFAULT", "DIALECTS", "get_dialect"]

DIALECTS: dict[str, Dialect] = {
    V1Dialect.name: V1Dialect(),
}
DEFAULT = V1Dialect.name


def get_dialect(name: str | None = None) -> Dialect:
    """The dialect called ``name`` (default: v1)."""
    dialect = DIALECTS.get(name or DEFAULT)
    if dialect is None:
        raise ConfigurationError(
            f"Unknown broker protocol {name!r}; use one of {', '.join(sorted(DIALECTS))}."
        )
    return dialect
