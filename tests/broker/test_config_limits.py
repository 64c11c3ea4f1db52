"""The ``[server]`` keys of the broker's resource limits (issue 26): their defaults, their
rules (each problem names the key, the rule and the fix), and ``broker check``'s dump."""

from __future__ import annotations

from pathlib import Path

import pytest

from k8s_agent_sandbox_awx.broker.config import load_config, render_config
from tests.broker.test_config import BACKEND, ISSUER, POLICY, SERVER, load, one, problems, write


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    for name in ("tls.crt", "tls.key", "ca.crt", "sa-token", "router-token"):
        (tmp_path / name).write_text(f"{name}\n")
    return tmp_path


def test_the_defaults(conf: Path) -> None:
    server = load(conf, SERVER, ISSUER, POLICY, BACKEND).server
    assert server.keep_alive_seconds == 30.0
    assert server.request_head_seconds == 10.0
    assert server.websocket_max_per_caller == 16
    assert server.websocket_max_message_bytes == 1024 * 1024


def test_values_that_hold(conf: Path) -> None:
    server = SERVER + (
        "request_head_seconds = 2.5\nwebsocket_max_per_caller = 1\n"
        "websocket_max_message_bytes = 67108864\n"
    )
    loaded = load(conf, server, ISSUER, POLICY, BACKEND).server
    assert loaded.request_head_seconds == 2.5
    assert (loaded.websocket_max_per_caller, loaded.websocket_max_message_bytes) == (1, 1 << 26)


@pytest.mark.parametrize(
    ("line", "rule", "fix"),
    [
        ("request_head_seconds = 0", "out of range", "> 0 and <= 300"),
        ("request_head_seconds = 301", "out of range", "> 0 and <= 300"),
        ("request_head_seconds = inf", "out of range", "> 0"),
        ('request_head_seconds = "10"', "a number of seconds", "request_head_seconds = 10.0"),
        ("websocket_max_per_caller = 0", "out of range", "a whole number >= 1 and <= 10000"),
        ("websocket_max_per_caller = 2.5", "a whole number", "websocket_max_per_caller = 16"),
        ("websocket_max_per_caller = true", "a whole number", ""),
        ("websocket_max_message_bytes = 100", "out of range", ">= 1024 and <= 67108864"),
        ("websocket_max_message_bytes = 134217728", "out of range", "<= 67108864"),
        ('websocket_max_message_bytes = "1 MiB"', "a whole number", "= 1048576"),
    ],
)
def test_a_wrong_value_names_the_key_the_rule_and_the_fix(
    conf: Path, line: str, rule: str, fix: str
) -> None:
    found = problems(conf, SERVER + line + "\n", ISSUER, POLICY, BACKEND)
    one(found, "server." + line.split(" = ")[0], rule, fix)


def test_a_misspelt_key_is_named_with_the_right_one(conf: Path) -> None:
    found = problems(conf, SERVER + "websocket_max_per_callers = 4\n", ISSUER, POLICY, BACKEND)
    one(found, "server.websocket_max_per_callers", "is not a key", "websocket_max_per_caller")


def test_broker_check_dumps_them_and_the_dump_loads_back(conf: Path) -> None:
    config = load(conf, SERVER + "websocket_max_per_caller = 4\n", ISSUER, POLICY, BACKEND)
    text = render_config(config)
    assert "websocket_max_per_caller = 4\n" in text
    assert "websocket_max_message_bytes = 1048576  # default" in text
    assert "request_head_seconds = 10  # default" in text
    again = load_config(write(conf, text, name="rendered.toml"))
    assert again.server == config.server
