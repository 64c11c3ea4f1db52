"""A sandbox's lifetime from the client: ``timeout=`` at create (default 300 s, from
``AGENT_SANDBOX_TTL_SECONDS``), ``set_timeout``, ``get_info``, ``is_running``, the policy cap,
and the opt-in activity keepalive, against the local broker (policy cap: 120 s)."""

from __future__ import annotations

import json
import time
from typing import Any
from unittest.mock import ANY

import pytest

from k8s_agent_sandbox_awx import KubernetesAuth, Sandbox, SandboxInfo
from k8s_agent_sandbox_awx.client.wire._dialect import LIST
from k8s_agent_sandbox_awx.client.wire._protocol import rfc3339_seconds
from k8s_agent_sandbox_awx.errors import BrokerError, LifetimeExceedsPolicyError

pytestmark = pytest.mark.e2e
ENV_TTL, URL = "AGENT_SANDBOX_TTL_SECONDS", "AGENT_SANDBOX_BROKER_URL"


def _options(broker: Any, **extra: str) -> dict[str, Any]:
    env = broker.environ("kubernetes", namespace="team-a", service_account="agent")
    auth = KubernetesAuth(env.pop("AGENT_SANDBOX_TOKEN_FILE"))
    return {"auth": auth, "environ": {**env, **extra}}


def _lifetime(info: SandboxInfo) -> float:
    return (rfc3339_seconds(info.expires_at) or 0) - (rfc3339_seconds(info.created_at) or 0)


def _claimed(broker: Any, sandbox: Sandbox) -> tuple[float, float]:
    """``(created, deadline)`` of ``sandbox``'s claim as the broker keeps it (both dialects;
    under ``/rpc`` ``.info`` has no times: the status answer has none)."""
    [claim] = [c for c in broker.claims() if c["metadata"]["name"] == sandbox.name]
    created = rfc3339_seconds(claim["metadata"]["creationTimestamp"]) or 0
    return created, rfc3339_seconds(claim["spec"]["lifecycle"]["shutdownTime"]) or 0


def test_timeout_default_environment_and_policy_cap(files_broker: Any, dialect: str) -> None:
    # v1 refuses a lifetime past the cap (LifetimeExceedsPolicyError), /rpc's create answers 400
    with pytest.raises(LifetimeExceedsPolicyError if dialect == "v1" else BrokerError) as over:
        # a chosen 300 s is over the 120 s cap (the SDK's default 300 s is cut: below)
        Sandbox.create(**_options(files_broker, AGENT_SANDBOX_TTL_SECONDS="300"))
    message = str(over.value)
    assert "120" in message and "AGENT_SANDBOX_TTL_SECONDS" in message
    assert files_broker.claims() == []
    # issue 22: zero configuration works under a cap below the SDK's default: cut at the cap
    with Sandbox.create(**_options(files_broker)) as sb:
        created, deadline = _claimed(files_broker, sb)
        assert deadline - created == pytest.approx(120, abs=1)
        if dialect == "v1":
            assert _lifetime(sb.info) == 120
    with Sandbox.create(**_options(files_broker, AGENT_SANDBOX_TTL_SECONDS="60")) as sb:
        created, deadline = _claimed(files_broker, sb)
        assert deadline - created == pytest.approx(60, abs=1)  # /rpc: from the client's clock
        if dialect == "v1":  # /rpc: .info has no times
            assert _lifetime(sb.info) == 60
    with Sandbox.create(timeout=90, **_options(files_broker)) as sb:
        info = sb.get_info()
        created, deadline = _claimed(files_broker, sb)
        if dialect == "v1":
            assert _lifetime(info) == 90 and info.started_at is not None
            assert 0 < (info.seconds_left() or 0) <= 90
        assert sb.is_running()
        if dialect == "v1":
            with pytest.raises(LifetimeExceedsPolicyError, match="at most"):
                sb.set_timeout(500)
            assert sb.get_info().expires_at == info.expires_at  # nothing changed
            assert _claimed(files_broker, sb) == (created, deadline)
        else:  # /rpc cuts the deadline at the cap from creation
            capped = sb.set_timeout(500)
            assert rfc3339_seconds(capped.expires_at) == _claimed(files_broker, sb)[1]
            assert _claimed(files_broker, sb)[1] == pytest.approx(created + 120, abs=1)
            assert sb.client.extend(sb.name, 500).capped
        longer = sb.set_timeout(110.2)  # rounded up to whole seconds
        assert (rfc3339_seconds(longer.expires_at) or 0) > deadline
        assert _claimed(files_broker, sb)[1] == rfc3339_seconds(longer.expires_at)
        assert sb.info == longer
        with pytest.raises(ValueError, match="positive"):
            sb.set_timeout(0)
    assert not sb.is_running()  # killed (its connections closed): no request needed


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_set_timeout_shortening_makes_the_broker_delete_it_on_time(files_broker: Any) -> None:
    sb = Sandbox.create(timeout=100, **_options(files_broker))
    try:
        deadline = rfc3339_seconds(sb.set_timeout(2).expires_at) or 0
        assert deadline <= time.time() + 2
        while sb.is_running():
            assert time.time() < deadline + 5, "the broker did not delete the sandbox on time"
            time.sleep(0.2)
        assert time.time() >= deadline - 1
        if LIST in sb.client.dialect.features:  # listed while Terminating (Kubernetes), then gone
            while [i.name for i in Sandbox.list(**_options(files_broker))]:
                assert time.time() < deadline + 5, "the broker still lists the sandbox"
                time.sleep(0.2)
        # the claim goes with the sandbox (an /rpc status can say so a moment before it is gone)
        while [c for c in files_broker.claims() if c["metadata"]["name"] == sb.name]:
            assert time.time() < deadline + 5, "the broker did not delete the claim on time"
            time.sleep(0.05)
    finally:
        sb.kill()


