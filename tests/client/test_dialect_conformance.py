"""The dialect-conformance suite: the same control-plane behaviour from every registered
dialect, against the local broker (docs/architecture.md). A new dialect registered in
``_dialects`` runs these tests by being registered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from k8s_agent_sandbox_awx import BrokerConnectionConfig, BrokerSandboxClient, Sandbox
from k8s_agent_sandbox_awx.client.core import _flow as flow
from k8s_agent_sandbox_awx.client.wire._dialect import LIFETIME, LIST, SANDBOX_ENV, WHOAMI, Dialect
from k8s_agent_sandbox_awx.client.wire._dialect_v1 import V1Dialect
from k8s_agent_sandbox_awx.client.wire._dialects import DIALECTS, get_dialect
from k8s_agent_sandbox_awx.errors import (
    BrokerPermissionError,
    BrokerQuotaError,
    BrokerUnavailableError,
    BrokerWarmPoolNotFoundError,
    ConfigurationError,
    SandboxNotFoundError,
    SandboxReadyTimeoutError,
    SandboxTemplateNotFoundError,
    UnsupportedOperationError,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(params=sorted(DIALECTS))
def dialect(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def client(broker: Any, dialect: str) -> Iterator[BrokerSandboxClient]:
    env = broker.environ("kubernetes", namespace="team-c", service_account="agent")
    with BrokerSandboxClient(environ=env, broker_protocol=dialect) as made:
        assert made.dialect is get_dialect(dialect)
        yield made


def needs(client: BrokerSandboxClient, feature: str) -> None:
    if feature not in client.dialect.features:
        pytest.skip(f"the {client.dialect.name!r} dialect has no {feature} operation")


def test_create_is_ready_listed_found_and_deleted_once(client: BrokerSandboxClient) -> None:
    sandbox = client.create_sandbox()
    assert sandbox.info.ready and sandbox.sandbox_id
    assert client.get_info(sandbox.name).name == sandbox.name
    if LIST in client.dialect.features:
        assert sandbox.name in [info.name for info in client.list_sandboxes()]
    assert client.delete(sandbox.name) is True
    deadline = time.monotonic() + 10
    while True:  # repeating is never an error (it may be Terminating)
        try:
            gone = not client.delete(sandbox.name) or client.get_info(sandbox.name) is None
        except SandboxNotFoundError:  # a dialect whose delete cannot tell "already gone"
            gone = True
        if gone:
            break
        assert time.monotonic() < deadline, "the sandbox was never gone"
        time.sleep(0.1)
    with pytest.raises(SandboxNotFoundError):  # once gone: not found here
        client.get_info(sandbox.name)
    sandbox._killed = True  # deleted above: nothing for the client's exit to do


def test_the_data_plane_reaches_the_sandbox_with_the_dialects_headers(
    client: BrokerSandboxClient,
) -> None:
    sandbox = client.create_sandbox()
    assert sandbox.commands.run("echo hi").stdout == "hi\n"
    sandbox.files.write("conformance.txt", b"data")
    assert sandbox.files.read("conformance.txt") == b"data"
    sandbox.kill()


def test_whoami_and_healthz(client: BrokerSandboxClient) -> None:
    if WHOAMI in client.dialect.features:
        assert client.whoami()["subject"].endswith(":agent")
    else:
        with pytest.raises(UnsupportedOperationError, match=repr(client.dialect.name)):
            client.whoami()
    health = client.healthz()  # an answer (with the broker's Date), whatever its status
    assert health.status_code < 500 and health.headers.get("date")


def test_what_a_dialect_lacks_is_a_typed_error_before_sending(
    client: BrokerSandboxClient, broker: Any
) -> None:
    dialect = client.dialect
    before = len(broker.claims(include_deleted=True))
    calls = (
        (LIST, client.list_sandboxes),
        (WHOAMI, client.whoami),
        (SANDBOX_ENV, lambda: client.create_sandbox(env={"A": "b"})),
    )
    for capability, call in calls:
        if capability in dialect.features:
            continue
        with pytest.raises(UnsupportedOperationError) as info:
            call()
        assert info.value.dialect == dialect.name and isinstance(info.value, NotImplementedError)
        assert repr(dialect.name) in str(info.value)
    assert len(broker.claims(include_deleted=True)) == before  # refused before creating


def test_errors_are_typed(client: BrokerSandboxClient, broker: Any, dialect: str) -> None:
    before = len(broker.claims(include_deleted=True))
    # v1: the broker refuses the template; /rpc: the claim fails (unknown warm pool) and the
    # create deletes it
    with pytest.raises((SandboxTemplateNotFoundError, BrokerWarmPoolNotFoundError)):
        client.create_sandbox(template="no-such-template")
    if dialect == "v1":
        assert len(broker.claims(include_deleted=True)) == before
    assert [c for c in broker.claims() if not c["metadata"].get("deletionTimestamp")] == []
    with pytest.raises(SandboxNotFoundError):
        client.get_info("no-such-sandbox")
    other = broker.environ("kubernetes", namespace="team-c", service_account="intruder")
    mine = client.create_sandbox()
    # another identity's sandbox: v1 does not disclose it (404), /rpc refuses it (403)
    with pytest.raises((SandboxNotFoundError, BrokerPermissionError)):
        Sandbox.connect(mine.name, environ=other, config=client.connection_config)
    for _ in range(4):  # the default policy's max_sandboxes is 5
        client.create_sandbox()
    with pytest.raises(BrokerQuotaError):
        client.create_sandbox()


def test_a_failed_create_is_rolled_back(
    client: BrokerSandboxClient, broker: Any, live: Any
) -> None:
    broker.set_readiness_delay(30)
    with pytest.raises(SandboxReadyTimeoutError):
        client.create_sandbox(sandbox_ready_timeout=1)
    assert live(broker) == []


def test_an_unknown_dialect_is_a_configuration_error(broker: Any) -> None:
    with pytest.raises(ConfigurationError, match="broker protocol"):
        BrokerSandboxClient(environ=broker.environ("kubernetes"), broker_protocol="nope")


def test_extend_moves_the_deadline(client: BrokerSandboxClient) -> None:
    sandbox = client.create_sandbox()
    lifetime = client.extend(sandbox.name, 120)
    assert lifetime.expires_at and not lifetime.capped
    with pytest.raises(SandboxNotFoundError):
        client.extend("no-such-sandbox", 60)
    with pytest.raises(ValueError, match="seconds"):
        client.extend(sandbox.name, 0)


def test_an_interrupted_create_is_replayed_only_by_a_dialect_that_can(
    client: BrokerSandboxClient,
) -> None:
    """The create may have reached the broker but its answer was lost: a dialect with
    idempotent creates sends the same request (same key) again to find and delete what it
    made; one without says so in the error."""
    op = flow.create(plan_for(client.dialect))
    first = next(op)
    lost = BrokerUnavailableError("the answer was lost", request_sent=True)
    if "idempotent_create" in client.dialect.features:
        assert op.throw(lost).spec is first.spec
    else:
        with pytest.raises(BrokerUnavailableError) as info:
            op.throw(lost)
        assert client.dialect.name in "".join(info.value.__notes__)


def test_a_missing_feature_is_refused_naming_the_dialect() -> None:
    """What a second dialect lacks is a clear error naming it (``Dialect.require``), and an
    interrupted create is not replayed by a dialect that cannot."""

    class Minimal(V1Dialect):
        name = "minimal"
        features = frozenset()

    with pytest.raises(ConfigurationError, match="'minimal' dialect, which has no whoami"):
        Minimal().require("whoami", "ask the broker who I am")
    op = flow.create(plan_for(Minimal()))
    next(op)
    with pytest.raises(BrokerUnavailableError) as info:
        op.throw(BrokerUnavailableError("lost", request_sent=True))
    assert "'minimal' dialect cannot replay a create" in "".join(info.value.__notes__)


def plan_for(dialect: Dialect) -> flow.CreatePlan:
    config = BrokerConnectionConfig(broker_url="https://broker.test")
    return flow.plan_create(config, dialect, flow.SandboxSpec())


PAST_THE_CAP = {"v1": "refused", "rpc": "capped"}
"""What each dialect documents for a new deadline past the policy's cap (counted from
creation): ``v1`` refuses it (``LifetimeExceedsPolicyError``; nothing changes), ``/rpc`` cuts it
at the cap and says so (``Lifetime.capped``). A new dialect declares its rule here."""


def _claimed(broker: Any, sandbox: Sandbox) -> tuple[float, float]:
    """``(created, deadline)`` of ``sandbox``'s claim as the broker keeps it (the claim is
    named ``sandbox.name`` under every dialect)."""
    from k8s_agent_sandbox_awx.client.wire._protocol import rfc3339_seconds

    [claim] = [c for c in broker.claims() if c["metadata"]["name"] == sandbox.name]
    created = rfc3339_seconds(claim["metadata"]["creationTimestamp"]) or 0
    return created, rfc3339_seconds(claim["spec"]["lifecycle"]["shutdownTime"]) or 0


def test_the_lifetime_is_set_moved_and_capped(
    client: BrokerSandboxClient, broker: Any, dialect: str
) -> None:
    """``timeout=`` at create and ``set_timeout``/``extend`` (the dialect's ``extend``): the
    deadline moves both ways; past the policy's cap each dialect does what it documents
    (:data:`PAST_THE_CAP`); a create past the cap is refused by both (``/rpc``: a plain 400
    that names the SDK's setting)."""
    from k8s_agent_sandbox_awx.client.wire._protocol import rfc3339_seconds
    from k8s_agent_sandbox_awx.errors import BrokerError, LifetimeExceedsPolicyError

    needs(client, LIFETIME)
    cap = broker.kubernetes.policy.max_lifetime_seconds
    refused = LifetimeExceedsPolicyError if dialect == "v1" else BrokerError
    with pytest.raises(refused) as over:
        client.create_sandbox(shutdown_after_seconds=cap + 60)
    assert str(cap) in str(over.value) and "AGENT_SANDBOX_TTL_SECONDS" in str(over.value)
    assert [c for c in broker.claims() if not c["metadata"].get("deletionTimestamp")] == []

    sandbox = client.create_sandbox(shutdown_after_seconds=120)
    created, deadline = _claimed(broker, sandbox)
    assert deadline - created == pytest.approx(120, abs=1)
    left = sandbox.get_info().seconds_left()
    if dialect == "rpc":  # its status answer carries no deadline (docs/client.md)
        assert left is None
    else:
        assert left is not None and 100 < left <= 120
    shorter = sandbox.set_timeout(30)
    assert (rfc3339_seconds(shorter.expires_at) or 0) <= time.time() + 31
    assert _claimed(broker, sandbox)[1] == rfc3339_seconds(shorter.expires_at)
    longer = client.extend(sandbox.name, 200)
    assert (rfc3339_seconds(longer.expires_at) or 0) > time.time() + 150 and not longer.capped
    assert _claimed(broker, sandbox)[1] == rfc3339_seconds(longer.expires_at)

    rule = PAST_THE_CAP[dialect]
    if rule == "refused":
        with pytest.raises(LifetimeExceedsPolicyError):
            sandbox.set_timeout(10**6)
        with pytest.raises(LifetimeExceedsPolicyError):
            client.extend(sandbox.name, 10**6)
        assert _claimed(broker, sandbox)[1] == rfc3339_seconds(longer.expires_at)  # unchanged
    else:
        assert rule == "capped"
        cut = client.extend(sandbox.name, 10**6)
        assert cut.capped and rfc3339_seconds(cut.expires_at) == _claimed(broker, sandbox)[1]
        assert rfc3339_seconds(cut.expires_at) == pytest.approx(created + cap, abs=1)
        assert sandbox.set_timeout(10**6).expires_at == cut.expires_at  # no error either
    sandbox.kill()
