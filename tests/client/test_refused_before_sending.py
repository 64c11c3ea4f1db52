"""What a sandbox cannot carry is refused by the client before anything is sent: a lone
surrogate in a command's argv, environment or stdin (a ``ValueError`` naming it, never the
runtime failing mid-answer), and ``timeout=``/``keepalive=`` of NaN or infinity (naming the
option, never Python's own ``ValueError``/``OverflowError``)."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from k8s_agent_sandbox_awx import KubernetesAuth, Sandbox

pytestmark = pytest.mark.e2e


def _options(broker: Any) -> dict[str, Any]:
    env = broker.environ("kubernetes", namespace="team-a", service_account="agent")
    auth = KubernetesAuth(env.pop("AGENT_SANDBOX_TOKEN_FILE"))
    return {"auth": auth, "environ": env}


@pytest.mark.parametrize("where", ["argv", "envs", "stdin"])
def test_a_lone_surrogate_is_refused_before_sending(broker: Any, where: str) -> None:
    """A ``str`` can hold a lone surrogate (``os.fsdecode`` of odd bytes, ``errors=
    "surrogateescape"``); UTF-8 cannot. Like a NUL byte or a path's lone surrogate (refused by
    the file API), it must be a clear ``ValueError`` naming the argument before anything is
    sent, never the runtime failing mid-answer (a 502 that says the sandbox is unreachable)."""
    with Sandbox.create(timeout=60, **_options(broker)) as sb:
        with pytest.raises(ValueError) as refused:
            if where == "argv":
                sb.commands.run(["echo", "\ud800"], timeout=10)
            elif where == "envs":
                sb.commands.run(["true"], envs={"A": "\ud800"}, timeout=10)
            else:
                handle = sb.commands.run("cat", background=True, stdin=True)
                try:
                    handle.send_stdin("\ud800")
                finally:
                    handle.kill()
        assert "surrogate" in str(refused.value) or "UTF-8" in str(refused.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("option", ["timeout", "keepalive"])
def test_a_non_finite_number_of_seconds_names_the_option(option: str, value: float) -> None:
    with socket.socket() as sock:  # a broker that is never reached: the check is local
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    environ = {
        "AGENT_SANDBOX_BROKER_URL": f"http://127.0.0.1:{port}",
        "AGENT_SANDBOX_TOKEN": "opaque-token",
        "AGENT_SANDBOX_BROKER_PROTOCOL": "v1",
    }
    with pytest.raises((TypeError, ValueError)) as refused:
        Sandbox.create(environ=environ, allow_insecure_http=True, **{option: value})
    assert f"{option}=" in str(refused.value), str(refused.value)
