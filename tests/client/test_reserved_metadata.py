"""Metadata the SDK refuses before sending anything (issue 26, item 18): keys under the broker's
prefix (its attribution stamps) and under upstream's own ``agents.x-k8s.io/`` (which upstream's
controller reads: ``agents.x-k8s.io/sandbox-name`` on a claim names a Sandbox to adopt) are a
``ReservedMetadataError`` naming the key, the rule and the fix, in both dialects, sync and
async, before any request (the dialect's detection probe too); the broker's own ``403
reserved_metadata`` is the same error."""

from __future__ import annotations

import asyncio
import json
import pickle
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import (
    AsyncBrokerSandboxClient,
    BrokerPermissionError,
    BrokerSandboxClient,
    OIDCTokenAuth,
    errors,
)
from k8s_agent_sandbox_awx.client.wire import _dialect_rpc as rpc
from k8s_agent_sandbox_awx.client.wire import _dialect_v1 as v1
from k8s_agent_sandbox_awx.client.wire._dialect import CreateRequest
from k8s_agent_sandbox_awx.client.wire._protocol import RequestSpec

BROKER = "broker.agent-sandbox-awx.io/"
UPSTREAM = "agents.x-k8s.io/"

REFUSED = [
    ("annotations", BROKER + "subject", BROKER),
    ("labels", BROKER + "owner", BROKER),
    ("annotations", UPSTREAM + "sandbox-name", UPSTREAM),
    ("labels", UPSTREAM + "claim-uid", UPSTREAM),
    ("annotations", "extensions.agents.x-k8s.io/anything", "extensions.agents.x-k8s.io/"),
    ("pod_labels", UPSTREAM + "sandbox-name-hash", UPSTREAM),
    ("pod_annotations", UPSTREAM + "pod-name", UPSTREAM),
]


def _never_sent(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"sent {request.method} {request.url} before refusing the metadata")


def _check(error: errors.ReservedMetadataError, field: str, key: str, prefix: str) -> None:
    assert isinstance(error, BrokerPermissionError) and isinstance(error, ValueError)
    assert (error.code, error.status_code, error.request_sent) == ("reserved_metadata", None, False)
    assert (error.key, error.field, error.prefix) == (key, field, prefix)
    text = str(error)
    assert repr(key) in text and repr(prefix) in text  # the key and the rule
    assert "example.com/" in text  # the fix: a key under a prefix of your own


@pytest.mark.parametrize("protocol", ["v1", "rpc", None])  # None: detected (a probe)
@pytest.mark.parametrize(("field", "key", "prefix"), REFUSED)
def test_reserved_metadata_is_refused_before_anything_is_sent(
    protocol: str | None, field: str, key: str, prefix: str
) -> None:
    client = BrokerSandboxClient(
        broker_url="https://broker.test",
        auth=OIDCTokenAuth("t"),
        broker_protocol=protocol,
        http_transport=httpx.MockTransport(_never_sent),
    )
    with client, pytest.raises(errors.ReservedMetadataError) as info:
        client.create_sandbox(**{field: {key: "x"}})  # type: ignore[arg-type]
    _check(info.value, field, key, prefix)


@pytest.mark.parametrize(("field", "key", "prefix"), REFUSED[:3])
def test_the_async_client_refuses_it_before_anything_is_sent(
    field: str, key: str, prefix: str
) -> None:
    async def create() -> None:
        async with AsyncBrokerSandboxClient(
            broker_url="https://broker.test",
            auth=OIDCTokenAuth("t"),
            http_transport=httpx.MockTransport(_never_sent),
        ) as client:
            await client.create_sandbox(**{field: {key: "x"}})  # type: ignore[arg-type]

    with pytest.raises(errors.ReservedMetadataError) as info:
        asyncio.run(create())
    _check(info.value, field, key, prefix)


@pytest.mark.parametrize(("field", "key", "prefix"), REFUSED[:5])
def test_the_v1_dialect_refuses_it_too(field: str, key: str, prefix: str) -> None:
    with pytest.raises(errors.ReservedMetadataError) as info:
        v1.create(idempotency_key="k", **{field: {key: "x"}})
    _check(info.value, field, key, prefix)


@pytest.mark.parametrize(("field", "key", "prefix"), REFUSED)
def test_the_rpc_dialect_refuses_it_too(field: str, key: str, prefix: str) -> None:
    with pytest.raises(errors.ReservedMetadataError) as info:
        rpc.create(CreateRequest(idempotency_key="k", **{field: {key: "x"}}))
    _check(info.value, field, key, prefix)


def test_upstreams_created_by_label_and_lookalike_prefixes_are_the_callers() -> None:
    """Upstream's own client marks its claims with the label ``agents.x-k8s.io/created-by``
    (the ``/rpc`` dialect sends it): a caller may set it; a key that only looks like the
    prefix (another domain, no prefix at all) is the caller's too."""
    labels = {
        UPSTREAM + "created-by": "my-tool",
        "my-agents.x-k8s.io/x": "y",
        "agents.x-k8s.io.example.com/x": "y",
        "sandbox-name": "y",
    }
    spec = v1.create(idempotency_key="k", labels=labels, annotations={"team/agents.x": "y"})
    assert json.loads(spec.content or b"")["labels"] == labels
    rpc.create(CreateRequest(idempotency_key="k", labels=labels))
    with pytest.raises(errors.ReservedMetadataError, match="created-by"):  # a label only
        v1.create(idempotency_key="k", annotations={UPSTREAM + "created-by": "x"})


def test_the_brokers_403_reserved_metadata_is_the_same_error() -> None:
    body = {"code": "reserved_metadata", "detail": "annotation 'agents.x-k8s.io/x' is reserved"}
    error = v1.error_from_response(
        403, {}, json.dumps(body).encode(), spec=RequestSpec("POST", "/v1/sandboxes", "create")
    )
    assert isinstance(error, errors.ReservedMetadataError)
    assert (error.status_code, error.code, error.request_sent) == (403, "reserved_metadata", True)
    assert UPSTREAM in str(error)  # the hint names both prefixes


def test_the_error_survives_pickling() -> None:
    client = BrokerSandboxClient(
        broker_url="https://broker.test",
        auth=OIDCTokenAuth("t"),
        broker_protocol="v1",
        http_transport=httpx.MockTransport(_never_sent),
    )
    with client, pytest.raises(errors.ReservedMetadataError) as info:
        client.create_sandbox(annotations={UPSTREAM + "sandbox-name": "other"})
    copy: Any = pickle.loads(pickle.dumps(info.value))
    assert (type(copy), copy.key, str(copy)) == (type(info.value), info.value.key, str(info.value))
