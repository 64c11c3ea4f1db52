"""One issuer's signing keys, fetched asynchronously and cached: :class:`KeySet`.

Decisions (docs/broker/identity.md, "Keys"):

- Where: OIDC discovery (``{url}/.well-known/openid-configuration``; its ``issuer`` must equal
  the configured URL, its ``jwks_uri`` must be https) or an explicit ``jwks_url``. TLS trust
  from ``ca_file``, else the system's. Redirects are never followed, proxy variables never
  read; each fetch has a timeout, and an answer over ``max_document_bytes`` is refused.
- The bearer ``token_file`` is read again on every fetch (a kubelet rotates it) and sent to
  the discovery URL, to ``jwks_url``, and to a discovered ``jwks_uri`` only on the issuer's
  own origin or when ``ca_file`` pins the trust to a private CA (whatever presents a
  certificate of that CA is the issuer's own deployment): never to a public host the
  discovery document names. It never appears in a message or a log record.
- One deadline per fetch: ``timeout_seconds`` for the whole of it (discovery and JWKS, from
  the first byte sent to the last received), not per read: a server that trickles a byte at a
  time fails the fetch at that deadline.
- Cache: keys are fresh for ``jwks_cache_seconds``, then refreshed on the next use, in the
  background: while a refresh is under way (slow) or backing off (failing), a token whose
  ``kid`` is among the last good keys is verified with them at once. A
  refresh that fails keeps the last good keys (logged once per failure streak, retried with
  an exponential backoff from 1 s up to ``jwks_min_refetch_seconds``), for at most
  ``keep_stale_seconds`` after they were fetched; then they are dropped and verification
  fails until a fetch succeeds.
- An unknown ``kid`` refetches at most once per ``jwks_min_refetch_seconds`` (measured
  between such refetches): a flood of forged kids costs one fetch per interval. An unknown
  kid seen while a fetch is under way waits for that fetch (the burst of a rotation), at
  most until its deadline.
- Single flight: concurrent verifications share one fetch; a verification whose key is
  cached (fresh or stale within the bound) never waits for a fetch; only a verification with
  no keys at all, or with an unknown kid, does.
- Keys are filtered to the pinned algorithms: ``use: enc`` keys, and keys whose ``alg`` or
  ``kty``/``crv`` fits none of them, are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import jwt

from ..._urls import masked_url
from ._in_cluster import jwks_hint
from ._settings import IssuerSettings

__all__ = ["KeySet", "KeysUnavailable"]

log = logging.getLogger("k8s_agent_sandbox_awx.broker.identity")

BACKOFF_START: Final = 1.0
"""Seconds before the first retry of a failed fetch (doubling up to the refetch interval)."""

_KEY_TYPES: Final[Mapping[str, tuple[str, str | None]]] = {
    **{alg: ("RSA", None) for alg in ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512")},
    "ES256": ("EC", "P-256"),
    "ES384": ("EC", "P-384"),
    "ES512": ("EC", "P-521"),
    "EdDSA": ("OKP", "Ed25519"),
}
_WHOLE_FETCH: Final = "timeout_seconds, one deadline for the whole fetch"
_TIMEOUT_PHASES: Final[Mapping[type[Exception], str]] = {
    httpx.ConnectTimeout: "no connection",
    httpx.ReadTimeout: "no answer",
    httpx.WriteTimeout: "the request was not sent",
    httpx.PoolTimeout: "no free connection",
}


class KeysUnavailable(Exception):
    """The issuer's keys cannot be had: the message says which fetch failed, why, and the fix
    (never a token)."""


@dataclass
class _Key:
    """One published key and the pinned algorithms it may verify."""

    raw: Mapping[str, Any]
    algorithms: tuple[str, ...]
    _built: dict[str, jwt.PyJWK] = field(default_factory=dict)

    def jwk_for(self, alg: str) -> jwt.PyJWK:
        """The key for ``alg``; for an algorithm it may not verify, the key as its own first
        algorithm (so the caller sees the mismatch and says so)."""
        use = alg if alg in self.algorithms else self.algorithms[0]
        if use not in self._built:
            self._built[use] = jwt.PyJWK(dict(self.raw), algorithm=use)
        return self._built[use]


@dataclass(frozen=True)
class _Loaded:
    keys: Mapping[str, _Key]
    at: float
    ignored: int


def _fits(alg: str, raw: Mapping[str, Any]) -> bool:
    kty, crv = _KEY_TYPES[alg]
    return raw.get("kty") == kty and (crv is None or raw.get("crv") == crv)


def select_keys(raw_keys: object, algorithms: tuple[str, ...]) -> tuple[dict[str, _Key], int]:
    """The signing keys of a JWKS ``keys`` list usable with ``algorithms``, by ``kid``, and
    how many entries were ignored."""
    if not isinstance(raw_keys, list):
        raise ValueError("its 'keys' is not a list")
    keys: dict[str, _Key] = {}
    ignored = 0
    for raw in raw_keys:
        fitting: list[str] = []
        if isinstance(raw, dict) and raw.get("use", "sig") == "sig":
            fitting = [alg for alg in algorithms if _fits(alg, raw)]
            if raw.get("alg") is not None:
                fitting = [raw["alg"]] if raw["alg"] in fitting else []
        if not fitting:
            ignored += 1
            continue
        key = _Key(raw, tuple(fitting))
        try:
            key.jwk_for(fitting[0])
        except (jwt.PyJWTError, ValueError, TypeError):
            ignored += 1
            continue
        keys[str(raw.get("kid", ""))] = key
    return keys, ignored


class KeySet:
    """The keys of one issuer (see the module's decisions). ``http``: a shared client factory
    (the local broker's); without it the key set makes and owns a client from its settings.
    Counters for metrics: ``refreshes`` (successful fetches), ``failures``,
    ``kid_refetches``, ``rate_limited`` (unknown kids that waited for the interval)."""

    def __init__(
        self,
        settings: IssuerSettings,
        *,
        http: Callable[[], httpx.AsyncClient] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_keys_removed: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self._shared_http = http
        self._own_http: httpx.AsyncClient | None = None
        self._clock = clock
        self._on_keys_removed = on_keys_removed
        self._loaded: _Loaded | None = None
        self.loaded_once = False
        """Whether keys were ever fetched (a later failure is then an outage, not a
        misconfiguration)."""
        self._inflight: asyncio.Task[bool] | None = None
        self._phase: tuple[str, str, int | None] = ("discovery document", settings.url, None)
        """What the fetch under way waits for: (what, url, body bytes received or ``None``
        before the answer's head), for the message of a fetch past its deadline."""
        self._retry_at = float("-inf")
        self._backoff = 0.0
        self._last_kid_refetch = float("-inf")
        self.last_error: str | None = None
        self.refreshes = 0
        self.failures = 0
        self.kid_refetches = 0
        self.rate_limited = 0

    def __repr__(self) -> str:
        return f"KeySet(issuer={self.settings.name!r}, url={self.settings.url!r})"

    # -- state ---------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Keys are loaded (fresh, or last good ones still within the stale bound)."""
        loaded = self._loaded
        return loaded is not None and self._clock() - loaded.at < self.settings.keep_stale_seconds

    @property
    def refreshing(self) -> bool:
        """A fetch is under way."""
        return self._inflight is not None and not self._inflight.done()

    async def settled(self) -> None:
        """Wait for the fetch under way, if any (it ends by its deadline)."""
        task = self._inflight
        if task is not None and not task.done():
            await asyncio.shield(task)

    @property
    def retry_in(self) -> float:
        """Seconds until the next fetch may be tried (0: now)."""
        return max(0.0, self._retry_at - self._clock())

    @property
    def backoff_seconds(self) -> float:
        """The wait before the next try after failed fetches (0 when the last one worked)."""
        return self._backoff

    def status(self) -> dict[str, Any]:
        """For ``/readyz`` and ``broker check``: never a key, never a token."""
        loaded = self._loaded
        return {
            "issuer": self.settings.name,
            "ready": self.ready,
            "keys": len(loaded.keys) if loaded else 0,
            "ignored_keys": loaded.ignored if loaded else 0,
            "age_seconds": round(self._clock() - loaded.at, 3) if loaded else None,
            "last_error": self.last_error,
        }

    def forget(self) -> None:
        """Drop the cached keys (the next use fetches them again, without waiting)."""
        self._loaded = None
        self._retry_at = float("-inf")
        self._last_kid_refetch = float("-inf")

    async def aclose(self) -> None:
        if self._inflight is not None:
            self._inflight.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._inflight
        if self._own_http is not None:
            await self._own_http.aclose()
            self._own_http = None

    # -- lookup --------------------------------------------------------------------------------
    async def key_for(self, kid: str, alg: str) -> jwt.PyJWK | None:
        """The key ``kid`` for a token signed with ``alg`` (``None``: the issuer publishes no
        such key, even after the refetch an unknown kid may cause). Raises
        :class:`KeysUnavailable` when no keys can be had at all."""
        tried = await self._current()
        loaded = self._loaded
        assert loaded is not None
        key = loaded.keys.get(kid)
        if key is None and self.refreshing:
            await self._fetch_once()  # join the fetch under way (a rotation's burst)
            key = (self._loaded or loaded).keys.get(kid)
        elif key is None and not tried:
            now = self._clock()
            if now - self._last_kid_refetch < self.settings.jwks_min_refetch_seconds or (
                now < self._retry_at
            ):
                self.rate_limited += 1
                return None
            self._last_kid_refetch = now
            self.kid_refetches += 1
            await self._fetch_once()
            key = (self._loaded or loaded).keys.get(kid)
        return None if key is None else key.jwk_for(alg)

    async def _current(self) -> bool:
        """Make sure keys are loaded (waiting for a fetch only when there are none) and, if a
        fetch may be tried, refreshed (in the background when stale keys are at hand); whether
        this call waited for a fetch: then an unknown kid does not refetch."""
        now = self._clock()
        loaded = self._loaded
        if loaded is not None and now - loaded.at >= self.settings.keep_stale_seconds:
            log.warning(
                "issuer %r: its last good keys are %.0f s old and could not be refreshed "
                "(%s); dropped them: its tokens fail until a fetch succeeds",
                self.settings.name,
                now - loaded.at,
                self.last_error,
            )
            self._loaded = loaded = None
        if loaded is not None and now - loaded.at < self.settings.jwks_cache_seconds:
            return False
        if loaded is not None:  # stale: refreshed in the background, the last good keys serve
            if now >= self._retry_at:
                self._start_fetch()
            return False
        if now >= self._retry_at:
            await self._fetch_once()
        if self._loaded is None:
            wait = max(0.0, self._retry_at - self._clock())
            raise KeysUnavailable(
                f"cannot fetch the keys of issuer {self.settings.name!r} "
                f"({self.settings.url}): {self.last_error}; next try in {wait:.0f} s"
            )
        return True

    async def refresh(self) -> None:
        """Fetch now (at start, so that ``ready`` holds before the broker listens); raises
        :class:`KeysUnavailable` when it fails (the last good keys, if any, stay)."""
        if not await self._fetch_once():
            raise KeysUnavailable(
                f"cannot fetch the keys of issuer {self.settings.name!r} "
                f"({self.settings.url}): {self.last_error}"
            )

    async def _fetch_once(self) -> bool:
        """One fetch shared by every concurrent caller; whether it succeeded."""
        return await asyncio.shield(self._start_fetch())

    def _start_fetch(self) -> asyncio.Task[bool]:
        """The fetch under way, started if there is none (it ends by its deadline)."""
        task = self._inflight
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._fetch_and_store())
            task.add_done_callback(_log_unexpected)
            self._inflight = task
        return task

    async def _fetch_and_store(self) -> bool:
        deadline = self.settings.timeout_seconds
        try:
            async with asyncio.timeout(deadline):
                keys, ignored = await self._fetch()
        except KeysUnavailable as exc:
            self._failed(str(exc))
            return False
        except TimeoutError:
            what, url, received = self._phase
            got = "no answer" if received is None else f"{received} bytes of its answer"
            self._failed(
                f"the {what} at {url} timed out: {got} within {deadline:g} s ({_WHOLE_FETCH})"
            )
            return False
        previous = self._loaded
        self._loaded = _Loaded(keys, self._clock(), ignored)
        self.loaded_once = True
        self.refreshes += 1
        if self.last_error is not None:
            log.info("issuer %r: its keys are fetched again", self.settings.name)
        self.last_error, self._backoff, self._retry_at = None, 0.0, float("-inf")
        removed = set(previous.keys) - set(keys) if previous is not None else set()
        if removed and self._on_keys_removed is not None:
            self._on_keys_removed(self.settings.url)
        return True

    def _failed(self, reason: str) -> None:
        if hint := jwks_hint(self.settings.url, self.settings.jwks_url):
            reason = f"{reason}; {hint}"  # in /readyz and the log: the fix, in config words
        first = self.last_error is None
        self.failures += 1
        self.last_error = reason
        cap = max(self.settings.jwks_min_refetch_seconds, BACKOFF_START)
        self._backoff = min(cap, self._backoff * 2 if self._backoff else BACKOFF_START)
        self._retry_at = self._clock() + self._backoff
        loaded = self._loaded
        if first:
            kept = (
                f"keeping its {len(loaded.keys)} last good keys for at most "
                f"{self.settings.keep_stale_seconds:.0f} s after they were fetched"
                if loaded is not None
                else "no keys yet: its tokens fail until a fetch succeeds"
            )
            log.warning(
                "issuer %r: %s; %s; retrying with backoff", self.settings.name, reason, kept
            )
        else:
            log.debug("issuer %r: still failing: %s", self.settings.name, reason)

    # -- fetching ------------------------------------------------------------------------------
    def _client(self) -> httpx.AsyncClient:
        if self._shared_http is not None:
            return self._shared_http()
        if self._own_http is None:
            ca_file = self.settings.ca_file
            self._own_http = httpx.AsyncClient(
                verify=ssl.create_default_context(cafile=ca_file),
                timeout=httpx.Timeout(self.settings.timeout_seconds),
                follow_redirects=False,
                trust_env=False,
            )
        return self._own_http

    async def _fetch(self) -> tuple[dict[str, _Key], int]:
        settings = self.settings
        client = self._client()
        jwks_url, send_token = settings.jwks_url, True
        if jwks_url is None:
            document = await self._get_json(client, settings.discovery_url, "discovery document")
            jwks_url = self._jwks_uri_of(document)
            send_token = _same_origin(jwks_url, settings.url) or settings.ca_file is not None
        document = await self._get_json(client, jwks_url, "JWKS", send_token=send_token)
        try:
            keys, ignored = select_keys(document.get("keys"), settings.algorithms)
        except ValueError as exc:
            raise KeysUnavailable(f"the JWKS at {jwks_url} is not a key set: {exc}") from None
        if not keys:
            raise KeysUnavailable(
                f"the JWKS at {jwks_url} has no signing key for the pinned algorithms "
                f"{list(settings.algorithms)} ({ignored} keys ignored): check 'algorithms'"
            )
        return keys, ignored

    def _jwks_uri_of(self, document: Mapping[str, Any]) -> str:
        url = self.settings.url
        if document.get("issuer") != url:
            raise KeysUnavailable(
                f"the discovery document at {self.settings.discovery_url} names issuer "
                f"{document.get('issuer')!r}, not the configured url {url!r}: set url to "
                "exactly the issuer its tokens carry in 'iss'"
            )
        jwks_uri = document.get("jwks_uri")
        if not isinstance(jwks_uri, str) or urlsplit(jwks_uri).scheme != "https":
            raise KeysUnavailable(
                f"the discovery document at {self.settings.discovery_url} has no https "
                f"jwks_uri (it has {jwks_uri!r}): set jwks_url"
            )
        return jwks_uri

    def _authorization(self) -> dict[str, str]:
        path = self.settings.token_file
        if path is None:
            return {}
        try:
            with open(path, encoding="utf-8") as handle:
                token = handle.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise KeysUnavailable(
                f"cannot read token_file {path}: {getattr(exc, 'strerror', None) or exc}"
            ) from None
        if not token:
            raise KeysUnavailable(f"token_file {path} is empty: it must hold a bearer token")
        return {"Authorization": f"Bearer {token}"}

    async def _get_json(
        self, client: httpx.AsyncClient, url: str, what: str, *, send_token: bool = True
    ) -> dict[str, Any]:
        # Accept stays */*: kube-apiserver answers 406 to "application/json" for its JWKS
        # (application/jwk-set+json)
        headers = self._authorization() if send_token else {}
        limit = self.settings.max_document_bytes
        self._phase = (what, url, None)
        try:
            async with client.stream("GET", url, headers=headers) as response:
                self._check_status(response, url, what, sent_token="Authorization" in headers)
                declared = response.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise KeysUnavailable(_too_large(what, url, limit))
                body = bytearray()
                self._phase = (what, url, 0)
                async for chunk in response.aiter_bytes():
                    body += chunk
                    self._phase = (what, url, len(body))
                    if len(body) > limit:
                        raise KeysUnavailable(_too_large(what, url, limit))
        except httpx.TimeoutException as exc:
            phase = _TIMEOUT_PHASES.get(type(exc), "timed out")
            raise KeysUnavailable(
                f"the {what} at {url} timed out: {phase} within "
                f"{self.settings.timeout_seconds:g} s ({_WHOLE_FETCH})"
            ) from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise KeysUnavailable(_transport_failure(what, url, exc)) from None
        return _json_object(bytes(body), what, url)

    def _check_status(
        self, response: httpx.Response, url: str, what: str, *, sent_token: bool
    ) -> None:
        status = response.status_code
        if status == 200:
            return
        if 300 <= status < 400:
            raise KeysUnavailable(
                f"the {what} at {url} answered {status} (a redirect to "
                f"{masked_url(response.headers.get('location') or '')!r}); redirects are never "
                "followed: "
                "configure the final URL"
            )
        if status in (401, 403) and not sent_token:
            raise KeysUnavailable(
                f"the {what} at {url} answered {status} to an anonymous request: this "
                "issuer's keys are not public (the cluster's own issuer by default); set "
                "token_file to a token that may read them (in a pod: "
                "/var/run/secrets/kubernetes.io/serviceaccount/token)"
            )
        if status in (401, 403):
            raise KeysUnavailable(
                f"the {what} at {url} answered {status} to the token of token_file "
                f"{self.settings.token_file}: let its identity read the issuer's discovery "
                "and keys (Kubernetes: ClusterRole system:service-account-issuer-discovery)"
            )
        raise KeysUnavailable(f"the {what} at {url} answered {status}")


def _log_unexpected(task: asyncio.Task[bool]) -> None:
    """A fetch's failure is stored by the fetch itself; anything else it raised is a bug: logged
    (never left for the garbage collector to report)."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("a key fetch failed unexpectedly", exc_info=exc)


def _same_origin(url: str, other: str) -> bool:
    a, b = urlsplit(url), urlsplit(other)
    return (a.scheme, a.hostname, a.port) == (b.scheme, b.hostname, b.port)


def _too_large(what: str, url: str, limit: int) -> str:
    return f"the {what} at {url} is over {limit} bytes (max_document_bytes)"


def _transport_failure(what: str, url: str, exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    hint = ""
    if "CERTIFICATE_VERIFY_FAILED" in text:
        hint = ": its certificate is not trusted; set ca_file to the CA that signed it"
    return f"cannot fetch the {what} at {url}: {type(exc).__name__}: {text}{hint}"


def _json_object(body: bytes, what: str, url: str) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        raise KeysUnavailable(f"the {what} at {url} is not JSON") from None
    if not isinstance(value, dict):
        raise KeysUnavailable(f"the {what} at {url} is not a JSON object")
    return value
