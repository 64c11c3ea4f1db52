"""The cluster's own issuer against a real kube-apiserver (1.20; tests/_support/kube.py): the
broker reads its OIDC discovery and JWKS with its own ServiceAccount token and the API server's
CA, TokenRequest tokens verify, an anonymous read is refused with the fix, and in TokenReview
mode a token whose pod was deleted is refused (which JWKS verification cannot notice).

Facts (tests/kube/test_apiserver.py): discovery and keys need a ServiceAccount token
(ClusterRole system:service-account-issuer-discovery, bound to every ServiceAccount by
default in 1.20); TokenReview caches a positive review for 10 s; TokenRequest needs
expirationSeconds >= 600.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from k8s_agent_sandbox_awx.broker.backends.kubernetes._api import KubeClient
from k8s_agent_sandbox_awx.broker.backends.kubernetes._api_config import (
    StaticToken,
    connection,
)
from k8s_agent_sandbox_awx.broker.identity._configured import configured_verifier
from k8s_agent_sandbox_awx.broker.identity._rejection import TokenRejected
from k8s_agent_sandbox_awx.broker.identity._settings import IssuerSettings
from k8s_agent_sandbox_awx.broker.identity._verify import TokenVerifier
from tests._support.kube import KubeAPIServer

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]

AUDIENCE = "https://broker.test"


def cluster_issuer(kube: KubeAPIServer, **overrides: Any) -> IssuerSettings:
    values: dict[str, Any] = {
        "name": "cluster",
        "url": kube.issuer,
        "provider": "kubernetes",
        "audiences": (AUDIENCE,),
        "ca_file": str(kube.ca_file),
    }
    values.update(overrides)
    return IssuerSettings(**values)


@pytest.fixture
def broker_token_file(kube: KubeAPIServer, namespace: str, tmp_path: Path) -> Path:
    """The broker's own ServiceAccount token (audience: the API server's), as a file."""
    kube.create_service_account(namespace, "broker")
    path = tmp_path / "broker-token"
    path.write_text(kube.token_request(namespace, "broker"))
    return path


@pytest_asyncio.fixture
async def reviewer(kube: KubeAPIServer, namespace: str) -> AsyncIterator[KubeClient]:
    """The broker's Kubernetes API client, allowed to create TokenReviews."""
    kube.create_service_account(namespace, "reviewer")
    kube.bind_role((namespace, "reviewer"), "system:auth-delegator")
    token = StaticToken(kube.token_request(namespace, "reviewer"), source="the test's reviewer")
    async with KubeClient(connection(kube.url, ca_file=kube.ca_file, token=token)) as client:
        yield client


async def caller_of(verifier: TokenVerifier[Any], token: str) -> Any:
    caller, _ = await verifier.verify(f"Bearer {token}")
    return caller


async def rejected(verifier: TokenVerifier[Any], token: str) -> TokenRejected:
    with pytest.raises(TokenRejected) as info:
        await verifier.verify(f"Bearer {token}")
    assert token not in str(info.value)
    return info.value


async def test_tokenrequest_tokens_verify_through_discovery_and_jwks(
    kube: KubeAPIServer, namespace: str, broker_token_file: Path
) -> None:
    verifier = configured_verifier(
        [cluster_issuer(kube, token_file=str(broker_token_file))], audience=AUDIENCE
    )
    assert await verifier.load() == {"cluster": True}
    assert verifier.readiness()["cluster"]["keys"] == 1
    kube.create_service_account(namespace, "agent")
    pod = kube.create_pod(namespace, "agent-0", "agent")
    plain = kube.token_request(namespace, "agent", AUDIENCE, 600)
    bound = kube.token_request(namespace, "agent", AUDIENCE, 601, bound_pod=pod)
    caller = await caller_of(verifier, plain)
    assert caller.subject == f"system:serviceaccount:{namespace}:agent"
    assert (caller.provider, caller.issuer, caller.audience) == (
        "kubernetes",
        kube.issuer,
        AUDIENCE,
    )
    assert caller.attributes == {"namespace": namespace, "service_account": "agent"}
    assert (await caller_of(verifier, bound)).attributes["pod"] == "agent-0"
    own_audience = kube.token_request(namespace, "agent")  # the API server's own audience
    assert (await rejected(verifier, own_audience)).code == "audience_mismatch"
    await verifier.aclose()


async def test_an_anonymous_read_is_refused_and_says_to_configure_token_file(
    kube: KubeAPIServer,
) -> None:
    verifier = configured_verifier([cluster_issuer(kube)], audience=AUDIENCE)
    assert await verifier.load() == {"cluster": False}
    status = verifier.readiness()["cluster"]
    assert status["ready"] is False
    assert "answered 403 to an anonymous request" in status["last_error"]
    assert "set token_file" in status["last_error"]
    await verifier.aclose()


async def test_a_token_file_the_api_server_refuses_is_named(
    kube: KubeAPIServer, tmp_path: Path
) -> None:
    stale = tmp_path / "token"
    stale.write_text("not-a-valid-token")
    verifier = configured_verifier([cluster_issuer(kube, token_file=str(stale))], audience=AUDIENCE)
    assert await verifier.load() == {"cluster": False}
    error = verifier.readiness()["cluster"]["last_error"]
    assert f"answered 401 to the token of token_file {stale}" in error
    assert "not-a-valid-token" not in error
    await verifier.aclose()


async def test_tokenreview_refuses_a_token_whose_pod_was_deleted(
    kube: KubeAPIServer, namespace: str, reviewer: KubeClient, broker_token_file: Path
) -> None:
    reviewing = configured_verifier(
        [cluster_issuer(kube, verification="tokenreview", tokenreview_cache_seconds=1)],
        audience=AUDIENCE,
        reviewer=reviewer,
    )
    deadline = time.monotonic() + 20  # RBAC reaches the authorizer through an informer
    while not (await reviewing.load())["cluster"]:
        assert time.monotonic() < deadline, reviewing.readiness()
        await asyncio.sleep(0.1)
    offline = configured_verifier(
        [cluster_issuer(kube, token_file=str(broker_token_file))], audience=AUDIENCE
    )
    kube.create_service_account(namespace, "agent")
    pod = kube.create_pod(namespace, "agent-0", "agent")
    seen = kube.token_request(namespace, "agent", AUDIENCE, 600, bound_pod=pod)
    unseen = [kube.token_request(namespace, "agent", AUDIENCE, 601 + i, bound_pod=pod)
              for i in range(30)]  # fmt: skip
    caller = await caller_of(reviewing, seen)
    assert caller.attributes == {
        "namespace": namespace,
        "service_account": "agent",
        "pod": "agent-0",
    }
    assert (await caller_of(offline, seen)).subject == caller.subject

    kube.delete(f"/api/v1/namespaces/{namespace}/pods/agent-0?gracePeriodSeconds=0")
    deleted = time.monotonic()
    for fresh in unseen:  # a token never reviewed: refused as soon as the API server knows
        try:
            await caller_of(reviewing, fresh)
        except TokenRejected as error:
            assert error.code == "token_revoked" and "its pod or secret is gone" in error.detail
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("no fresh token of the deleted pod was refused")
    assert time.monotonic() - deleted < 5
    while True:  # the reviewed one: once the API server's 10 s and our 1 s caches lapse
        try:
            await caller_of(reviewing, seen)
        except TokenRejected as error:
            assert error.code == "token_revoked"
            break
        assert time.monotonic() - deleted < 20
        await asyncio.sleep(0.2)
    assert (await caller_of(offline, seen)).subject == caller.subject  # JWKS cannot tell
    await reviewing.aclose()
    await offline.aclose()
