"""What the SDK, the credential chain and the CLI know of ``agent-sandbox-awx dev``'s files
(issue 30): where its state directory is, the record it keeps there (``dev.json``: its URL,
port, CA bundle and token file), and whether a missing token file or a refused connection is
that of a ``dev`` that no longer runs, to say so, with the command that starts it again,
instead of the generic advice (a projected ServiceAccount token, "check the broker URL").

Standard library only, no state: each question reads the record afresh.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from typing import Any

__all__ = [
    "RECORD",
    "TOKEN_DIR_PREFIX",
    "default_state_dir",
    "read_record",
    "restart_command",
    "stopped_dev_at",
    "stopped_dev_token",
    "stopped_sentence",
]

RECORD = "dev.json"
"""The record ``dev`` writes in its state directory when it starts (kept after it stops)."""
TOKEN_DIR_PREFIX = "agent-sandbox-dev-"  # noqa: S105 - a directory name
"""The name a temporary token directory of ``dev`` starts with (``--state-dir`` unset in
versions before state directories; removed when it stopped)."""
_MAX_RECORD_BYTES = 64 * 1024


def default_state_dir(environ: Mapping[str, str] | None = None) -> str:
    """``${XDG_STATE_HOME:-~/.local/state}/k8s-agent-sandbox-awx/dev``."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(os.path.abspath(base), "k8s-agent-sandbox-awx", "dev")


def read_record(directory: str) -> dict[str, Any] | None:
    """The record in ``directory``, or ``None`` (none, unreadable, or not a record)."""
    try:
        with open(os.path.join(directory, RECORD), "rb") as fh:
            data = json.loads(fh.read(_MAX_RECORD_BYTES))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def restart_command(directory: str, record: Mapping[str, Any]) -> str:
    """The command that starts the ``dev`` of ``record`` again with the same exports: its
    ``--port`` and, when it is not the default one, its ``--state-dir``."""
    words = ["agent-sandbox-awx", "dev"]
    port = record.get("port")
    if isinstance(port, int) and not isinstance(port, bool) and port > 0:
        words += ["--port", str(port)]
    if os.path.abspath(directory) != default_state_dir():
        words += ["--state-dir", shlex.quote(os.path.abspath(directory))]
    return " ".join(words)


def stopped_sentence(what: str, command: str | None) -> str:
    """The message: the broker from ``dev`` no longer runs (``what`` went with it or met it),
    and how to start it again (``command``: with the same exports; ``None``: new ones)."""
    head = f"The local broker from `agent-sandbox-awx dev` is no longer running: {what}."
    if command is None:
        return (
            f"{head} Start it again (`agent-sandbox-awx dev`) and export the lines it prints "
            "(this one's were temporary)."
        )
    return f"{head} Start it again (`{command}`): the exported lines stay valid."


def stopped_dev_token(path: str) -> str | None:
    """The message for a token file ``path`` that does not exist, if it is a ``dev``'s: one
    in a temporary directory of ``dev`` that is gone, or the one a state directory's record
    names (``dev`` removes it when it stops)."""
    full = os.path.abspath(path)
    directory = os.path.dirname(full)
    what = f"its token file {path} went with it"
    if os.path.basename(directory).startswith(TOKEN_DIR_PREFIX) and not os.path.isdir(directory):
        return stopped_sentence(what, None)
    for state_dir in (directory, os.path.dirname(directory)):  # dev's own: in ``token/``
        record = read_record(state_dir)
        if record is not None and record.get("token_file") == full:
            return stopped_sentence(what, restart_command(state_dir, record))
    return None


def stopped_dev_at(url: str, ca_bundle: str | None) -> str | None:
    """The message for a connection to ``url`` refused, if ``url`` is the one the record next
    to ``ca_bundle`` (a ``dev`` state directory's CA) names: that ``dev`` no longer runs."""
    if not ca_bundle or "\n" in ca_bundle:
        return None
    directory = os.path.dirname(os.path.abspath(ca_bundle))
    record = read_record(directory)
    if record is None or str(record.get("url", "")).rstrip("/") != url.rstrip("/"):
        return None
    return stopped_sentence(f"nothing listens at {url}", restart_command(directory, record))
