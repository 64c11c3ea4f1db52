"""``LocalBroker``'s parts: ``tokens``, ``inspect`` and ``faults``, and the broker's earlier
method names, which stay as delegates to them (docs/local-broker.md, "Python API")."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from k8s_agent_sandbox_awx import testing
from k8s_agent_sandbox_awx.testing import Faults, Inspection, LocalBroker, Tokens

# the broker's method -> (its part, the part's method)
DELEGATES: dict[str, tuple[str, str]] = {
    "add_issuer": ("tokens", "add_issuer"),
    "issue_kubernetes_token": ("tokens", "issue_kubernetes"),
    "issue_gitlab_token": ("tokens", "issue_gitlab"),
    "rotate_keys": ("tokens", "rotate_keys"),
    "revoke_token": ("tokens", "revoke"),
    "write_projected_token": ("tokens", "write_projected"),
    "keep_projected_token_rotated": ("tokens", "keep_projected_rotated"),
    "environ": ("tokens", "environ"),
    "claims": ("inspect", "claims"),
    "sandboxes": ("inspect", "sandboxes"),
    "sandbox_name": ("inspect", "sandbox_name"),
    "execution_count": ("inspect", "execution_count"),
    "runtime_pid": ("inspect", "runtime_pid"),
    "set_readiness_delay": ("faults", "set_readiness_delay"),
    "inject_unavailable": ("faults", "inject_unavailable"),
    "drop_connection_after_execute": ("faults", "drop_connection_after_execute"),
    "cut_event_streams": ("faults", "cut_event_streams"),
    "drop_event_stream_mid_line": ("faults", "drop_event_stream_mid_line"),
    "crash_next_start": ("faults", "crash_next_start"),
    "clear_faults": ("faults", "clear"),
}
PARTS = {"tokens": Tokens, "inspect": Inspection, "faults": Faults}


def _sample_arguments(signature: inspect.Signature) -> tuple[list[Any], dict[str, Any]]:
    """One distinct value per parameter (positional ones by position, keyword-only by name)."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for index, (name, parameter) in enumerate(signature.parameters.items()):
        value = f"value-{index}"
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            kwargs[name] = value
        else:
            args.append(value)
    return args, kwargs


def test_the_parts_are_exported() -> None:
    for name, cls in PARTS.items():
        assert getattr(testing, cls.__name__) is cls, name
        assert cls.__name__ in testing.__all__


@pytest.mark.parametrize("method", sorted(DELEGATES))
def test_each_earlier_method_is_a_delegate_with_the_same_signature(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    part_name, part_method = DELEGATES[method]
    own = inspect.signature(getattr(LocalBroker, method))
    theirs = inspect.signature(getattr(PARTS[part_name], part_method))
    assert list(own.parameters)[1:] == list(theirs.parameters)[1:]
    assert [p.default for p in own.parameters.values()][1:] == [
        p.default for p in theirs.parameters.values()
    ][1:]
    assert own.return_annotation == theirs.return_annotation
    assert f"{PARTS[part_name].__name__}.{part_method}" in (
        getattr(LocalBroker, method).__doc__ or ""
    )

    broker = LocalBroker(warn=False)  # not started: the parts exist from construction on
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def record(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "back"

    monkeypatch.setattr(getattr(broker, part_name), part_method, record)
    args, kwargs = _sample_arguments(inspect.signature(getattr(broker, method)))
    result = getattr(broker, method)(*args, **kwargs)
    assert len(calls) == 1, calls
    # the same arguments arrive, whether the delegate passes them by position or by name
    called_args, called_kwargs = calls[0]
    assert (
        theirs.bind(None, *called_args, **called_kwargs).arguments
        == own.bind(None, *args, **kwargs).arguments
    )
    assert result == (None if own.return_annotation == "None" else "back")


def test_the_parts_refuse_before_start() -> None:
    broker = LocalBroker(warn=False)
    with pytest.raises(RuntimeError, match="not running"):
        broker.tokens.add_issuer("extra")
    with pytest.raises(RuntimeError, match="not running"):
        broker.inspect.claims()
    with pytest.raises(RuntimeError, match="not running"):
        broker.faults.inject_unavailable(sandbox="some-sandbox")  # names resolved: needs state


def test_the_parts_of_a_running_broker(broker: LocalBroker, api: Any) -> None:
    alice = api(broker.tokens.issue_kubernetes("team-a", "alice"))
    sandbox = alice.ready()
    assert [c["metadata"]["name"] for c in broker.inspect.claims()] == [
        c["metadata"]["name"] for c in broker.claims()
    ]
    assert [s["name"] for s in broker.inspect.sandboxes()] == [sandbox["name"]]
    assert alice.run(sandbox, "true").status_code == 200
    assert broker.inspect.execution_count(sandbox["name"]) == 1
    assert broker.inspect.runtime_pid(sandbox["name"]) == broker.runtime_pid(sandbox["name"])

    broker.faults.inject_unavailable(1, scope="data", sandbox=sandbox["name"])
    assert alice.run(sandbox, "true").status_code == 503
    broker.faults.inject_unavailable(1, scope="data")
    broker.faults.clear()
    assert alice.run(sandbox, "true").status_code == 200

    gitlab = api(broker.tokens.issue_gitlab("group/project"))
    assert gitlab.http.get("/v1/whoami").json()["provider"] == "gitlab"
    broker.tokens.revoke(alice.token)
    resp = alice.http.get("/v1/whoami")
    assert resp.status_code == 401
    assert resp.json()["code"] == "token_revoked"
    assert broker.tokens.issuers == broker.issuers
    assert broker.tokens.kubernetes is broker.kubernetes
