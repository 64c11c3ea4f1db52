"""One bad plugin never breaks discovery (issue 10, item 5).

- A plugin that fails to load, with any ``BaseException`` but ``KeyboardInterrupt`` (``SystemExit``
  included), is skipped with ONE warning (a ``CredentialPluginWarning``, not also a log record).
- A plugin that answers with something unusable (a ``Credential`` whose token is not a ``str``)
  or raises any ``BaseException`` but ``KeyboardInterrupt`` is "here but broken": a typed,
  redacted ``CredentialSourceError``; ``explain()`` and ``doctor`` report it, never crash.
- A plugin that does not answer within ``CredentialRequest.timeout`` is skipped with one warning
  during discovery (discovery goes on with the next provider); once selected, it is an error.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import k8s_agent_sandbox_awx
from k8s_agent_sandbox_awx import (
    Credential,
    CredentialPluginWarning,
    CredentialRequest,
    CredentialSourceError,
    DefaultCredentials,
    NoCredentialsError,
    OIDCTokenAuth,
    explain,
    hookimpl,
)

BROKER = "https://sandbox-broker.example"
NONE = {"AGENT_SANDBOX_LOAD_PLUGINS": ""}
LATE = "did not answer in time (CredentialRequest.timeout is 0.3 s"

EXITS = """
import os

raise SystemExit("plugin refuses to start; token " + os.environ.get("AGENT_SANDBOX_TOKEN", "-"))
"""

BAILS = """
import os


class Bail(BaseException):
    pass


raise Bail("bailing out with " + os.environ.get("AGENT_SANDBOX_TOKEN", "-"))
"""

INTERRUPTS = "raise KeyboardInterrupt\n"

INT_TOKEN = """
from __future__ import annotations

from k8s_agent_sandbox_awx import Credential, CredentialRequest, hookimpl


@hookimpl
def agent_sandbox_get_credential(request: CredentialRequest) -> Credential:
    return Credential(12345, "int-token", source="a number")
"""

SLEEPY = """
from __future__ import annotations

import threading

from k8s_agent_sandbox_awx import Credential, CredentialRequest, hookimpl

RELEASE = threading.Event()
FINISHED: list[bool] = []


@hookimpl
def agent_sandbox_get_credential(request: CredentialRequest) -> Credential | None:
    RELEASE.wait(10)  # a fetch that hangs (far longer than the request's timeout)
    FINISHED.append(True)
    return request.not_here("woke up")
