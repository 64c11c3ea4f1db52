"""Secrets never leak: for every provider and every error path, the token is absent from
repr(), str(), exception messages and args, log records (DEBUG included), warnings and explain()."""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx import (
    Credential,
    CredentialError,
    CredentialRequest,
    CredentialSource,
    DefaultCredentials,
    KubernetesAuth,
    OIDCTokenAuth,
    ProviderInfo,
    explain,
    hookimpl,
)

BROKER = "https://sandbox-broker.example"
OTHER = "https://other-service.example"

Scenario = Callable[[Path, Callable[..., str]], tuple[CredentialSource, str]]


class TokenPlugin:
    def __init__(self, token: str, *, fail: bool = False, fail_info: bool = False) -> None:
        self.token, self.fail, self.fail_info = token, fail, fail_info

    @hookimpl
    def agent_sandbox_provider_info(self) -> ProviderInfo:
        if self.fail_info:
            raise RuntimeError(f"cannot describe myself, token was {self.token}")
        return ProviderInfo()

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential | None:
        if self.fail:
            raise ValueError(f"endpoint rejected {self.token}")
        return Credential(self.token, "token-plugin", source="https://issuer.example/token")


class AsyncTokenPlugin:
    def __init__(self, token: str, *, fail: bool = False) -> None:
        self.token, self.fail = token, fail

    @hookimpl
    async def agent_sandbox_get_credential_async(
        self, request: CredentialRequest
    ) -> Credential | None:
        if self.fail:
            raise ValueError(f"endpoint rejected {self.token}")
        return Credential(self.token, "async-plugin", source="https://issuer.example/token")


async def _leaky_fetch(token: str) -> str:
    raise OSError(f"denied for {token}")


def _file(tmp: Path, token: str) -> str:
    path = tmp / "token"
    path.write_text(token + "\n")
    return str(path)


def _chain(tmp: Path, env: dict[str, str], plugins=None, path: str | None = None):
    return DefaultCredentials(
        {"AGENT_SANDBOX_LOAD_PLUGINS": "", **env},
        _token_path=path or str(tmp / "missing" / "token"),
        _plugins=plugins or [],
    )


