"""The configuration's one error type: every problem found, each naming file, key, rule, fix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BrokerConfigError", "Problem"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the configuration."""

    key: str
    """The dotted key, with the table index: ``issuers[1].jwks_url`` (``""``: the file)."""
    rule: str
    """What is wrong (never a secret's value)."""
    fix: str
    """What to do about it."""

    def line(self, path: Path) -> str:
        where = f"{path}: {self.key}" if self.key else str(path)
        return f"{where}: {self.rule}; fix: {self.fix}"


class BrokerConfigError(ValueError):
    """The broker configuration file cannot be used: ``problems`` lists every problem found."""

    def __init__(self, path: Path, problems: Sequence[Problem]) -> None:
        self.path = path
        self.problems = tuple(problems)
        count = len(self.problems)
        header = f"the broker configuration {path} has {count} problem{'s' * (count != 1)}:"
        super().__init__("\n".join([header, *(f"  {p.line(path)}" for p in self.problems)]))