"""


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory, install_distributions: Any) -> Iterator[Path]:
    """A distribution of bad plugins, installed and discoverable through its entry points."""
    modules = {
        "exits": EXITS,
        "bails": BAILS,
        "interrupts": INTERRUPTS,
        "int_token": INT_TOKEN,
        "sleepy": SLEEPY,
    }
    eps = {
        "exits": "exits",
        "bails": "bails",
        "interrupts": "interrupts",
        "int-token": "int_token",
        "sleepy": "sleepy",
    }
    dist = ("sbx-bad-plugins", "sbx_bad_plugins", modules, eps)
    with install_distributions(tmp_path_factory.mktemp("bad-plugins"), dist) as site:
        yield site


def plugin_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CredentialPluginWarning)]


def warning_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.fixture
def projected_token(tmp_path: Path, mint) -> tuple[str, str]:
    """``(path, token)``: a valid token at a stand-in for the default projected path."""
    token = mint()
    path = tmp_path / "projected-token"
    path.write_text(token)
    return str(path), token


# --- loading ----------------------------------------------------------------------------


def test_a_plugin_exiting_at_import_is_skipped_with_one_warning(
    bad, missing_path, mint, caplog, no_secret, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = mint()
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": "exits,bails,int-token", "AGENT_SANDBOX_TOKEN": token}
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN", token)  # the plugins put it in their messages
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        creds = DefaultCredentials(env, _token_path=missing_path)
        assert creds.get_credential(BROKER).token == token  # the SDK still works
    messages = plugin_warnings(caught)
    assert len(messages) == 2, messages
    [exits] = [m for m in messages if "'exits'" in m]
    [bails] = [m for m in messages if "'bails'" in m]
    assert "could not be loaded and is skipped: SystemExit: plugin refuses to start" in exits
    assert "Bail: bailing out with" in bails
    assert warning_records(caplog) == []  # once: a warning, not also a log record
    report = explain(BROKER, auth=creds)
    statuses = {d.name: d.status for d in report.decisions}
    assert statuses["exits"] == statuses["bails"] == "failed to load"
    assert report.selected == "agent-sandbox-token"
    no_secret(token, *messages, caplog.text, str(report), json.dumps(report.to_dict()))


def test_keyboard_interrupt_at_import_still_interrupts(bad, missing_path) -> None:
    creds = DefaultCredentials(
        {"AGENT_SANDBOX_LOAD_PLUGINS": "interrupts"}, _token_path=missing_path
    )
    with pytest.raises(KeyboardInterrupt):
        creds.registry()


# --- unusable answers -------------------------------------------------------------------


class Returns:
    """A plugin that answers a Credential whose token is ``token`` (of any type)."""

    def __init__(self, token: object) -> None:
        self.token = token

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential:
        return Credential(self.token, "", source="odd")  # type: ignore[arg-type]


@pytest.mark.parametrize("token", [12345, b"eyJ.bytes.token", None])
def test_a_token_that_is_not_a_str_is_a_typed_error(token: object, missing_path, mint) -> None:
    creds = DefaultCredentials(NONE, _token_path=missing_path, _plugins=[("odd", Returns(token))])
    kind = type(token).__name__
    with pytest.raises(CredentialSourceError, match=f"token is {kind}, not str") as info:
        creds.get_credential(BROKER)
    assert info.value.provider == "odd"
    report = explain(BROKER, auth=creds)
    assert isinstance(report.error, CredentialSourceError)
    assert {d.name: d.status for d in report.decisions}["odd"] == "error"
    assert f"token is {kind}" in str(report) and report.to_dict()["error"] is not None
    # after a winner, explain() still consults (and reports) it without crashing
    good = {**NONE, "AGENT_SANDBOX_TOKEN": mint()}
    shadowed = DefaultCredentials(
        good, _token_path=missing_path, _plugins=[("odd", Returns(token))]
    )
    report = explain(BROKER, auth=shadowed)
    assert report.selected == "agent-sandbox-token" and report.error is None


@pytest.mark.asyncio
async def test_a_token_that_is_not_a_str_is_a_typed_error_async(missing_path) -> None:
    creds = DefaultCredentials(NONE, _token_path=missing_path, _plugins=[("odd", Returns(7))])
    with pytest.raises(CredentialSourceError, match="token is int, not str"):
        await creds.aget_credential(BROKER)


class _Booby(Credential):
    """A Credential whose ``source`` (a property) raises when it is read."""

    @property  # type: ignore[override]
    def source(self) -> str:
        raise RuntimeError("source exploded")


class _BoobyStr(str):
    """A str whose ``strip()`` (used by the token check) raises."""

    def strip(self, chars: str | None = None) -> str:
        raise RuntimeError("strip exploded")


def _booby_credential(token: str) -> Credential:
    credential = object.__new__(_Booby)
    object.__setattr__(credential, "token", token)
    object.__setattr__(credential, "provider", "")
    object.__setattr__(credential, "file_backed", False)
    return credential


class Answers:
    """A plugin that answers ``make(token)`` (sync and async hooks)."""

    def __init__(self, make: Callable[[str], object], token: str) -> None:
        self.make, self.token = make, token

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> object:
        return self.make(self.token)

    @hookimpl
    async def agent_sandbox_get_credential_async(self, request: CredentialRequest) -> object:
        return self.make(self.token)


@pytest.mark.asyncio
async def test_an_answer_that_raises_when_read_is_a_typed_error(missing_path, mint) -> None:
    # the plugin's code ran again when the answer was checked, outside the plugin's guard: a
    # raw RuntimeError from get_credential, aget_credential and explain()
    plugins = [("odd", Answers(_booby_credential, mint()))]
    creds = DefaultCredentials(NONE, _token_path=missing_path, _plugins=plugins)
    with pytest.raises(CredentialSourceError, match="source exploded") as info:
        creds.get_credential(BROKER)
    assert info.value.provider == "odd"
    with pytest.raises(CredentialSourceError, match="source exploded"):
        await creds.aget_credential(BROKER)
    report = explain(BROKER, auth=creds)
    assert {d.name: d.status for d in report.decisions}["odd"] == "error"
    assert isinstance(report.error, CredentialSourceError)


@pytest.mark.asyncio
async def test_a_token_of_a_str_subclass_is_used_as_a_plain_str(missing_path, mint) -> None:
    # its strip() (the token check) raised a raw RuntimeError: the answer is read once, as
    # plain data, and no code of the plugin runs after its call
    token = mint()
    plugins = [("odd", Answers(lambda t: Credential(_BoobyStr(t), "", source="odd"), token))]
    creds = DefaultCredentials(NONE, _token_path=missing_path, _plugins=plugins)
    for credential in (creds.get_credential(BROKER), await creds.aget_credential(BROKER)):
        assert type(credential.token) is str and credential.token == token
    assert explain(BROKER, auth=creds).selected == "odd"


# --- BaseException during a fetch -------------------------------------------------------


class Bail(BaseException):
    pass


class Raises:
    """A plugin whose hook (sync, or async when ``is_async``) raises ``error(token)``."""

    def __init__(self, error: Callable[[str], BaseException], token: str) -> None:
        self.error, self.token = error, token

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential:
        raise self.error(f"denied for {self.token}")


class RaisesAsync(Raises):
    @hookimpl
    async def agent_sandbox_get_credential_async(self, request: CredentialRequest) -> Credential:
        raise self.error(f"denied for {self.token}")


@pytest.mark.asyncio
@pytest.mark.parametrize("error", [SystemExit, Bail])
@pytest.mark.parametrize("plugin_type", [Raises, RaisesAsync])
async def test_a_base_exception_in_a_fetch_is_a_redacted_typed_error(
    error: type[BaseException], plugin_type: type[Raises], missing_path, mint, no_secret
) -> None:
    token = mint()
    plugins = [("raiser", plugin_type(error, token))]
    for path in ("sync", "async"):
        creds = DefaultCredentials(NONE, _token_path=missing_path, _plugins=plugins)
        with pytest.raises(CredentialSourceError, match=error.__name__) as info:
            if path == "sync":
                creds.get_credential(BROKER)
            else:
                await creds.aget_credential(BROKER)
        assert info.value.provider == "raiser"
        assert info.value.__cause__ is None and info.value.__context__ is None
        no_secret(token, str(info.value), repr(info.value.args))
    report = explain(BROKER, auth=creds)
    assert {d.name: d.status for d in report.decisions}["raiser"] == "error"
    no_secret(token, str(report))


def test_an_explicit_callable_raising_system_exit_is_a_typed_error(mint, no_secret) -> None:
    token = mint()

    def fetch() -> str:
        raise SystemExit(f"no token today ({token})")

    with pytest.raises(CredentialSourceError, match="SystemExit") as info:
        OIDCTokenAuth(fetch).get_credential(BROKER)
    no_secret(token, str(info.value))


def test_keyboard_interrupt_in_a_fetch_still_interrupts(missing_path) -> None:
    plugins = [("raiser", Raises(lambda _message: KeyboardInterrupt(), "x"))]
    with pytest.raises(KeyboardInterrupt):
        DefaultCredentials(NONE, _token_path=missing_path, _plugins=plugins).get_credential(BROKER)


# --- timeout ----------------------------------------------------------------------------


class Hung:
    """A plugin whose sync fetch hangs until released (at most 10 s)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.finished = threading.Event()

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential | None:
        self.release.wait(10)
        self.finished.set()
        return request.not_here("woke up")