SCENARIOS: dict[str, Scenario] = {
    "env ok": lambda t, m: (_chain(t, {"AGENT_SANDBOX_TOKEN": (tok := m())}), tok),
    "env wrong audience": lambda t, m: (
        _chain(t, {"AGENT_SANDBOX_TOKEN": (tok := m(aud=OTHER))}),
        tok,
    ),
    "env expired": lambda t, m: (
        _chain(t, {"AGENT_SANDBOX_TOKEN": (tok := m(now=1_000_000_000))}),
        tok,
    ),
    "env malformed jwt": lambda t, m: (
        _chain(t, {"AGENT_SANDBOX_TOKEN": (tok := "eyJsecretheader.c2VjcmV0cGF5bG9hZA.sig")}),
        tok,
    ),
    "env with whitespace": lambda t, m: (
        _chain(t, {"AGENT_SANDBOX_TOKEN": "opaque-secret-1 opaque-secret-2"}),
        "opaque-secret-1",
    ),
    "token file ok": lambda t, m: (
        _chain(t, {"AGENT_SANDBOX_TOKEN_FILE": _file(t, tok := m())}),
        tok,
    ),
    "token file wrong audience": lambda t, m: (
        _chain(t, {"AGENT_SANDBOX_TOKEN_FILE": _file(t, tok := m(aud=OTHER))}),
        tok,
    ),
    "token file expired": lambda t, m: (
        _chain(t, {"AGENT_SANDBOX_TOKEN_FILE": _file(t, tok := m(now=1_000_000_000))}),
        tok,
    ),
    "projected ok": lambda t, m: (_chain(t, {}, path=_file(t, tok := m())), tok),
    "projected wrong audience": lambda t, m: (
        _chain(t, {}, path=_file(t, tok := m(aud=OTHER))),
        tok,
    ),
    "projected malformed": lambda t, m: (
        _chain(t, {}, path=_file(t, tok := "eyJ" + "s3cr3t" * 10 + ".x.y")),
        tok,
    ),
    "plugin ok": lambda t, m: (_chain(t, {}, [("token-plugin", TokenPlugin(tok := m()))]), tok),
    "plugin wrong audience": lambda t, m: (
        _chain(t, {}, [("token-plugin", TokenPlugin(tok := m(aud=OTHER)))]),
        tok,
    ),
    "plugin raises with the token in its message": lambda t, m: (
        _chain(t, {}, [("token-plugin", TokenPlugin(tok := m(), fail=True))]),
        tok,
    ),
    "plugin fails to load with the token in its message": lambda t, m: (
        _chain(
            t,
            {"AGENT_SANDBOX_TOKEN": (tok := m())},
            [("token-plugin", TokenPlugin(tok, fail_info=True))],
        ),
        tok,
    ),
    "opaque plugin token in the message": lambda t, m: (
        _chain(
            t,
            {"AGENT_SANDBOX_TOKEN": (tok := "opaque-env-secret-value")},
            [("token-plugin", TokenPlugin(tok, fail=True))],
        ),
        tok,
    ),
    "KubernetesAuth ok": lambda t, m: (KubernetesAuth(_file(t, tok := m())), tok),
    "KubernetesAuth wrong audience": lambda t, m: (
        KubernetesAuth(_file(t, tok := m(aud=OTHER))),
        tok,
    ),
    "KubernetesAuth expired": lambda t, m: (
        KubernetesAuth(_file(t, tok := m(now=1_000_000_000))),
        tok,
    ),
    "OIDCTokenAuth string ok": lambda t, m: (OIDCTokenAuth(tok := m()), tok),
    "OIDCTokenAuth string wrong audience": lambda t, m: (OIDCTokenAuth(tok := m(aud=OTHER)), tok),
    "OIDCTokenAuth callable ok": lambda t, m: (OIDCTokenAuth(lambda: tok), tok := m()),
    "OIDCTokenAuth callable raises": lambda t, m: (
        OIDCTokenAuth(lambda: (_ for _ in ()).throw(OSError(f"denied for {tok}"))),
        tok := m(),
    ),
    "OIDCTokenAuth.from_env wrong audience": lambda t, m: (
        OIDCTokenAuth.from_env("X", environ={"X": (tok := m(aud=OTHER))}),
        tok,
    ),
    "async plugin ok": lambda t, m: (
        _chain(t, {}, [("async-plugin", AsyncTokenPlugin(tok := m()))]),
        tok,
    ),
    "async plugin wrong audience": lambda t, m: (
        _chain(t, {}, [("async-plugin", AsyncTokenPlugin(tok := m(aud=OTHER)))]),
        tok,
    ),
    "async plugin raises with the token in its message": lambda t, m: (
        _chain(t, {}, [("async-plugin", AsyncTokenPlugin(tok := m(), fail=True))]),
        tok,
    ),
    "OIDCTokenAuth async callable ok": lambda t, m: (
        OIDCTokenAuth(lambda: asyncio.sleep(0, result=tok)),
        tok := m(),
    ),
    "OIDCTokenAuth async callable raises": lambda t, m: (
        OIDCTokenAuth(lambda: _leaky_fetch(tok)),
        tok := m(),
    ),
}


@pytest.mark.parametrize("path", ["sync", "async"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_no_secret_anywhere(name: str, path: str, tmp_path: Path, mint, no_secret, caplog) -> None:
    """Each scenario on the sync path (``get_credential``) and on the async path
    (``aget_credential``, on a fresh event loop)."""
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        source, token = SCENARIOS[name](tmp_path, mint)
        texts += [repr(source), str(source)]
        for _ in range(2):  # discovery, then the per-request path
            try:
                if path == "sync":
                    credential = source.get_credential(BROKER)
                else:
                    credential = asyncio.run(source.aget_credential(BROKER))
            except CredentialError as exc:
                texts += [str(exc), repr(exc), repr(exc.args), exc.provider, exc.source]
                assert exc.__cause__ is None or token not in str(exc.__cause__)
                assert exc.__context__ is None or token not in str(exc.__context__)
            else:
                assert credential.token == token
                texts += [repr(credential), str(credential), f"{credential}"]
        source.invalidate(BROKER)
        result = explain(BROKER, auth=source)
        texts += [str(result), repr(result.to_dict())]
        texts += [repr(d) for d in result.decisions]
    texts += [str(w.message) for w in caught]
    texts.append(caplog.text)
    texts += [repr(r.args) for r in caplog.records]
    no_secret(token, *texts)
