"""The discovery chain: order, "here but broken", selection, caching, the aggregated error,
explain(), and injected (host-registered) plugins."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx import (
    AudienceMismatchError,
    Credential,
    CredentialPluginWarning,
    CredentialRequest,
    CredentialSource,
    CredentialSourceError,
    DefaultCredentials,
    EmptyCredentialError,
    Explanation,
    KubernetesAuth,
    NoCredentialsError,
    OIDCTokenAuth,
    ProviderInfo,
    TokenExpiredError,
    UnreadableCredentialError,
    explain,
    hookimpl,
)

BROKER = "https://sandbox-broker.example"


class FakeProvider:
    """A third-party provider answering from ``environ[variable]``."""

    def __init__(
        self,
        variable: str,
        *,
        priority: int = 0,
        hint: str = "",
        file_backed: bool = False,
        delay: float = 0.0,
    ) -> None:
        self.variable = variable
        self.priority = priority
        self.hint = hint
        self.file_backed = file_backed
        self.delay = delay
        self.calls = 0
        self.lock = threading.Lock()

    @hookimpl
    def agent_sandbox_provider_info(self) -> ProviderInfo:
        return ProviderInfo(priority=self.priority, hint=self.hint, description="fake")

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential | None:
        with self.lock:
            self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        value = request.environ.get(self.variable)
        if value is None:
            return request.not_here(f"{self.variable} is not set")
        if value == "BROKEN":
            raise EmptyCredentialError(f"{self.variable} is broken", provider="fake")
        return Credential(value, "", file_backed=self.file_backed, source=self.variable)


def chain(
    env: dict[str, str], token_path: str, plugins: list[tuple[str, object]] | None = None
) -> DefaultCredentials:
    return DefaultCredentials(env, _token_path=token_path, _plugins=plugins or [])


def test_is_a_credential_source(base_env, missing_path) -> None:
    assert isinstance(chain(base_env, missing_path), CredentialSource)
    assert "custom environment" in repr(chain(base_env, missing_path))


def test_order_is_env_file_third_party_by_priority_then_name_projected(
    base_env, missing_path
) -> None:
    plugins: list[tuple[str, object]] = [
        ("zeta", FakeProvider("Z", priority=5)),
        ("beta", FakeProvider("B", priority=1)),
        ("alpha", FakeProvider("A", priority=1)),
        ("omega", FakeProvider("O", priority=-3)),
    ]
    names = [p.name for p in chain(base_env, missing_path, plugins).registry().providers]
    assert names == [
        "agent-sandbox-token",
        "agent-sandbox-token-file",
        "zeta",
        "alpha",
        "beta",
        "omega",
        "kubernetes-projected",
    ]


def _all_sources(tmp_path: Path, mint) -> tuple[dict[str, str], str, dict[str, str]]:
    tokens = {name: mint(sub=name) for name in ("env", "file", "alpha", "beta", "projected")}
    token_file = tmp_path / "file-token"
    token_file.write_text(tokens["file"])
    projected = tmp_path / "projected-token"
    projected.write_text(tokens["projected"])
    env = {
        "AGENT_SANDBOX_LOAD_PLUGINS": "",
        "AGENT_SANDBOX_TOKEN": tokens["env"],
        "AGENT_SANDBOX_TOKEN_FILE": str(token_file),
        "A": tokens["alpha"],
        "B": tokens["beta"],
    }
    return env, str(projected), tokens


@pytest.mark.parametrize(
    ("remove", "winner"),
    [
        ((), "env"),
        (("AGENT_SANDBOX_TOKEN",), "file"),
        (("AGENT_SANDBOX_TOKEN", "AGENT_SANDBOX_TOKEN_FILE"), "beta"),
        (("AGENT_SANDBOX_TOKEN", "AGENT_SANDBOX_TOKEN_FILE", "B"), "alpha"),
        (("AGENT_SANDBOX_TOKEN", "AGENT_SANDBOX_TOKEN_FILE", "B", "A"), "projected"),
    ],
)
def test_the_first_present_source_wins(tmp_path, mint, remove, winner) -> None:
    env, projected, tokens = _all_sources(tmp_path, mint)
    for name in remove:
        del env[name]
    plugins = [("alpha", FakeProvider("A", priority=1)), ("beta", FakeProvider("B", priority=2))]
    cred = chain(env, projected, plugins).get_credential(BROKER)
    assert cred.token == tokens[winner]


def test_shadowed_sources_are_logged_at_debug_and_explained(tmp_path, mint, caplog) -> None:
    env, projected, tokens = _all_sources(tmp_path, mint)
    plugins = [("alpha", FakeProvider("A")), ("beta", FakeProvider("B"))]
    caplog.set_level(logging.DEBUG, logger="k8s_agent_sandbox_awx")
    chain(env, projected, plugins).get_credential(BROKER)
    shadowed = [r.getMessage() for r in caplog.records if "shadowed" in r.getMessage()]
    assert any("agent-sandbox-token-file" in m for m in shadowed)
    assert any("kubernetes-projected" in m for m in shadowed)
    result = explain(BROKER, auth=chain(env, projected, plugins))
    statuses = {d.name: d.status for d in result.decisions if d.detail[:11] != "not loaded:"}
    assert statuses == {
        "agent-sandbox-token": "selected",
        "agent-sandbox-token-file": "shadowed",
        "alpha": "shadowed",
        "beta": "shadowed",
        "kubernetes-projected": "shadowed",
    }
    assert result.selected == "agent-sandbox-token"
    assert result.claims is not None and result.claims["payload"]["sub"] == "env"
    assert result.error is None
    for token in tokens.values():
        assert token not in str(result) and token not in str(result.to_dict())
        assert token not in caplog.text


def test_here_but_broken_stops_the_chain(tmp_path, mint, missing_path) -> None:
    good = tmp_path / "good"
    good.write_text(mint())
    env = {
        "AGENT_SANDBOX_LOAD_PLUGINS": "",
        "AGENT_SANDBOX_TOKEN": "",  # set but empty: broken
        "AGENT_SANDBOX_TOKEN_FILE": str(good),
    }
    with pytest.raises(EmptyCredentialError, match="AGENT_SANDBOX_TOKEN is set but empty"):
        chain(env, missing_path).get_credential(BROKER)
    env2 = {"AGENT_SANDBOX_LOAD_PLUGINS": "", "B": "BROKEN", "A": mint()}
    plugins = [("alpha", FakeProvider("A", priority=1)), ("beta", FakeProvider("B", priority=2))]
    with pytest.raises(EmptyCredentialError, match="B is broken"):
        chain(env2, str(good), plugins).get_credential(BROKER)
    result = explain(BROKER, auth=chain(env2, str(good), plugins))
    statuses = {d.name: d.status for d in result.decisions}
    assert statuses["beta"] == "error"
    assert statuses["alpha"] == "shadowed"
    assert statuses["kubernetes-projected"] == "shadowed"
    assert isinstance(result.error, EmptyCredentialError)
    assert result.selected is None


def test_a_token_for_another_audience_stops_the_chain(tmp_path, mint) -> None:
    good = tmp_path / "good"
    good.write_text(mint())
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": "", "AGENT_SANDBOX_TOKEN": mint(aud="https://other")}
    with pytest.raises(AudienceMismatchError):
        chain(env, str(good)).get_credential(BROKER)
    result = explain(BROKER, auth=chain(env, str(good)))
    assert result.decisions[0].status == "error"
    assert result.claims is not None and result.claims["payload"]["aud"] == "https://other"
    assert isinstance(result.error, AudienceMismatchError)


def test_aggregated_error_lists_every_provider(base_env, missing_path) -> None:
    plugins = [
        ("alpha", FakeProvider("A", hint="run inside Alpha CI")),
        ("beta", FakeProvider("B")),
    ]
    with pytest.raises(NoCredentialsError) as info:
        chain(base_env, missing_path, plugins).get_credential(BROKER)
    message = str(info.value)
    for expected in (
        "agent-sandbox-token: AGENT_SANDBOX_TOKEN is not set",
        "agent-sandbox-token-file: AGENT_SANDBOX_TOKEN_FILE is not set",
        "alpha: A is not set (to use it: run inside Alpha CI)",
        "beta: B is not set",
        f"kubernetes-projected: {missing_path} does not exist",
        "set AGENT_SANDBOX_TOKEN",
        "set AGENT_SANDBOX_TOKEN_FILE",
        f"at {missing_path}",
        BROKER,
    ):
        assert expected in message
    assert [name for name, _ in info.value.tried] == [
        "agent-sandbox-token",
        "agent-sandbox-token-file",
        "alpha",
        "beta",
        "kubernetes-projected",
    ]


def test_aggregated_error_names_the_default_path(base_env) -> None:
    with pytest.raises(NoCredentialsError) as info:
        DefaultCredentials(base_env).get_credential(BROKER)
    assert "/var/run/secrets/tokens/agent-sandbox-token" in str(info.value)


def test_hint_is_used_when_a_plugin_gives_no_reason(base_env, missing_path) -> None:
    class Silent:
        @hookimpl
        def agent_sandbox_provider_info(self) -> ProviderInfo:
            return ProviderInfo(hint="set SILENT_TOKEN")

        @hookimpl
        def agent_sandbox_get_credential(self, request: CredentialRequest) -> None:
            return None

    with pytest.raises(NoCredentialsError, match=r"silent: not here \(to use it: set SILENT_TOKEN"):
        chain(base_env, missing_path, [("silent", Silent())]).get_credential(BROKER)


def test_file_backed_selection_is_reread_on_every_request(tmp_path, mint, projected) -> None:
    first, second = mint(sub="first"), mint(sub="second")
    stable = projected(tmp_path, first, 1)
    creds = chain({"AGENT_SANDBOX_LOAD_PLUGINS": ""}, str(stable))
    assert creds.get_credential(BROKER).token == first
    projected(tmp_path, second, 2)  # atomic ..data swap between two requests
    assert creds.get_credential(BROKER).token == second
    creds.invalidate(BROKER)
    assert creds.get_credential(BROKER).token == second


def test_token_file_variable_sees_a_rotation(tmp_path, mint, projected, missing_path) -> None:
    first, second = mint(), mint()
    stable = projected(tmp_path, first, 1)
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": "", "AGENT_SANDBOX_TOKEN_FILE": str(stable)}
    creds = chain(env, missing_path)
    assert creds.get_credential(BROKER).token == first
    projected(tmp_path, second, 2)
    assert creds.get_credential(BROKER).token == second


def test_non_file_selection_is_cached_until_invalidated(mint, clock, missing_path) -> None:
    provider = FakeProvider("A")
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": "", "A": mint(ttl=600)}
    creds = chain(env, missing_path, [("alpha", provider)])
    first = creds.get_credential(BROKER)
    assert creds.get_credential(BROKER) is first
    assert provider.calls == 1
    env["A"] = mint(sub="rotated", ttl=600)
    creds.invalidate(BROKER)
    assert creds.get_credential(BROKER).token == env["A"]
    assert provider.calls == 2
    clock.advance(700)
    with pytest.raises(TokenExpiredError):
        creds.get_credential(BROKER)  # the provider still hands out the old token


def test_env_token_is_cached_and_shared_between_default_instances(
    monkeypatch: pytest.MonkeyPatch, mint
) -> None:
    token = mint()
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN", token)
    monkeypatch.setenv("AGENT_SANDBOX_LOAD_PLUGINS", "")
    monkeypatch.delenv("AGENT_SANDBOX_TOKEN_FILE", raising=False)
    a, b = DefaultCredentials(), DefaultCredentials()
    assert a.get_credential(BROKER).token == token
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN", mint(sub="new"))
    assert b.get_credential(BROKER).token == token  # served from the shared cache
    b.invalidate(BROKER)
    assert a.get_credential(BROKER).token != token
    assert repr(a) == "DefaultCredentials(os.environ)"


def test_custom_environments_do_not_share_cache_entries(mint, missing_path) -> None:
    one, two = mint(sub="one"), mint(sub="two")
    base = {"AGENT_SANDBOX_LOAD_PLUGINS": ""}
    a = chain({**base, "AGENT_SANDBOX_TOKEN": one}, missing_path)
    b = chain({**base, "AGENT_SANDBOX_TOKEN": two}, missing_path)
    assert a.get_credential(BROKER).token == one
    assert b.get_credential(BROKER).token == two


def test_selected_provider_that_disappears_is_an_error(tmp_path, mint, missing_path) -> None:
    path = tmp_path / "t"
    path.write_text(mint())
    provider = FakeProvider(str(path), file_backed=True)
    env: dict[str, str] = {"AGENT_SANDBOX_LOAD_PLUGINS": "", str(path): mint()}
    creds = chain(env, missing_path, [("alpha", provider)])
    creds.get_credential(BROKER)
    del env[str(path)]
    with pytest.raises(CredentialSourceError, match="no longer applies"):
        creds.get_credential(BROKER)


def test_32_threads_through_the_chain_cause_one_fetch_per_expiry(mint, clock, missing_path):
    provider = FakeProvider("A", delay=0.05)
    env = {"AGENT_SANDBOX_LOAD_PLUGINS": ""}
    creds = chain(env, missing_path, [("alpha", provider)])

    def wave() -> set[str]:
        env["A"] = mint(now=clock.now, ttl=600)
        barrier = threading.Barrier(32)
        seen: set[str] = set()
        lock = threading.Lock()

        def worker() -> None:
            barrier.wait()
            for _ in range(10):
                token = creds.get_credential(BROKER).token
                with lock:
                    seen.add(token)

        threads = [threading.Thread(target=worker) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return seen

    assert len(wave()) == 1 and provider.calls == 1  # discovery itself is the one fetch
    clock.advance(600)
    assert len(wave()) == 1 and provider.calls == 2
    clock.advance(600)
    assert len(wave()) == 1 and provider.calls == 3


def test_plugin_raising_unexpected_exception(base_env, missing_path, mint, no_secret, caplog):
    token = mint()

    class Crashing:
        @hookimpl
        def agent_sandbox_get_credential(self, request: CredentialRequest) -> None:
            raise KeyError(f"token {token} rejected")

    with pytest.raises(CredentialSourceError, match="KeyError") as info:
        chain(base_env, missing_path, [("crashing", Crashing())]).get_credential(BROKER)
    assert info.value.provider == "crashing"
    no_secret(token, str(info.value), repr(info.value), caplog.text)


def test_plugin_returning_something_else(base_env, missing_path) -> None:
    class Wrong:
        @hookimpl
        def agent_sandbox_get_credential(self, request: CredentialRequest) -> object:
            return "a bare string"

    with pytest.raises(CredentialSourceError, match="returned str"):
        chain(base_env, missing_path, [("wrong", Wrong())]).get_credential(BROKER)


def test_plugin_without_request_argument_and_credential_provider_name(base_env, missing_path):
    class NoArgs:
        @hookimpl
        def agent_sandbox_get_credential(self) -> Credential:
            return Credential("opaque-token-value", "", source="somewhere")

    cred = chain(base_env, missing_path, [("noargs", NoArgs())]).get_credential(BROKER)
    assert cred.provider == "noargs"  # filled in by the host


def test_injected_plugin_with_a_reserved_name_is_refused(base_env, missing_path, mint) -> None:
    env = {**base_env, "A": mint()}
    with pytest.warns(CredentialPluginWarning, match="reserved name"):
        creds = chain(env, missing_path, [("kubernetes-projected", FakeProvider("A"))])
        with pytest.raises(NoCredentialsError):
            creds.get_credential(BROKER)
    decisions = explain(BROKER, auth=creds).decisions
    assert [d.status for d in decisions if d.name == "kubernetes-projected"] == [
        "not here",
        "failed to load",
    ]


def test_invalid_plugins_are_skipped(base_env, missing_path, mint, caplog) -> None:
    class NoHook:
        pass

    class BadInfo:
        @hookimpl
        def agent_sandbox_provider_info(self) -> object:
            return {"priority": 3}

        @hookimpl
        def agent_sandbox_get_credential(self, request: CredentialRequest) -> None:
            return None

    class BadArg:
        @hookimpl
        def agent_sandbox_get_credential(self, audience: str) -> None:
            return None

    plugins = [("nohook", NoHook()), ("badinfo", BadInfo()), ("badarg", BadArg())]
    with pytest.warns(CredentialPluginWarning) as record:
        creds = chain({**base_env, "AGENT_SANDBOX_TOKEN": mint()}, missing_path, plugins)
        creds.get_credential(BROKER)
    assert len(record) == 3
    failed = {d.name: d.detail for d in explain(BROKER, auth=creds).decisions}
    assert "implements neither agent_sandbox_get_credential" in failed["nohook"]
    assert "returned dict, not ProviderInfo" in failed["badinfo"]
    assert "PluginValidationError" in failed["badarg"]
    # reported once, as a warning: not also as a log record (a user would see it twice)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_explain_report_and_dict(base_env, missing_path, mint) -> None:
    token = mint()
    result = explain(BROKER, auth=chain({**base_env, "AGENT_SANDBOX_TOKEN": token}, missing_path))
    assert isinstance(result, Explanation)
    text = str(result)
    assert "Selected: agent-sandbox-token" in text
    assert "payload.sub = 'system:serviceaccount:team:agent'" in text
    data = result.to_dict()
    assert data["selected"] == "agent-sandbox-token"
    assert data["error"] is None
    assert data["decisions"][0] == {
        "name": "agent-sandbox-token",
        "status": "selected",
        "detail": "AGENT_SANDBOX_TOKEN; JWT; cached until shortly before exp",
    }
    assert token not in text and token not in repr(data)
    assert token.rsplit(".", 1)[1] not in text  # no signature


def test_explain_without_credentials(base_env, missing_path) -> None:
    result = explain(BROKER, auth=chain(base_env, missing_path))
    assert result.selected is None
    assert isinstance(result.error, NoCredentialsError)
    assert {d.status for d in result.decisions} == {"not here"}
    assert result.to_dict()["error"]["type"] == "NoCredentialsError"
    assert "Error: NoCredentialsError" in str(result)


def test_explain_default_environment(monkeypatch: pytest.MonkeyPatch, mint) -> None:
    token = mint()
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN", token)
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = explain(BROKER)
    assert result.selected == "agent-sandbox-token"
    result = explain(BROKER, environ={"AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert result.decisions[0].status == "not here"


def test_explain_explicit_sources(tmp_path, mint) -> None:
    path = tmp_path / "t"
    path.write_text(mint())
    result = explain(BROKER, auth=KubernetesAuth(path))
    assert result.selected == "KubernetesAuth"
    assert result.decisions[0].detail.startswith("explicit auth=")
    assert result.claims is not None
    result = explain(BROKER, auth=OIDCTokenAuth(mint(aud="https://other")))
    assert result.selected is None
    assert result.decisions[0].status == "error"
    assert isinstance(result.error, AudienceMismatchError)
    result = explain(BROKER, auth=OIDCTokenAuth("opaque-value-123"))
    assert result.selected == "OIDCTokenAuth" and result.claims is None


def test_explicit_file_source_missing(tmp_path) -> None:
    with pytest.raises(UnreadableCredentialError):
        KubernetesAuth(tmp_path / "nothing").get_credential(BROKER)


def test_request_repr_hides_the_environment(mint) -> None:
    token = mint()
    request = CredentialRequest(BROKER, {"AGENT_SANDBOX_TOKEN": token})
    assert token not in repr(request)
    assert request.not_here("x") is None


def test_ctrl_c_right_after_a_flight_is_registered_does_not_hang_the_next_fetch(
    mint, clock, monkeypatch
) -> None:
    """Ctrl-C can land between any two bytecodes: here after the thread registered its flight
    and before its ``with`` could end it. The next fetch on that thread (the cleanup after
    Ctrl-C: a rollback, a kill) must not wait forever for that dead flight; it fetches."""
    from k8s_agent_sandbox_awx.credentials import _cache

    calls = []
    token = mint(now=clock.now, ttl=600)
    auth = OIDCTokenAuth(lambda: calls.append(1) or token)
    enter = _cache._Lead.__enter__
    interrupted = []

    def interrupt_once(self):
        if not interrupted:
            interrupted.append(True)
            raise KeyboardInterrupt  # as if SIGINT arrived right here
        return enter(self)

    monkeypatch.setattr(_cache._Lead, "__enter__", interrupt_once)
    outcome: list[object] = []

    def caller() -> None:  # one thread, as the CLI's main thread
        try:
            auth.get_credential(BROKER)
        except KeyboardInterrupt:
            outcome.append("interrupted")
        outcome.append(auth.get_credential(BROKER).token)

    thread = threading.Thread(target=caller, daemon=True)
    thread.start()
    thread.join(20)  # a bound for a deadlock, not a speed check
    assert not thread.is_alive(), "the fetch after Ctrl-C waits for a flight that never ends"
    assert outcome == ["interrupted", token] and len(calls) == 1


def test_a_file_source_read_again_is_checked_again(tmp_path, mint, projected, clock) -> None:
    """An unchanged file gives the same credential (its text and audience passed already) until
    the token expires; a changed file's token is checked afresh."""
    first = mint(ttl=600)
    stable = projected(tmp_path, first, 1)
    creds = chain({"AGENT_SANDBOX_LOAD_PLUGINS": ""}, str(stable))
    assert creds.get_credential(BROKER).token == first  # discovery: the provider selected
    credential = creds.get_credential(BROKER)  # the file read again, checked
    assert credential.token == first
    assert creds.get_credential(BROKER) is credential
    projected(tmp_path, mint(aud="https://other.example", ttl=600), 2)
    with pytest.raises(AudienceMismatchError):
        creds.get_credential(BROKER)
    projected(tmp_path, first, 3)
    assert creds.get_credential(BROKER) is credential  # the same answer as accepted before
    clock.advance(700)
    with pytest.raises(TokenExpiredError):
        creds.get_credential(BROKER)