class HungAsync:
    """A plugin whose async fetch hangs (and records that it was cancelled)."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    @hookimpl
    async def agent_sandbox_get_credential_async(
        self, request: CredentialRequest
    ) -> Credential | None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return request.not_here("woke up")


@pytest.fixture
def hung() -> Iterator[Hung]:
    plugin = Hung()
    yield plugin
    plugin.release.set()  # let its helper thread end


def test_a_hung_plugin_is_skipped_after_the_request_timeout(
    hung: Hung, projected_token, caplog, missing_path
) -> None:
    path, token = projected_token
    creds = DefaultCredentials(NONE, timeout=0.3, _token_path=path, _plugins=[("hung", hung)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cred = creds.get_credential(BROKER)
    assert (cred.provider, cred.token) == ("kubernetes-projected", token)
    assert not hung.finished.is_set()  # discovery went on without waiting for it
    [message] = plugin_warnings(caught)
    assert "'hung'" in message and LATE in message
    assert warning_records(caplog) == []
    assert creds.get_credential(BROKER).token == token  # selected: not consulted again
    assert len(plugin_warnings(caught)) == 1

    # nothing else applies: the aggregated error says what happened to it
    alone = DefaultCredentials(
        NONE, timeout=0.3, _token_path=missing_path, _plugins=[("hung", hung)]
    )
    with pytest.warns(CredentialPluginWarning), pytest.raises(NoCredentialsError) as info:
        alone.get_credential(BROKER)
    assert "hung: did not answer in time (CredentialRequest.timeout is 0.3 s" in str(info.value)
    assert not hung.finished.is_set()


def test_explain_reports_a_hung_plugin_without_waiting_for_it(
    hung: Hung, projected_token, mint
) -> None:
    path, _token = projected_token
    env = {**NONE, "AGENT_SANDBOX_TOKEN": mint()}  # a winner first: explain consults all
    creds = DefaultCredentials(env, timeout=0.3, _token_path=path, _plugins=[("hung", hung)])
    report = explain(BROKER, auth=creds)
    decision = {d.name: d for d in report.decisions}["hung"]
    assert decision.status == "timed out"
    assert LATE in decision.detail
    assert report.selected == "agent-sandbox-token" and report.error is None
    assert not hung.finished.is_set()


def test_a_hung_async_only_plugin_on_the_sync_path(projected_token) -> None:
    path, token = projected_token
    plugin = HungAsync()
    creds = DefaultCredentials(NONE, timeout=0.3, _token_path=path, _plugins=[("hung", plugin)])
    with pytest.warns(CredentialPluginWarning, match="'hung'.*" + re.escape(LATE)):
        assert creds.get_credential(BROKER).token == token
    assert plugin.cancelled.wait(5)  # its helper loop cancels it rather than leave it running


@pytest.mark.asyncio
async def test_hung_plugins_on_the_async_path(hung: Hung, projected_token) -> None:
    path, token = projected_token
    hung_async = HungAsync()
    plugins = [("hung", hung), ("hung-async", hung_async)]
    creds = DefaultCredentials(NONE, timeout=0.3, _token_path=path, _plugins=plugins)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cred = await creds.aget_credential(BROKER)
    assert cred.token == token
    assert not hung.finished.is_set()
    assert hung_async.cancelled.is_set()
    messages = plugin_warnings(caught)
    assert len(messages) == 2 and all(LATE in m for m in messages)


class HonoursTimeout:
    """A well-behaved plugin whose endpoint is slow: it gives up after ``request.timeout``
    seconds itself and says so ("here but broken")."""

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential | None:
        threading.Event().wait(request.timeout)  # the endpoint never answered in time
        raise CredentialSourceError(
            f"the token endpoint did not answer within {request.timeout:g}s", provider="honest"
        )


@pytest.mark.asyncio
async def test_a_plugin_that_honours_the_timeout_reports_its_own_error(projected_token) -> None:
    """The host waits a grace period longer than ``request.timeout``, so the plugin's own
    "here but broken" error wins (discovery stops) rather than a skip."""
    path, _token = projected_token
    plugins = [("honest", HonoursTimeout())]
    for run in ("sync", "async"):
        creds = DefaultCredentials(NONE, timeout=1.0, _token_path=path, _plugins=plugins)
        with pytest.raises(CredentialSourceError, match="endpoint did not answer within 1s"):
            if run == "sync":
                creds.get_credential(BROKER)
            else:
                await creds.aget_credential(BROKER)


class AnswersOnce:
    """A file-backed plugin (called on every request) that answers once, then hangs."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.calls = 0
        self.release = threading.Event()

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential | None:
        self.calls += 1
        if self.calls > 1:
            self.release.wait(10)
        return Credential(self.token, "", file_backed=True, source="once")


