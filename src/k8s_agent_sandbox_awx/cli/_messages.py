"""An error as the CLI says it (issue 30): the setting it is about spelled as a flag
(``--timeout 300``, not ``timeout=300``), or as the variable when the value came from the
environment, the next step a command, and no Python exception class in front (the message
says what failed)."""

from __future__ import annotations

import argparse
import os

from .._fix import CLI, ENV, Surface, message

__all__ = ["cli_message", "sources"]

_FLAGS = {
    # setting: (the option's attribute, the variables it is read from without the option)
    "broker_url": ("broker_url", ("AGENT_SANDBOX_BROKER_URL", "BROKER_URL")),
    "ca_bundle": ("ca_bundle", ("AGENT_SANDBOX_CA_BUNDLE",)),
}


def sources(args: argparse.Namespace | None) -> dict[str, Surface]:
    """Where this command's connection settings came from: its flag, or the environment."""
    found: dict[str, Surface] = {}
    for setting, (option, names) in _FLAGS.items():
        if getattr(args, option, None):
            found[setting] = CLI
        elif any(os.environ.get(n) for n in names):
            found[setting] = ENV
    return found


def cli_message(exc: BaseException, args: argparse.Namespace | None = None) -> str:
    """``exc``'s message in the CLI's terms (its fix rendered for the command line, naming the
    variable of a setting ``args`` did not give); an error without a message is named by its
    class, the only thing it says."""
    return message(exc, CLI, sources(args)) or type(exc).__name__