@pytest.mark.slow
@pytest.mark.usefixtures("dialect")  # once per dialect
def test_keepalive_keeps_a_busy_sandbox_and_lets_an_idle_one_expire(files_broker: Any) -> None:
    # idle first: busy's first call follows its create at once (a slow second create, a cold
    # pod on a busy machine, must not eat busy's 5 s before its keepalive starts)
    idle = Sandbox.create(timeout=5, keepalive=5, **_options(files_broker))
    busy = Sandbox.create(timeout=5, keepalive=5, **_options(files_broker))
    try:
        idle_deadline = _claimed(files_broker, idle)[1]
        until = time.time() + 9
        while time.time() < until:
            assert busy.files.exists("nothing") is False  # data-plane activity
            time.sleep(0.4)
        assert time.time() > idle_deadline + 3
        assert busy.is_running()  # past its initial 3 s, kept alive by its activity
        assert not idle.is_running()  # never used: expired on time
    finally:
        busy.kill()
        idle.kill()


@pytest.mark.usefixtures("dialect")  # once per dialect
def test_keepalive_never_fails_the_operation(
    files_broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with Sandbox.create(timeout=100, keepalive=30, **_options(files_broker)) as sb:
        target = sb.files._api.target
        target.keepalive.name = "sbx-gone0000"  # the extension will be refused (404)
        target.keepalive.deadline = None
        with caplog.at_level("WARNING", logger="k8s_agent_sandbox_awx.transport"):
            assert sb.files.write("a.txt", b"still works").size == 11
        assert "keepalive of sandbox sbx-gone0000 failed (ignored)" in caplog.text


def test_keepalive_never_delays_the_call_it_rides_on(
    files_broker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 19 item 10: while the control plane answers 503 (Retry-After: 3), a data-plane
    call waits for one short attempt of the extension at most (it waited for the extension's
    whole retry budget, 9 s); the failure is logged, and the next call tries the extension
    again (it waited half a keepalive window)."""
    with Sandbox.create(timeout=30, keepalive=100, **_options(files_broker)) as sb:
        lifetime = f"/v1/sandboxes/{sb.name}/lifetime"
        files_broker.inject_unavailable(50, retry_after=3, scope="control", path=lifetime)
        with caplog.at_level("WARNING", logger="k8s_agent_sandbox_awx.transport"):
            started = time.monotonic()
            assert sb.files.exists("nothing") is False
            assert time.monotonic() - started < 2.0
        assert f"keepalive of sandbox {sb.name} failed" in caplog.text
        assert "Bearer" not in caplog.text
        files_broker.clear_faults()
        before = _claimed(files_broker, sb)[1]
        assert sb.files.exists("nothing") is False  # the next opportunity
        assert _claimed(files_broker, sb)[1] > before + 30  # extended to now + 100 s


def _create_spec(dialect: str, config: Any, seconds: int | None = None) -> Any:
    from k8s_agent_sandbox_awx.client.core import _flow as flow
    from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect

    spec = flow.SandboxSpec(lifetime_seconds=seconds)
    return flow.plan_create(config, get_dialect(dialect), spec).spec


def _sent_lifetime(spec: Any) -> Any:
    body = json.loads(spec.content)
    return body.get("lifetime_seconds", body.get("lifecycle"))


@pytest.mark.parametrize("name", ["v1", "rpc"])
def test_only_the_sdks_default_lifetime_is_marked_for_the_cap(name: str) -> None:
    """Issue 22: a create made without a lifetime (no ``timeout=``, no
    ``AGENT_SANDBOX_TTL_SECONDS``) sends the default 300 s as before (an older broker sees the
    same body) plus ``Prefer: clamp-lifetime``; a lifetime the caller chose is sent unmarked."""
    from k8s_agent_sandbox_awx import BrokerConnectionConfig

    base = {"AGENT_SANDBOX_BROKER_URL": "https://broker.example"}
    default = BrokerConnectionConfig.from_env(base)
    marked = _create_spec(name, default)
    assert marked.headers.get("Prefer") == "clamp-lifetime"
    assert _sent_lifetime(marked) in (300, {"shutdownTime": ANY, "shutdownPolicy": "Delete"})
    chosen = [
        _create_spec(name, BrokerConnectionConfig.from_env({**base, ENV_TTL: "300"})),
        _create_spec(name, default, 300),  # timeout=300
        _create_spec(name, BrokerConnectionConfig(broker_url=base[URL], sandbox_timeout=300)),
    ]
    for spec in chosen:
        assert "Prefer" not in spec.headers and _sent_lifetime(spec) is not None
    maximum = _create_spec(name, BrokerConnectionConfig.from_env({**base, ENV_TTL: "0"}))
    assert "Prefer" not in maximum.headers and _sent_lifetime(maximum) is None


def test_lifetime_settings_from_the_environment_and_arguments() -> None:
    from k8s_agent_sandbox_awx import BrokerConnectionConfig
    from k8s_agent_sandbox_awx.client.core._flow import sandbox_timeout, spec_from_create
    from k8s_agent_sandbox_awx.errors import ConfigurationError

    base = {"AGENT_SANDBOX_BROKER_URL": "https://broker.example"}
    config = BrokerConnectionConfig.from_env(base)
    assert (config.sandbox_timeout, config.sandbox_keepalive) == (300, 0)
    env = {**base, "AGENT_SANDBOX_TTL_SECONDS": "0", "AGENT_SANDBOX_KEEPALIVE_TTL_SECONDS": "60"}
    config = BrokerConnectionConfig.from_env(env)
    assert (config.sandbox_timeout, config.sandbox_keepalive) == (0, 60)
    assert sandbox_timeout(None, config) is None  # 0: the policy's maximum
    assert sandbox_timeout(45, config) == 45
    with pytest.raises(ConfigurationError, match="AGENT_SANDBOX_TTL_SECONDS"):
        BrokerConnectionConfig.from_env({**base, "AGENT_SANDBOX_TTL_SECONDS": "5m"})
    assert spec_from_create(None, None, {"lifetime_seconds": 60}).lifetime_seconds == 60
    assert spec_from_create(None, None, {"timeout": 60.0}).lifetime_seconds == 60
    with pytest.raises(ConfigurationError, match="differ"):
        spec_from_create(None, None, {"timeout": 60, "lifetime_seconds": 30})
    with pytest.raises(TypeError, match="whole number"):
        spec_from_create(None, None, {"timeout": 1.5})
    with pytest.raises(ValueError, match="positive"):
        spec_from_create(None, None, {"timeout": 0})


def test_keepalive_is_due_once_per_half_window_and_only_when_it_extends() -> None:
    from k8s_agent_sandbox_awx.client.wire._dataplane import Keepalive

    now = [1000.0]
    keepalive = Keepalive("sbx", 60, deadline=1300.0, clock=lambda: now[0])
    assert not keepalive.claim()  # now + 60 is before the deadline it knows
    now[0] = 1250.0
    assert keepalive.claim()  # 1310 > 1300: extend
    keepalive.deadline = 1310.0
    now[0] = 1270.0
    assert not keepalive.claim()  # within the half window
    now[0] = 1281.0
    assert keepalive.claim()
