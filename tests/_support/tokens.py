"""Test JWTs, a fake wall clock and kubelet-style projected tokens for the credential
framework's tests (``tests/credentials/conftest.py`` turns them into fixtures)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

BROKER = "https://sandbox-broker.example"
T0 = 1_900_000_000.0  # the fake clock's starting point (2030-03-17)


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def make_jwt(
    aud: str | list[str] | None = BROKER,
    *,
    now: float | None = None,
    ttl: float | None = 3600,
    header: dict[str, Any] | None = None,
    **claims: Any,
) -> str:
    """A correctly formatted HS256 JWT (signed with a throw-away key; the client never verifies)."""
    issued = T0 if now is None else now
    payload: dict[str, Any] = {
        "iss": "https://issuer.example",
        "sub": "system:serviceaccount:team:agent",
        "iat": int(issued),
        "nbf": int(issued),
        "jti": secrets.token_hex(8),
    }
    if aud is not None:
        payload["aud"] = aud
    if ttl is not None:
        payload["exp"] = int(issued + ttl)
    payload.update(claims)
    head = {"alg": "HS256", "typ": "JWT", **(header or {})}
    signing_input = f"{b64url(json.dumps(head).encode())}.{b64url(json.dumps(payload).encode())}"
    key = secrets.token_bytes(32)
    signature = hmac.new(key, signing_input.encode("ascii"), hashlib.sha256).digest()
    return f"{signing_input}.{b64url(signature)}"


def assert_no_secret(token: str, *texts: str) -> None:
    """Neither the token nor its signature part appears in any of ``texts``."""
    parts = [token]
    if token.count(".") == 2 and len(token.rsplit(".", 1)[1]) >= 8:
        parts.append(token.rsplit(".", 1)[1])
    for text in texts:
        for part in parts:
            assert part not in text


class FakeClock:
    def __init__(self, start: float = T0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def write_projected(directory: Path, token: str, generation: int) -> Path:
    """Lay out (or rotate) a token like the kubelet does: ``..<ts>/token``, ``..data`` swapped
    atomically by rename, ``token -> ..data/token``. Returns the stable path."""
    data_dir = directory / f"..2030_03_17_00_00_0{generation}.{generation:06d}"
    data_dir.mkdir()
    (data_dir / "token").write_text(token)
    tmp_link = directory / "..data_tmp"
    os.symlink(data_dir.name, tmp_link)
    previous = os.readlink(directory / "..data") if (directory / "..data").is_symlink() else None
    os.rename(tmp_link, directory / "..data")  # atomic swap
    stable = directory / "token"
    if not stable.is_symlink():
        os.symlink("..data/token", stable)
    if previous is not None:
        for child in (directory / previous).iterdir():
            child.unlink()
        (directory / previous).rmdir()
    return stable


Minter = Callable[..., str]