@pytest.mark.asyncio
async def test_a_selected_plugin_that_hangs_later_is_an_error(missing_path, mint) -> None:
    plugin = AnswersOnce(mint())
    try:
        creds = DefaultCredentials(
            NONE, timeout=0.3, _token_path=missing_path, _plugins=[("once", plugin)]
        )
        assert creds.get_credential(BROKER).provider == "once"
        with pytest.raises(CredentialSourceError, match=re.escape(LATE)) as info:
            creds.get_credential(BROKER)  # no silent switch to another identity
        assert info.value.provider == "once"
        with pytest.raises(CredentialSourceError, match=re.escape(LATE)):
            await creds.aget_credential(BROKER)
    finally:
        plugin.release.set()


def test_an_installed_plugin_that_sleeps_is_skipped_after_the_timeout(bad, projected_token):
    path, token = projected_token
    creds = DefaultCredentials(
        {"AGENT_SANDBOX_LOAD_PLUGINS": "sleepy"}, timeout=0.5, _token_path=path
    )
    sleepy = importlib.import_module("sbx_bad_plugins.sleepy")
    try:
        with pytest.warns(
            CredentialPluginWarning, match="'sleepy'.*" + re.escape(LATE.replace("0.3", "0.5"))
        ):
            assert creds.get_credential(BROKER).token == token
        assert not sleepy.FINISHED  # discovery ended long before the plugin's 10 s fetch would
    finally:
        sleepy.RELEASE.set()


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), True, "5"])
def test_the_timeout_must_be_a_positive_number_of_seconds(timeout: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="timeout"):
        DefaultCredentials(NONE, timeout=timeout)


