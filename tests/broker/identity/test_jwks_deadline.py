"""A slow or trickling JWKS never holds verifications (issue 26, item 8).

httpx's timeout is per read: a JWKS that sends a byte every 2 s never trips it, and before the
fix every request with stale keys waited for that one fetch (a valid token's request was held
past 45 s). Now a fetch has one deadline for the whole of it (``timeout_seconds``), and while
a refresh is slow or failing, a token whose ``kid`` is among the last good keys is verified
against them at once (the refresh goes on in the background).

No timed assertion: what is checked is what was done when (the refresh still under way when
the verification returned; the trickle still short of its end when the fetch was given up).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable

import pytest

from k8s_agent_sandbox_awx.broker.identity._configured import configured_verifier
from k8s_agent_sandbox_awx.broker.identity._jwks import KeySet, KeysUnavailable
from tests._support.oidc_issuer import AUDIENCE, DISCOVERY, JWKS, ScriptedIssuer
from tests._support.scripted_https import Reply

pytestmark = pytest.mark.asyncio

WATCHDOG = 30.0
"""Seconds the test waits at most for what must end long before (a trickle lasts minutes)."""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def trickle(issuer: ScriptedIssuer, every: float = 0.2) -> Reply:
    """The issuer's JWKS, one byte every ``every`` seconds (minutes for the whole of it)."""
    return Reply(200, {"keys": [k.jwk() for k in issuer.keys]}, mode="trickle", every=every)


async def until(condition: Callable[[], bool]) -> None:
    while not condition():  # noqa: ASYNC110 (the condition is another server's count)
        await asyncio.sleep(0.05)


def size(reply: Reply) -> int:
    return len(json.dumps(reply.body).encode())


async def test_a_trickling_jwks_fails_at_one_deadline_for_the_whole_fetch(
    issuer: ScriptedIssuer,
) -> None:
    """Every read gets a byte within the per-read timeout; the fetch still ends at
    ``timeout_seconds``, named, long before the trickle's end."""
    reply = issuer.replies[JWKS] = trickle(issuer)
    keys = KeySet(issuer.settings(timeout_seconds=1.0))
    with pytest.raises(KeysUnavailable) as info:
        await asyncio.wait_for(keys.refresh(), WATCHDOG)
    assert reply.sent and reply.sent[0] < size(reply), "the fetch waited for the whole trickle"
    message = str(info.value)
    assert f"the JWKS at {issuer.url}{JWKS} timed out" in message
    assert "within 1 s (timeout_seconds, one deadline for the whole fetch)" in message
    await keys.aclose()


async def test_a_trickling_discovery_document_fails_at_the_same_deadline(
    issuer: ScriptedIssuer,
) -> None:
    document = {"issuer": issuer.url, "jwks_uri": issuer.url + JWKS}
    reply = issuer.replies[DISCOVERY] = Reply(200, document, mode="trickle", every=0.2)
    keys = KeySet(issuer.settings(timeout_seconds=1.0))
    with pytest.raises(KeysUnavailable, match=r"the discovery document at .* timed out"):
        await asyncio.wait_for(keys.refresh(), WATCHDOG)
    assert reply.sent[0] < size(reply)
    assert issuer.hits(JWKS) == 0
    await keys.aclose()


async def test_a_known_kid_verifies_at_once_while_a_stale_refresh_trickles(
    issuer: ScriptedIssuer,
) -> None:
    """Stale keys (older than ``jwks_cache_seconds``) and a refresh that trickles: a token
    whose kid is known is verified with the last good keys while the refresh is still under
    way; the refresh goes on (one fetch for all of them) and fails at its deadline, the keys
    kept."""
    clock = Clock()
    keys = KeySet(issuer.settings(jwks_cache_seconds=10, timeout_seconds=5.0), clock=clock)
    kid = issuer.current.kid
    assert await keys.key_for(kid, "RS256") is not None
    reply = issuer.replies[JWKS] = trickle(issuer)
    clock.now += 11  # stale: the next use refreshes
    for _ in range(20):
        assert await asyncio.wait_for(keys.key_for(kid, "RS256"), WATCHDOG) is not None
    assert keys.refreshing, "the verifications waited for the refresh"
    await asyncio.wait_for(keys.settled(), WATCHDOG)
    assert issuer.hits(JWKS) == 2, "one refresh for every verification"
    assert reply.sent[0] < size(reply)
    assert "timed out" in (keys.last_error or "") and keys.ready
    assert await keys.key_for(kid, "RS256") is not None  # in the backoff: the last good keys
    await keys.aclose()


async def test_through_the_verifier_a_valid_token_is_not_held_by_the_refresh(
    issuer: ScriptedIssuer,
) -> None:
    """The issue's trial, shortened: stale keys, a JWKS sending a byte every 0.2 s; a valid
    token (a new one: a verified token is remembered) verifies while the refresh is under way:
    not failed yet, not complete."""
    settings = issuer.settings(jwks_cache_seconds=1.0, timeout_seconds=5.0)
    verifier = configured_verifier([settings], audience=AUDIENCE)
    assert (await verifier.verify(f"Bearer {issuer.token('alice')}"))[0].subject == "alice"
    reply = issuer.replies[JWKS] = trickle(issuer)
    await asyncio.sleep(1.1)  # the keys are stale now
    caller, _ = await asyncio.wait_for(verifier.verify(f"Bearer {issuer.token('alice')}"), WATCHDOG)
    assert caller.subject == "alice"
    # the refresh neither completed nor failed: it was still under way
    assert not reply.sent or reply.sent[0] < size(reply)
    assert verifier.readiness()["scripted"]["last_error"] is None, "the refresh ended first"
    await asyncio.wait_for(until(lambda: issuer.hits(JWKS) == 2), WATCHDOG)  # it went on
    await verifier.aclose()


async def test_an_unknown_kid_waits_for_the_refresh_at_most_its_deadline(
    issuer: ScriptedIssuer,
) -> None:
    """A kid the cached keys do not have joins the refresh under way (a rotation's new key
    may be in it): it waits for it, and no longer than its deadline."""
    clock = Clock()
    keys = KeySet(issuer.settings(jwks_cache_seconds=10, timeout_seconds=1.0), clock=clock)
    assert await keys.key_for(issuer.current.kid, "RS256") is not None
    reply = issuer.replies[JWKS] = trickle(issuer)
    clock.now += 11
    assert await asyncio.wait_for(keys.key_for(uuid.uuid4().hex, "RS256"), WATCHDOG) is None
    assert reply.sent[0] < size(reply) and "timed out" in (keys.last_error or "")
    assert issuer.hits(JWKS) == 2
    await keys.aclose()


async def test_a_rotated_key_still_arrives_with_a_slow_refresh(issuer: ScriptedIssuer) -> None:
    """A new kid during a slow (but in-time) refresh of stale keys: it waits for that refresh
    and verifies with the key it brings; a kid the issuer never published is still refused."""
    clock = Clock()
    keys = KeySet(issuer.settings(jwks_cache_seconds=10), clock=clock)
    assert await keys.key_for(issuer.current.kid, "RS256") is not None
    fresh = issuer.rotate()
    issuer.replies[JWKS] = Reply(200, {"keys": [k.jwk() for k in issuer.keys]}, delay=0.5)
    clock.now += 11
    assert await keys.key_for(fresh.kid, "RS256") is not None
    assert issuer.hits(JWKS) == 2
    assert await keys.key_for(uuid.uuid4().hex, "RS256") is None
    await keys.aclose()
