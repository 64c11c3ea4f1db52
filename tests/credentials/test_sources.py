"""Built-in providers and explicit sources: KubernetesAuth, OIDCTokenAuth, the automount rule."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import (
    AudienceMismatchError,
    CredentialRequest,
    CredentialSource,
    CredentialSourceError,
    EmptyCredentialError,
    ForbiddenTokenSourceError,
    KubernetesAuth,
    MalformedTokenError,
    NoCredentialsError,
    OIDCTokenAuth,
    TokenExpiredError,
    UnreadableCredentialError,
)
from k8s_agent_sandbox_awx.credentials._providers import (
    EnvTokenProvider,
    ProjectedTokenProvider,
    TokenFileProvider,
    read_token_file,
)

BROKER = "https://sandbox-broker.example"


def _request(environ: dict[str, str]) -> CredentialRequest:
    return CredentialRequest(BROKER, environ)


# --- AGENT_SANDBOX_TOKEN --------------------------------------------------------------------


def test_env_provider_not_here_when_unset() -> None:
    request = _request({})
    assert EnvTokenProvider().agent_sandbox_get_credential(request) is None
    assert request.reasons == ("AGENT_SANDBOX_TOKEN is not set",)


def test_env_provider_returns_a_cached_kind_credential(mint) -> None:
    token = mint()
    cred = EnvTokenProvider().agent_sandbox_get_credential(
        _request({"AGENT_SANDBOX_TOKEN": token + "\n"})
    )
    assert cred is not None
    assert (cred.token, cred.provider, cred.file_backed, cred.source) == (
        token,
        "agent-sandbox-token",
        False,
        "AGENT_SANDBOX_TOKEN",
    )


@pytest.mark.parametrize("value", ["", "   "])
def test_env_provider_set_but_empty_is_an_error(value: str) -> None:
    with pytest.raises(EmptyCredentialError, match="AGENT_SANDBOX_TOKEN is set but empty"):
        EnvTokenProvider().agent_sandbox_get_credential(_request({"AGENT_SANDBOX_TOKEN": value}))


# --- AGENT_SANDBOX_TOKEN_FILE ---------------------------------------------------------------


def test_token_file_provider(tmp_path: Path, mint) -> None:
    token = mint()
    path = tmp_path / "t"
    path.write_text(token + "\n")
    request = _request({"AGENT_SANDBOX_TOKEN_FILE": str(path)})
    cred = TokenFileProvider().agent_sandbox_get_credential(request)
    assert cred is not None and cred.token == token and cred.file_backed
    assert cred.source == str(path)


def test_token_file_provider_not_here_when_unset() -> None:
    request = _request({})
    assert TokenFileProvider().agent_sandbox_get_credential(request) is None
    assert request.reasons == ("AGENT_SANDBOX_TOKEN_FILE is not set",)


def test_token_file_provider_errors(tmp_path: Path) -> None:
    provider = TokenFileProvider()
    with pytest.raises(EmptyCredentialError, match="AGENT_SANDBOX_TOKEN_FILE is set but empty"):
        provider.agent_sandbox_get_credential(_request({"AGENT_SANDBOX_TOKEN_FILE": ""}))
    missing = str(tmp_path / "missing")
    with pytest.raises(UnreadableCredentialError, match="does not exist") as info:
        provider.agent_sandbox_get_credential(_request({"AGENT_SANDBOX_TOKEN_FILE": missing}))
    assert missing in str(info.value)
    with pytest.raises(UnreadableCredentialError, match="cannot be read"):
        provider.agent_sandbox_get_credential(
            _request({"AGENT_SANDBOX_TOKEN_FILE": str(tmp_path)})  # a directory
        )
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(EmptyCredentialError, match="is empty"):
        provider.agent_sandbox_get_credential(_request({"AGENT_SANDBOX_TOKEN_FILE": str(empty)}))
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe token")
    with pytest.raises(MalformedTokenError, match="non-ASCII"):
        provider.agent_sandbox_get_credential(_request({"AGENT_SANDBOX_TOKEN_FILE": str(binary)}))
    big = tmp_path / "big"
    big.write_text("x" * (70 * 1024))
    with pytest.raises(MalformedTokenError, match="larger than"):
        provider.agent_sandbox_get_credential(_request({"AGENT_SANDBOX_TOKEN_FILE": str(big)}))


# --- the automounted ServiceAccount token -----------------------------------------------------

AUTOMOUNTED = [
    "/var/run/secrets/kubernetes.io/serviceaccount/token",
    "/run/secrets/kubernetes.io/serviceaccount/token",
    "/var/run/secrets/kubernetes.io/serviceaccount/..data/token",
    "/var/run/secrets/kubernetes.io/serviceaccount/../serviceaccount/token",
]


@pytest.mark.parametrize("path", AUTOMOUNTED)
def test_automounted_token_is_refused_by_kubernetes_auth(path: str) -> None:
    with pytest.raises(ForbiddenTokenSourceError) as info:
        KubernetesAuth(path)
    message = str(info.value)
    assert "API server" in message and "projected" in message and "audience" in message


@pytest.mark.parametrize(
    ("path", "refused"),
    [
        ("/var/run/secrets/kubernetes.io/serviceaccount", True),
        ("/run/secrets/kubernetes.io/serviceaccount/", True),
        ("/var/run/secrets/kubernetes.io/serviceaccount//token", True),
        ("/var/run/secrets/kubernetes.io/serviceaccount2/token", False),
        ("/var/run/secrets/kubernetes.io/serviceaccount-token", False),
        ("/var/run/secrets/kubernetes.io/token", False),
    ],
)
def test_the_automount_rule_is_the_directory_and_what_is_in_it(path: str, refused: bool) -> None:
    from k8s_agent_sandbox_awx.credentials import _providers

    assert _providers._is_automounted(path) is refused
    assert _providers._under_forbidden_dir(os.path.abspath(path)) is refused


@pytest.mark.parametrize("path", AUTOMOUNTED)
def test_automounted_token_is_refused_by_token_file_variable(path: str) -> None:
    with pytest.raises(ForbiddenTokenSourceError, match="AGENT_SANDBOX_TOKEN_FILE"):
        TokenFileProvider().agent_sandbox_get_credential(
            _request({"AGENT_SANDBOX_TOKEN_FILE": path})
        )


def test_symlink_into_the_automount_directory_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "innocent-token"
    os.symlink("/var/run/secrets/kubernetes.io/serviceaccount/token", link)
    with pytest.raises(ForbiddenTokenSourceError):
        KubernetesAuth(link)
    with pytest.raises(ForbiddenTokenSourceError):
        TokenFileProvider().agent_sandbox_get_credential(
            _request({"AGENT_SANDBOX_TOKEN_FILE": str(link)})
        )
    with pytest.raises(ForbiddenTokenSourceError):
        ProjectedTokenProvider(str(link))


def test_relative_path_into_the_automount_directory_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir("/")
    with pytest.raises(ForbiddenTokenSourceError):
        KubernetesAuth("var/run/secrets/kubernetes.io/serviceaccount/token")


# --- the default projected path ----------------------------------------------------------------


def test_projected_provider_not_here_when_missing(missing_path: str, tmp_path: Path) -> None:
    request = _request({})
    assert ProjectedTokenProvider(missing_path).agent_sandbox_get_credential(request) is None
    assert request.reasons == (f"{missing_path} does not exist",)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    request = _request({})
    provider = ProjectedTokenProvider(str(a_file / "token"))  # parent is a file
    assert provider.agent_sandbox_get_credential(request) is None


def test_projected_provider_present_but_broken(tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("")
    with pytest.raises(EmptyCredentialError):
        ProjectedTokenProvider(str(empty)).agent_sandbox_get_credential(_request({}))
    with pytest.raises(UnreadableCredentialError):
        ProjectedTokenProvider(str(tmp_path)).agent_sandbox_get_credential(_request({}))


# --- KubernetesAuth ------------------------------------------------------------------------------


def test_kubernetes_auth_reads_the_file_on_every_request(tmp_path: Path, mint) -> None:
    path = tmp_path / "token"
    first, second = mint(), mint()
    path.write_text(first)
    auth = KubernetesAuth(path)
    assert isinstance(auth, CredentialSource)
    assert auth.get_credential(BROKER).token == first
    path.write_text(second)
    assert auth.get_credential(BROKER).token == second
    auth.invalidate(BROKER)  # a no-op for files
    assert auth.get_credential(BROKER).file_backed


def test_kubernetes_auth_sees_an_atomic_data_symlink_swap(tmp_path: Path, mint, projected) -> None:
    first, second = mint(), mint()
    stable = projected(tmp_path, first, 1)
    auth = KubernetesAuth(stable)
    assert auth.get_credential(BROKER).token == first
    projected(tmp_path, second, 2)  # the kubelet rotates between two requests
    assert auth.get_credential(BROKER).token == second
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("..2030")]) == 1


def test_kubernetes_auth_errors(tmp_path: Path, mint, no_secret) -> None:
    with pytest.raises(UnreadableCredentialError, match="does not exist"):
        KubernetesAuth(tmp_path / "missing").get_credential(BROKER)
    path = tmp_path / "token"
    token = mint(aud="https://kubernetes.default.svc")
    path.write_text(token)
    with pytest.raises(AudienceMismatchError) as info:
        KubernetesAuth(path).get_credential(BROKER)
    no_secret(token, str(info.value), repr(info.value))
    assert repr(KubernetesAuth(path)) == f"KubernetesAuth({str(path)!r})"


# --- OIDCTokenAuth -------------------------------------------------------------------------------


def test_oidc_token_auth_static_string(mint, clock) -> None:
    token = mint(ttl=600)
    auth = OIDCTokenAuth(token)
    assert auth.get_credential(BROKER).token == token
    assert token not in repr(auth)
    with pytest.raises(AudienceMismatchError):
        auth.get_credential("https://other.example")
    clock.advance(700)
    with pytest.raises(TokenExpiredError):
        auth.get_credential(BROKER)
    with pytest.raises(EmptyCredentialError):
        OIDCTokenAuth("  ")
    with pytest.raises(TypeError):
        OIDCTokenAuth(42)  # type: ignore[arg-type]


def test_oidc_token_auth_zero_arg_callable_is_cached(mint, clock) -> None:
    calls: list[int] = []

    def fetch() -> str:
        calls.append(1)
        return mint(now=clock.now, ttl=600)

    auth = OIDCTokenAuth(fetch)
    first = auth.get_credential(BROKER)
    assert auth.get_credential(BROKER) is first
    assert len(calls) == 1
    clock.advance(600 - 60 - 1)  # just before exp - margin
    assert auth.get_credential(BROKER) is first
    clock.advance(2)  # past the deadline
    assert auth.get_credential(BROKER) is not first
    assert len(calls) == 2
    auth.invalidate(BROKER)
    auth.get_credential(BROKER)
    assert len(calls) == 3


def test_oidc_token_auth_callable_receives_the_audience(mint) -> None:
    seen: list[str] = []

    def fetch(audience: str) -> str:
        seen.append(audience)
        return mint(aud=audience)

    auth = OIDCTokenAuth(fetch)
    auth.get_credential(BROKER)
    auth.get_credential("https://second-broker.example")
    assert seen == [BROKER, "https://second-broker.example"]


def test_explicit_instances_do_not_share_cache_entries(mint) -> None:
    a_token, b_token = mint(sub="a"), mint(sub="b")
    a = OIDCTokenAuth(lambda: a_token)
    b = OIDCTokenAuth(lambda: b_token)
    assert a.get_credential(BROKER).token == a_token
    assert b.get_credential(BROKER).token == b_token
    a.invalidate(BROKER)
    assert b.get_credential(BROKER).token == b_token


def test_oidc_token_auth_from_env(mint) -> None:
    token = mint()
    env = {"MY_ID_TOKEN": token}
    auth = OIDCTokenAuth.from_env("MY_ID_TOKEN", environ=env)
    assert auth.get_credential(BROKER).token == token
    assert "MY_ID_TOKEN" in repr(auth) and token not in repr(auth)
    env["MY_ID_TOKEN"] = mint()
    assert auth.get_credential(BROKER).token == token  # cached until invalidated
    auth.invalidate(BROKER)
    assert auth.get_credential(BROKER).token == env["MY_ID_TOKEN"]
    with pytest.raises(NoCredentialsError, match="MY_OTHER is not set"):
        OIDCTokenAuth.from_env("MY_OTHER", environ={}).get_credential(BROKER)
    with pytest.raises(EmptyCredentialError, match="MY_ID_TOKEN is set but empty"):
        OIDCTokenAuth.from_env("MY_ID_TOKEN", environ={"MY_ID_TOKEN": ""}).get_credential(BROKER)


def test_oidc_token_auth_from_os_environ(monkeypatch: pytest.MonkeyPatch, mint) -> None:
    token = mint()
    monkeypatch.setenv("K8S_SBX_TEST_ID_TOKEN", token)
    assert OIDCTokenAuth.from_env("K8S_SBX_TEST_ID_TOKEN").get_credential(BROKER).token == token


def test_oidc_token_auth_callable_failures(mint, no_secret, caplog) -> None:
    token = mint()

    def leaky() -> str:
        raise RuntimeError(f"upstream said no to {token}")

    with pytest.raises(CredentialSourceError, match="RuntimeError") as info:
        OIDCTokenAuth(leaky).get_credential(BROKER)
    assert info.value.__cause__ is None
    no_secret(token, str(info.value), repr(info.value), caplog.text)
    with pytest.raises(NoCredentialsError, match="returned None"):
        OIDCTokenAuth(lambda: None).get_credential(BROKER)  # type: ignore[arg-type,return-value]
    with pytest.raises(CredentialSourceError, match="returned int"):
        OIDCTokenAuth(lambda: 5).get_credential(BROKER)  # type: ignore[arg-type,return-value]
    with pytest.raises(MalformedTokenError):
        OIDCTokenAuth(lambda: "eyJ.broken.token").get_credential(BROKER)


def test_32_threads_cause_one_fetch_per_expiry(mint, clock) -> None:
    fetches: list[float] = []
    lock = threading.Lock()

    def fetch() -> str:
        with lock:
            fetches.append(clock.now)
        time.sleep(0.05)  # a slow token endpoint widens the race
        return mint(now=clock.now, ttl=600)

    auth = OIDCTokenAuth(fetch)

    def wave() -> set[str]:
        barrier = threading.Barrier(32)
        tokens: list[str] = []

        def worker() -> None:
            barrier.wait()
            for _ in range(20):
                cred = auth.get_credential(BROKER)
                with lock:
                    tokens.append(cred.token)

        threads = [threading.Thread(target=worker) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(tokens) == 32 * 20
        return set(tokens)

    assert len(wave()) == 1
    assert len(fetches) == 1
    assert len(wave()) == 1  # still valid: no fetch
    assert len(fetches) == 1
    clock.advance(600)  # past exp - margin
    assert len(wave()) == 1
    assert len(fetches) == 2
    clock.advance(600)
    assert len(wave()) == 1
    assert len(fetches) == 3


def test_a_symlink_re_pointed_into_the_automount_directory_is_refused_on_the_next_read(
    tmp_path: Path, mint: Any
) -> None:
    """File sources are re-read on every request, so the automount rule is checked on every
    read too: a symlink that pointed at a good token and now points at the automounted one is
    refused (not passed on the strength of an earlier check)."""
    good = tmp_path / "good-token"
    good.write_text(mint())
    link = tmp_path / "token"
    os.symlink(good, link)
    kubernetes_auth = KubernetesAuth(link)
    projected_provider = ProjectedTokenProvider(str(link))
    file_request = _request({"AGENT_SANDBOX_TOKEN_FILE": str(link)})
    assert kubernetes_auth.get_credential(BROKER).token == good.read_text()
    assert projected_provider.agent_sandbox_get_credential(_request({})) is not None
    assert TokenFileProvider().agent_sandbox_get_credential(file_request) is not None
    os.unlink(link)
    os.symlink("/var/run/secrets/kubernetes.io/serviceaccount/token", link)
    with pytest.raises(ForbiddenTokenSourceError):
        kubernetes_auth.get_credential(BROKER)
    with pytest.raises(ForbiddenTokenSourceError):
        projected_provider.agent_sandbox_get_credential(_request({}))
    with pytest.raises(ForbiddenTokenSourceError):
        TokenFileProvider().agent_sandbox_get_credential(file_request)


def test_a_relative_path_is_checked_against_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mint: Any
) -> None:
    relative = "var/run/secrets/kubernetes.io/serviceaccount/token"
    (tmp_path / relative).parent.mkdir(parents=True)
    (tmp_path / relative).write_text(mint())
    monkeypatch.chdir(tmp_path)  # a harmless file under the current directory
    request = _request({"AGENT_SANDBOX_TOKEN_FILE": relative})
    assert TokenFileProvider().agent_sandbox_get_credential(request) is not None
    monkeypatch.chdir("/")  # the same string now names the automounted token
    with pytest.raises(ForbiddenTokenSourceError):
        TokenFileProvider().agent_sandbox_get_credential(request)


def test_the_file_actually_opened_is_checked_not_only_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mint: Any
) -> None:
    """The automount rule holds for what ``open`` reached, so a link re-pointed between the
    path check and the open (a race a ``realpath`` before opening cannot close) is refused."""
    from k8s_agent_sandbox_awx.credentials import _providers

    automount = tmp_path / "serviceaccount"
    automount.mkdir()
    (automount / "token").write_text(mint())
    forbidden = (frozenset({str(automount)}), (str(automount) + os.sep,))
    monkeypatch.setattr(_providers, "_forbidden_dirs", lambda: forbidden)
    link = tmp_path / "elsewhere" / "token"
    link.parent.mkdir()
    os.symlink(automount / "token", link)
    with pytest.raises(ForbiddenTokenSourceError, match="automounted ServiceAccount"):
        read_token_file(str(link), provider="p", source="s", missing_ok=False)
    # Even when the path-based check is fooled (the race), the opened file is refused.
    monkeypatch.setattr(_providers, "check_not_automounted", lambda *a, **k: None)
    monkeypatch.setattr(_providers, "_is_automounted", lambda path: False)
    with pytest.raises(ForbiddenTokenSourceError, match="automounted ServiceAccount"):
        read_token_file(str(link), provider="p", source="s", missing_ok=False)
    # A harmless file next to it is read as usual.
    (link.parent / "good").write_text("opaque-token")
    assert read_token_file(str(link.parent / "good"), provider="p", source="s", missing_ok=False)


def test_the_opened_file_is_checked_once_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mint: Any
) -> None:
    """The file found outside the automount directories is known again by its ``fstat`` (no
    ``readlink`` at every read); a new file (a rotation, a re-pointed link) or other automount
    directories are checked again, and a file that has become forbidden is refused."""
    from k8s_agent_sandbox_awx.credentials import _providers

    resolved: list[int] = []
    real = _providers._opened_path
    monkeypatch.setattr(
        _providers, "_opened_path", lambda fd, path: resolved.append(fd) or real(fd, path)
    )
    good = tmp_path / "good" / "token"
    good.parent.mkdir()
    good.write_text(mint())
    for _ in range(3):
        assert read_token_file(str(good), provider="p", source="s", missing_ok=False)
    assert len(resolved) == 1
    replacement = tmp_path / "good" / "new"
    replacement.write_text(mint(sub="rotated"))
    os.replace(replacement, good)  # a new file at the same path: checked again
    assert read_token_file(str(good), provider="p", source="s", missing_ok=False)
    assert len(resolved) == 2
    forbidden = (frozenset({str(good.parent)}), (str(good.parent) + os.sep,))
    monkeypatch.setattr(_providers, "_forbidden_dirs", lambda: forbidden)
    monkeypatch.setattr(_providers, "_under_forbidden_dir", lambda c: c.startswith(forbidden[1]))
    link = tmp_path / "link"
    os.symlink(good, link)  # the path looks harmless; the same file is now in a forbidden dir
    with pytest.raises(ForbiddenTokenSourceError, match="automounted ServiceAccount"):
        read_token_file(str(link), provider="p", source="s", missing_ok=False)
    assert len(resolved) == 3
