"""Issue 30: what the docs say about messages and spellings is true. issuers.md no longer
blames a trailing slash for ``401 audience_mismatch`` (both halves normalise it); the "Coming
from E2B" table of docs/client.md has a row for every E2B habit the issue lists."""

from __future__ import annotations

import re
from pathlib import Path

from k8s_agent_sandbox_awx._urls import normalise_url as broker_rule
from k8s_agent_sandbox_awx.credentials._jwt import normalise_url as client_rule

ROOT = Path(__file__).resolve().parents[1]


def test_issuers_md_says_the_trailing_slash_rule_both_halves_apply() -> None:
    text = (ROOT / "docs/broker/issuers.md").read_text()
    assert "no trailing slash" not in text.lower()
    row = next(line for line in text.splitlines() if line.startswith("| `401 audience_mismatch`"))
    assert "a trailing slash" in row and "do not matter" in row, row
    for rule in (client_rule, broker_rule):  # what the row says, checked
        assert (
            rule("https://Sandbox-Broker.example.com:443/") == "https://sandbox-broker.example.com"
        )


def _e2b_table() -> str:
    text = (ROOT / "docs/client.md").read_text()
    start = text.index("### Coming from E2B")
    return text[start : text.index("\n### ", start + 1)]


def test_the_e2b_table_has_a_row_for_every_habit() -> None:
    table = _e2b_table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    wanted = {
        "home directory": r"/home/user.*`/app`",
        "get_host on the sandbox": r"`sbx\.get_host\(port\)`",
        "read returns bytes": r"`files\.read\(path\)` returns text.*\*\*bytes\*\*",
        "FileInfo.type": r'"dir".*"directory"',
        "pty by id": r"`sbx\.pty\.send_stdin\(pid, data\)`.*`sbx\.pty\.kill\(pid\)`",
        "pty size and pid": r"`sbx\.pty\.create\(size=.*`handle\.pid`",
        "commands.kill(pid)": r"`commands\.kill\(pid\)`.*not a pid",
        "metadata apart": r"create\(metadata=.*`metadata` \(yours alone\).*`owner`",
    }
    missing = [
        name for name, pattern in wanted.items() if not any(re.search(pattern, r) for r in rows)
    ]
    assert missing == []
