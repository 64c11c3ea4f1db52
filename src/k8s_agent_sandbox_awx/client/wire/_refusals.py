"""The sandbox runtime's refusals of a setting, in the words of the user (issue 30; no I/O).

The runtime answers a bad field with a ``400`` whose detail speaks its wire (``field
'timeout' must be ... or 'none'``); the user set ``timeout=`` (Python) or ``--timeout`` (the
CLI). :func:`refusal` recognises the refusals of a setting the user chose and says what the
limit is and what to pass instead, as a :class:`~k8s_agent_sandbox_awx._fix.Fix` each surface
spells in its own terms.
"""

from __future__ import annotations

import re

from ..._fix import Fix, Say, Setting

__all__ = ["SANDBOX_ROOTS", "broker_fix", "not_a_command_id", "refusal"]

SANDBOX_ROOTS = ("/app", "/workspace")
"""The directories a command may run in (and under): the sandbox's base and its workspace."""

_TIMEOUT = re.compile(r"field 'timeout' must be .*?at most (\d+(?:\.\d+)?)", re.S)
_CWD = re.compile(r"field 'cwd': (.+) is not an existing directory", re.S)


def refusal(status: int, detail: str, what: str) -> tuple[str, Fix] | None:
    """What failed and its fix, for a runtime refusal of a setting (``None``: another
    refusal). ``what``: the operation (``start a command``)."""
    if status != 400:
        return None
    if match := _TIMEOUT.search(detail):
        return _timeout(float(match.group(1)), what)
    if match := _CWD.search(detail):
        return _cwd(match.group(1), what)
    return None


def _timeout(cap: float, what: str) -> tuple[str, Fix]:
    said = (
        f"Could not {what} (the sandbox runtime answered 400): its time limit is over this "
        f"sandbox's cap, at most {cap:g} s (the runtime's longest time limit)."
    )
    return said, Fix(
        "Pass ",
        Setting("command_timeout", cap),
        " or less; for a command without a time limit (a server), start it in the background: ",
        Setting("background"),
        Say(", ", cli=" "),
        Setting("command_timeout", 0),
        Say("", cli=" (with --sandbox NAME or --keep)"),
        ".",
    )


def _cwd(shown: str, what: str) -> tuple[str, Fix]:
    said = (
        f"Could not {what} (the sandbox runtime answered 400): the working directory {shown} "
        "does not exist in the sandbox."
    )
    roots = " and ".join(SANDBOX_ROOTS)
    return said, Fix(
        f"Commands run in {roots} (and their subdirectories; {SANDBOX_ROOTS[0]} is the "
        "default and where E2B's /home/user is): pass ",
        Setting("cwd", SANDBOX_ROOTS[0]),
        ", or create the directory first (files.make_dir).",
    )


def broker_fix(code: str | None, path: str) -> Fix | None:
    """The fix of a broker refusal that names a setting (``None``: its hint says it all):
    ``lifetime_exceeds_policy`` at a create (the lifetime asked for) or an extension (``path``
    ends in ``/lifetime``: the new lifetime)."""
    if code != "lifetime_exceeds_policy":
        return None
    cap = (
        "the policy caps a sandbox's lifetime from its creation (`agent-sandbox-awx whoami` "
        "shows max_lifetime_seconds)"
    )
    if path.endswith("/lifetime"):
        fewer = Say(
            "fewer seconds in set_timeout(seconds)",
            cli="a smaller SECONDS in `agent-sandbox-awx extend NAME SECONDS`",
        )
        return Fix("Ask for a shorter lifetime, ", fewer, f": {cap}.")
    return Fix(
        "Ask for a shorter lifetime (",
        Setting("lifetime", or_env=True),
        f"): {cap}; with neither set, the SDK's default of 300 s is cut at the cap by a "
        "broker that honours 'Prefer: clamp-lifetime'.",
    )


def not_a_command_id(command_id: object) -> ValueError:
    """A command named by something else than its id: E2B's habit is a process id (an int:
    ``commands.kill(pid)``), which a command here does not have."""
    if isinstance(command_id, int) and not isinstance(command_id, bool):
        return ValueError(
            f"{command_id!r} is not a command id: a command here is named by its command_id, "
            "a string (E2B's pid is a number; a sandbox's processes are not addressed by pid). "
            "It is the command_id of the handle commands.run(..., background=True) returned "
            "(handle.command_id), or one of commands.list()."
        )
    return ValueError(
        f"command_id must be the non-empty id a command was started with (handle.command_id, "
        f"or one of commands.list()), got {command_id!r}."
    )
