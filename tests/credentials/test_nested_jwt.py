"""A JWT whose claims are deeply nested JSON is a MalformedTokenError on every path (issue 10,
item 7): never a RecursionError, whatever the caller's stack depth, and never with the token in
the message."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx import (
    Credential,
    CredentialRequest,
    DefaultCredentials,
    KubernetesAuth,
    MalformedTokenError,
    OIDCTokenAuth,
    explain,
    hookimpl,
)
from k8s_agent_sandbox_awx.credentials._jwt import MAX_CLAIM_DEPTH, decode_token

BROKER = "https://sandbox-broker.example"


def _seg(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def nested_jwt(depth: int) -> str:
    """A JWT-shaped token whose payload holds ``depth`` nested arrays (13 KB for 6,500)."""
    payload = f'{{"aud":"{BROKER}","exp":1900003600,"n":{"[" * depth}{"]" * depth}}}'
    header = _seg(json.dumps({"alg": "RS256", "typ": "JWT"}).encode())
    return f"{header}.{_seg(payload.encode())}.c2lnbmF0dXJlLW5vdC1jaGVja2Vk"


DEEP = nested_jwt(13_000)  # json.loads alone raises RecursionError


def _at_stack_depth(frames: int, call: Callable[[], object]) -> object:
    """Call ``call`` with ``frames`` more frames on the stack (how deep the caller already is
    must not decide whether a token decodes)."""
    if frames:
        return _at_stack_depth(frames - 1, call)
    return call()


@pytest.mark.parametrize("depth", [13_000, 900, MAX_CLAIM_DEPTH + 1])
def test_deeply_nested_claims_are_malformed(depth: int, no_secret) -> None:
    token = nested_jwt(depth)
    for frames in (0, 300):
        with pytest.raises(MalformedTokenError, match="nested") as info:
            _at_stack_depth(frames, lambda: decode_token(token, provider="p", source="s"))
        no_secret(token, str(info.value), repr(info.value))
        assert info.value.__cause__ is None and info.value.__context__ is None


def test_claims_nested_up_to_the_limit_decode() -> None:
    decoded = decode_token(nested_jwt(MAX_CLAIM_DEPTH - 1))
    assert decoded is not None and decoded.audiences == (BROKER,)


@pytest.mark.parametrize(
    ("claims", "why"),
    [
        (f'{{"aud":"{BROKER}","exp":1{"0" * 400}}}', "'exp' claim"),
        (f'{{"aud":"{BROKER}","exp":1e400}}', "'exp' claim"),  # parses as inf: never expires
        (f'{{"aud":"{BROKER}","iat":-1e400}}', "'iat' claim"),
        (f'{{"aud":"{BROKER}","exp":NaN}}', "not UTF-8 JSON"),
        (f'{{"aud":"{BROKER}","iat":-Infinity}}', "not UTF-8 JSON"),
    ],
)
def test_other_decode_failures_are_malformed(claims: str, why: str) -> None:
    header = _seg(b'{"alg":"RS256"}')
    token = f"{header}.{_seg(claims.encode())}.c2lnbmF0dXJl"
    with pytest.raises(MalformedTokenError, match=why) as info:
        decode_token(token)
    assert token not in str(info.value)


def test_every_client_side_path_refuses_it(tmp_path: Path, missing_path, no_secret) -> None:
    path = tmp_path / "token"
    path.write_text(DEEP)

    class Plugin:
        @hookimpl
        def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential:
            return Credential(DEEP, "nested", source="a plugin")

    none = {"AGENT_SANDBOX_LOAD_PLUGINS": ""}
    file_env = {**none, "AGENT_SANDBOX_TOKEN_FILE": str(path)}
    sources = [
        DefaultCredentials({**none, "AGENT_SANDBOX_TOKEN": DEEP}, _token_path=missing_path),
        DefaultCredentials(file_env, _token_path=missing_path),
        DefaultCredentials(none, _token_path=str(path)),
        DefaultCredentials(none, _token_path=missing_path, _plugins=[("nested", Plugin())]),
        KubernetesAuth(path),
        OIDCTokenAuth(DEEP),
        OIDCTokenAuth(lambda: DEEP),
    ]
    for source in sources:
        with pytest.raises(MalformedTokenError) as info:
            source.get_credential(BROKER)
        no_secret(DEEP, str(info.value))
        report = explain(BROKER, auth=source)
        assert isinstance(report.error, MalformedTokenError), source
        assert report.selected is None and report.claims is None
        no_secret(DEEP, str(report), json.dumps(report.to_dict()))


@pytest.mark.asyncio
async def test_the_async_path_refuses_it(tmp_path: Path, missing_path) -> None:
    path = tmp_path / "token"
    path.write_text(DEEP)
    none = {"AGENT_SANDBOX_LOAD_PLUGINS": ""}
    for source in (
        DefaultCredentials({**none, "AGENT_SANDBOX_TOKEN": DEEP}, _token_path=missing_path),
        DefaultCredentials(none, _token_path=str(path)),
        KubernetesAuth(path),
        OIDCTokenAuth(DEEP),
        OIDCTokenAuth(lambda: DEEP),
    ):
        with pytest.raises(MalformedTokenError):
            await source.aget_credential(BROKER)