# --- the command line -------------------------------------------------------------------


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "k8s_agent_sandbox_awx.cli._cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.e2e
def test_cli_whoami_and_doctor_survive_bad_plugins(bad, broker: Any, no_secret) -> None:
    src = str(Path(k8s_agent_sandbox_awx.__file__).resolve().parents[1])
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AGENT_SANDBOX_") and "proxy" not in k.lower()
    }
    env.update(broker.environ("gitlab"))
    env["PYTHONPATH"] = os.pathsep.join([str(bad), src])
    env["AGENT_SANDBOX_LOAD_PLUGINS"] = "exits,bails,int-token"
    token = env["AGENT_SANDBOX_TOKEN"]

    whoami = _cli(env, "whoami")
    assert whoami.returncode == 0, whoami.stderr
    assert "subject:" in whoami.stdout
    doctor = _cli(env, "doctor")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "PASS  credentials" in doctor.stdout
    assert "provider int-token: shadowed" in doctor.stdout
    for run in (whoami, doctor):
        # each broken plugin is reported once (a warning, not also a log line)
        assert run.stderr.count("entry point 'exits'") == 1, run.stderr
        assert run.stderr.count("entry point 'bails'") == 1, run.stderr
        assert "SystemExit: plugin refuses to start" in run.stderr
        assert "Traceback" not in run.stderr
        # printed as the CLI's own warnings: no file path, line number or source line
        for line in run.stderr.splitlines():
            assert line.startswith(("agent-sandbox-awx: warning: ", "  ")), run.stderr
        assert ".py:" not in run.stderr and "CredentialPluginWarning" not in run.stderr
        no_secret(token, run.stdout, run.stderr)

    # no other source: the int-token plugin is consulted first, and reported, not a crash
    del env["AGENT_SANDBOX_TOKEN"]
    doctor = _cli(env, "doctor")
    assert doctor.returncode == 1
    assert "FAIL  credentials" in doctor.stdout
    assert "CredentialSourceError" in doctor.stdout and "'int-token'" in doctor.stdout
    assert "AttributeError" not in doctor.stdout + doctor.stderr
    assert "Traceback" not in doctor.stderr
