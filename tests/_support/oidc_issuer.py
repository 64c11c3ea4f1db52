"""A scripted OIDC issuer on loopback HTTPS for the identity tests: real keys, real signed
tokens, a discovery document and a JWKS whose answers a test changes at will (5xx, delays,
redirects, a wrong ``issuer``, oversized answers), every request recorded.

``async with ScriptedIssuer(tmp_path) as issuer:`` — ``issuer.url`` (``https://127.0.0.1:N``),
``issuer.ca_file`` (the test-time CA, PEM), ``issuer.settings(**overrides)`` (IssuerSettings
pointing at it), ``issuer.token(sub, ...)`` (signed with the current key), ``rotate()``,
``retire(kid)``, ``hits(path)``; ``issuer.replies[path] = Reply(...)`` overrides a path.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from k8s_agent_sandbox_awx.broker.identity._settings import IssuerSettings
from tests._support.scripted_https import Reply, ScriptedHTTPS, Seen

DISCOVERY = "/.well-known/openid-configuration"
JWKS = "/keys"
AUDIENCE = "https://broker.test"


class SigningKey:
    def __init__(self, algorithm: str = "RS256", kid: str | None = None) -> None:
        self.algorithm = algorithm
        self.kid = kid or uuid.uuid4().hex[:12]
        if algorithm.startswith(("RS", "PS")):
            self.private: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        elif algorithm == "EdDSA":
            self.private = ed25519.Ed25519PrivateKey.generate()
        else:
            curves = {"ES256": ec.SECP256R1(), "ES384": ec.SECP384R1(), "ES512": ec.SECP521R1()}
            self.private = ec.generate_private_key(curves[algorithm])

    def jwk(self, **extra: Any) -> dict[str, Any]:
        algo = jwt.get_algorithm_by_name(self.algorithm)
        jwk: dict[str, Any] = algo.to_jwk(self.private.public_key(), as_dict=True)
        jwk.update(kid=self.kid, use="sig", alg=self.algorithm)
        jwk.update(extra)
        return {k: v for k, v in jwk.items() if v is not None}


class ScriptedIssuer:
    def __init__(self, folder: Path, algorithm: str = "RS256") -> None:
        self.server = ScriptedHTTPS(self._answer)
        self.keys: list[SigningKey] = [SigningKey(algorithm)]
        self.extra_jwks: list[dict[str, Any]] = []  # published as they are (odd keys)
        self.replies: dict[str, Reply] = {}
        self.discovered_issuer: str | None = None  # None: the issuer's own url
        self.jwks_uri: str | None = None  # None: {url}/keys
        self.ca_file = folder / f"issuer-ca-{uuid.uuid4().hex[:6]}.pem"
        self.url = ""

    async def __aenter__(self) -> ScriptedIssuer:
        await self.server.__aenter__()
        self.url = self.server.url
        self.ca_file.write_bytes(self.server.ca_pem)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.server.__aexit__(*exc_info)

    # -- the documents -------------------------------------------------------------------------
    def _answer(self, seen: Seen) -> Reply:
        path = seen.target.split("?", 1)[0]
        if path in self.replies:
            return self.replies[path]
        if path == DISCOVERY:
            return Reply(200, {"issuer": self.discovered_issuer or self.url,
                               "jwks_uri": self.jwks_uri or self.url + JWKS})  # fmt: skip
        if path == JWKS:
            return Reply(200, {"keys": [k.jwk() for k in self.keys] + self.extra_jwks})
        return Reply(404, {"error": "not found"})

    @property
    def requests(self) -> list[Seen]:
        return self.server.requests

    def hits(self, path: str = JWKS) -> int:
        return sum(1 for r in self.requests if r.target.split("?", 1)[0] == path)

    def authorizations(self, path: str = JWKS) -> list[str | None]:
        return [r.headers.get("authorization") for r in self.requests
                if r.target.split("?", 1)[0] == path]  # fmt: skip

    # -- keys and tokens -----------------------------------------------------------------------
    @property
    def current(self) -> SigningKey:
        return self.keys[-1]

    def rotate(self, algorithm: str | None = None) -> SigningKey:
        key = SigningKey(algorithm or self.current.algorithm)
        self.keys.append(key)
        return key

    def retire(self, kid: str) -> None:
        self.keys = [k for k in self.keys if k.kid != kid]

    def settings(self, **overrides: Any) -> IssuerSettings:
        values: dict[str, Any] = {
            "name": "scripted",
            "url": self.url,
            "provider": "scripted",
            "audiences": (AUDIENCE,),
            "ca_file": str(self.ca_file),
            "jwks_min_refetch_seconds": 30.0,
        }
        values.update(overrides)
        return IssuerSettings(**values)

    def claims(self, sub: str = "user", **claims: Any) -> dict[str, Any]:
        now = int(time.time())
        payload: dict[str, Any] = {
            "iss": self.url, "sub": sub, "aud": AUDIENCE, "iat": now, "nbf": now,
            "exp": now + 600, "jti": uuid.uuid4().hex,
        }  # fmt: skip
        payload.update(claims)
        return {k: v for k, v in payload.items() if v is not None}

    def sign(
        self,
        payload: Mapping[str, Any],
        *,
        key: SigningKey | None = None,
        headers: Mapping[str, Any] | None = None,
    ) -> str:
        key = key or self.current
        hdrs = {"kid": key.kid, **(headers or {})}
        return jwt.encode(dict(payload), key.private, algorithm=key.algorithm, headers=hdrs)

    def token(self, sub: str = "user", *, key: SigningKey | None = None, **claims: Any) -> str:
        return self.sign(self.claims(sub, **claims), key=key)


class BackgroundIssuer:
    """A :class:`ScriptedIssuer` served from a thread of its own (its own event loop), for
    tests whose broker is another process or whose test code is synchronous.

    ``with BackgroundIssuer(tmp_path) as issuer:`` — ``issuer.url``, ``issuer.ca_file``,
    ``issuer.token(sub, aud=...)`` as on :class:`ScriptedIssuer` (``issuer.scripted``)."""

    def __init__(self, folder: Path, algorithm: str = "RS256") -> None:
        import asyncio
        import threading

        self.scripted = ScriptedIssuer(folder, algorithm)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> BackgroundIssuer:
        import asyncio

        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.scripted.__aenter__(), self._loop).result(10)
        return self

    def __exit__(self, *exc_info: object) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.scripted.__aexit__(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    @property
    def url(self) -> str:
        return self.scripted.url

    @property
    def ca_file(self) -> Path:
        return self.scripted.ca_file

    def token(self, sub: str = "user", **claims: Any) -> str:
        return self.scripted.token(sub, **claims)
