"""The mechanism of issue 30: a fix names its setting once; each surface spells it."""

from __future__ import annotations

import copy
import pickle

import pytest

from k8s_agent_sandbox_awx._fix import CLI, CONFIG, ENV, PYTHON, Fix, Say, Setting, attach, message
from k8s_agent_sandbox_awx.errors import BrokerError, ConfigurationError


def test_a_setting_is_spelled_by_each_surface() -> None:
    ttl = Setting("lifetime", 600)
    assert [ttl.render(s) for s in (PYTHON, CLI, ENV)] == [
        "timeout=600",
        "--timeout 600",
        "AGENT_SANDBOX_TTL_SECONDS=600",
    ]
    assert Setting("ca_bundle").render(PYTHON) == "ca_cert="
    assert Setting("ca_bundle").render(CLI) == "--ca-bundle"
    assert Setting("background").render(PYTHON) == "background=True"
    assert Setting("background").render(CLI) == "--background"
    assert Setting("command_timeout", 0.5).render(CLI) == "--timeout 0.5"
    assert Setting("cwd", "/app").render(PYTHON) == "cwd='/app'"
    assert Setting("jwks_url", "https://h/keys").render(CONFIG) == 'jwks_url = "https://h/keys"'
    # a value from the environment: every surface names the variable the user set
    assert Setting("broker_url", source=ENV).render(CLI) == "AGENT_SANDBOX_BROKER_URL"
    # a setting the CLI has no flag for: the environment's variable
    assert Setting("token").render(CLI) == "AGENT_SANDBOX_TOKEN"
    assert Setting("lifetime", or_env=True).render(PYTHON) == (
        "timeout= (or AGENT_SANDBOX_TTL_SECONDS)"
    )
    assert Setting("discovery", False).render(CONFIG) == "discovery = false"
    with pytest.raises(KeyError):
        Setting("no-such-setting")


def test_an_error_with_a_fix_reads_as_python_and_renders_for_the_cli() -> None:
    fix = Fix("Pass ", Setting("command_timeout", 300), Say(" in Python.", cli=" on the line."))
    exc = BrokerError("It failed.", status_code=400, fix=fix)
    assert str(exc) == "It failed. Pass timeout=300 in Python."
    assert message(exc, CLI) == "It failed. Pass --timeout 300 on the line."
    assert (exc.what, exc.fix) == ("It failed.", fix)
    for again in (pickle.loads(pickle.dumps(exc)), copy.copy(exc)):
        assert str(again) == str(exc) and message(again, CLI) == message(exc, CLI)
    config = ConfigurationError("No URL.", fix=Fix("Set ", Setting("broker_url"), "."))
    assert (str(config), message(config, CLI)) == (
        "No URL. Set broker_url=.",
        "No URL. Set --broker-url.",
    )
    plain = attach(ValueError("bad"), None)
    assert message(plain, CLI) == "bad" and not hasattr(plain, "fix")
    assert message(attach(ValueError("bad"), Fix(Say("py", cli="cli"))), CLI) == "bad cli"
