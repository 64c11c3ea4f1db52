"""What the CLI's modules share: its name, its explained failure, the seconds type of its
options and its JSON printing (standard library only: ``--help`` stays fast)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

__all__ = ["PROG", "CliError", "print_json", "seconds"]

PROG = "agent-sandbox-awx"


class CliError(Exception):
    """A failure already explained for the user (exit code attached)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def seconds(*, positive: bool) -> Callable[[str], float]:
    """An argparse type: a number of seconds, > 0 (``positive``) or >= 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or not (value > 0 if positive else value >= 0):
            rule = "a number of seconds greater than 0" if positive else "a number of seconds >= 0"
            raise argparse.ArgumentTypeError(f"{text!r} is not {rule}")
        return value

    parse.__name__ = "seconds"
    return parse


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))
