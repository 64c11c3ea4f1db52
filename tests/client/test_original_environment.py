"""The original package's environment, variable by variable: every name in its "first set wins"
list (shared/reference/original-package.md, "Environment") is read, in its order, after the
SDK's own name for the same setting (docs/migrating.md, "Configuration")."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import BrokerConnectionConfig, Sandbox
from k8s_agent_sandbox_awx.cli._cli import main
from k8s_agent_sandbox_awx.credentials._chain import explain
from k8s_agent_sandbox_awx.testing import unsigned_jwt

AUDIENCE = "https://broker.example"


def _config_value(setting: str) -> Callable[[dict[str, str], Path], str]:
    def read(environ: dict[str, str], _tmp: Path) -> str:
        config = BrokerConnectionConfig.from_env({"BROKER_URL": AUDIENCE, **environ})
        return str(getattr(config, setting))

    return read


def _credential(environ: dict[str, str], _tmp: Path) -> str:
    """The winner: the variable (a token) or the file (a token file) the chain selected."""
    environ = {"AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1", **environ}
    explanation = explain(AUDIENCE, environ=environ)
    assert explanation.error is None, explanation.error
    selected = next(d for d in explanation.decisions if d.status == "selected")
    return selected.detail.split(";", 1)[0]


def _token(name: str, tmp: Path) -> tuple[str, str]:
    """(value to set, what the chain reports when it wins) for a token variable."""
    return unsigned_jwt({"aud": AUDIENCE, "iss": "https://issuer", "sub": name}), name


def _token_file(name: str, tmp: Path) -> tuple[str, str]:
    path = tmp / name
    path.write_text(unsigned_jwt({"aud": AUDIENCE, "iss": "https://issuer", "sub": name}))
    return str(path), str(path)


def _plain(value: str) -> Callable[[str, Path], tuple[str, str]]:
    def make(name: str, _tmp: Path) -> tuple[str, str]:
        got = f"{value}-{name.lower()}"
        return got, got

    return make


def _seconds(name: str, _tmp: Path) -> tuple[str, str]:
    seconds = str(60 + len(name))  # distinct per variable of a row
    return seconds, seconds


# (setting, its variables first-set-wins: the SDK's name first, then the original's in its
#  order, how to make a value for a variable, how to read which value won)
ROWS: list[tuple[str, tuple[str, ...], Any, Any]] = [
    ("broker URL", ("AGENT_SANDBOX_BROKER_URL", "BROKER_URL"), None, None),
    ("token", ("AGENT_SANDBOX_TOKEN", "BROKER_TOKEN"), _token, _credential),
    (
        "token file",
        (
            "AGENT_SANDBOX_TOKEN_FILE",
            "AGENT_SANDBOX_TOKEN_PATH",
            "BROKER_TOKEN_PATH",
            "KSA_TOKEN_PATH",
        ),
        _token_file,
        _credential,
    ),
    (
        "warm pool",
        ("AGENT_SANDBOX_TEMPLATE", "AGENT_SANDBOX_WARMPOOL", "SANDBOX_WARMPOOL"),
        _plain("pool"),
        _config_value("template"),
    ),
    (
        "namespace",
        ("AGENT_SANDBOX_NAMESPACE", "SANDBOX_NAMESPACE"),
        _plain("ns"),
        _config_value("namespace"),
    ),
    (
        "lifetime",
        ("AGENT_SANDBOX_TTL_SECONDS", "SANDBOX_TTL_SECONDS"),
        _seconds,
        _config_value("sandbox_timeout"),
    ),
    (
        "keepalive",
        ("AGENT_SANDBOX_KEEPALIVE_TTL_SECONDS",),
        _seconds,
        _config_value("sandbox_keepalive"),
    ),
]


def _broker_url_value(name: str, _tmp: Path) -> tuple[str, str]:
    url = f"https://{name.lower().replace('_', '-')}.example"
    return url, url


def _broker_url(environ: dict[str, str], _tmp: Path) -> str:
    return BrokerConnectionConfig.from_env(environ).broker_url


CASES = [
    pytest.param(
        names,
        make or _broker_url_value,
        read or _broker_url,
        first,
        id=f"{setting}-from-{names[first]}",
    )
    for setting, names, make, read in ROWS
    for first in range(len(names))
]


@pytest.mark.parametrize(("names", "make", "read", "first"), CASES)
def test_each_variable_is_honoured_and_the_earlier_one_wins(
    names: tuple[str, ...], make: Any, read: Any, first: int, tmp_path: Path
) -> None:
    values = {name: make(name, tmp_path) for name in names}
    # alone, the variable is read
    alone = {names[first]: values[names[first]][0]}
    assert read(alone, tmp_path) == values[names[first]][1]
    # with every later one set too, it wins (ours before the original's, the original's in
    # its own order)
    environ = {name: values[name][0] for name in names[first:]}
    assert read(environ, tmp_path) == values[names[first]][1]


def test_the_original_defaults() -> None:
    from k8s_agent_sandbox_awx.credentials._providers import DEFAULT_TOKEN_PATH

    config = BrokerConnectionConfig.from_env({"BROKER_URL": AUDIENCE})
    assert DEFAULT_TOKEN_PATH == "/var/run/secrets/tokens/agent-sandbox-token"
    assert config.sandbox_timeout == 300  # 0.5.2+
    assert config.sandbox_keepalive == 0  # off, 0.5.2+


def test_the_cli_reads_the_original_broker_url(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    for name in ("AGENT_SANDBOX_BROKER_URL", "BROKER_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("BROKER_URL", "http://broker.example")  # refused: not https
    assert main(["ls"]) == 1
    err = capsys.readouterr().err
    assert "No broker URL" not in err
    assert "http://broker.example" in err


@pytest.mark.e2e
def test_the_original_lifetime_variable_sets_the_claims_shutdown(
    rpc_broker: Any, use_env: Any
) -> None:
    use_env({**rpc_broker.environ("kubernetes"), "SANDBOX_TTL_SECONDS": "120"})
    before = dt.datetime.now(dt.UTC)
    with Sandbox.create() as sandbox:
        [claim] = [c for c in rpc_broker.claims() if c["metadata"]["name"] == sandbox.name]
    shutdown = dt.datetime.fromisoformat(claim["spec"]["lifecycle"]["shutdownTime"])
    assert dt.timedelta(seconds=110) < shutdown - before < dt.timedelta(seconds=130)
