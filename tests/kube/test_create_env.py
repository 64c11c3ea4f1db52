"""A create's ``env`` on Kubernetes (issue 26.2, issue 28.2): the environment of the sandbox's
commands, which the broker hands the runtime with each command start; never the pod's.

Upstream's controller puts a claim's ``spec.env`` into the pod (extensions/controllers/
sandboxclaim_controller.go at 2fd412d5: ``createSandbox`` injects it only with the template's
``envVarsInjectionPolicy`` Allowed or Overrides, else ``Ready=False,
EnvVarsInjectionRejected``; with Allowed, a variable the template defines fails as an unwrapped
reconcile error; and ``getOrCreateSandbox`` bypasses the warm pool for any claim with env). In
the pod, the caller's variables would be the runtime's own (``PYTHONPATH``, ``LD_PRELOAD``:
code run by a caller granted only ``files``). So the broker never writes ``spec.env``: the
claim keeps the env in an annotation, a warm sandbox is adopted, and every template policy
works (the stand-in controller plays upstream's, tests/_support/controller.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from k8s_agent_sandbox_awx import Sandbox
from tests._support._api import CLAIM, path
from tests._support.controller import StandInController
from tests._support.kube import KubeAPIServer
from tests._support.kube_broker import SdkReplica

pytestmark = pytest.mark.slow

CALLER = {
    "PYTHONPATH": "/workspace",
    "LD_LIBRARY_PATH": "/workspace",
    "SANDBOX_WORKSPACE_DIR": "/elsewhere",  # the template defines it: an override upstream refuses
    "AWX_CALLER_MARKER": "from the create",
}
SHOW = (
    'echo "$AWX_CALLER_MARKER|$PYTHONPATH|$SANDBOX_WORKSPACE_DIR"; '
    'tr "\\0" "\\n" < /proc/$PPID/environ | grep -c -x -e "AWX_CALLER_MARKER=.*" '
    "-e PYTHONPATH=/workspace -e LD_LIBRARY_PATH=/workspace -e SANDBOX_WORKSPACE_DIR=/elsewhere "
    "|| true"
)
"""What a command sees of the create's env, and how many of the caller's variables its parent,
the runtime, holds in its environment (with the caller's values: the stand-in kubelet gives a
runtime a ``PYTHONPATH`` of its own, tests/_support/_kubelet.py)."""


@pytest.mark.parametrize("policy", [None, "Allowed"])
def test_env_reaches_the_commands_of_a_warm_sandbox_and_never_its_pod(
    kube: KubeAPIServer,
    namespace: str,
    controller: StandInController,
    sdk_replica: SdkReplica,
    policy: str | None,
) -> None:
    """With upstream's default policy (``Disallowed``) and with ``Allowed`` plus a variable the
    template defines: Ready at once from the warm pool, the commands get the variables, the
    runtime's environment holds none of them, the pod's spec neither."""
    pod = {
        "containers": [
            {
                "name": "sandbox",
                "image": "stand-in/python-runtime:local",
                "ports": [{"containerPort": controller.port, "protocol": "TCP"}],
                "env": [{"name": "SANDBOX_WORKSPACE_DIR", "value": "/workspace"}],
            }
        ]
    }
    controller.create_template(namespace, "python", pod_spec=pod, env_policy=policy)
    controller.create_warm_pool(namespace, "python", "python", replicas=1)
    _, environ = sdk_replica("v1")
    with Sandbox.create(environ=environ, env=CALLER, timeout=300) as sandbox:
        claim: dict[str, Any] = kube.get(path(CLAIM, namespace, sandbox.name))
        assert "env" not in claim["spec"], claim["spec"]
        kept = claim["metadata"]["annotations"]["broker.agent-sandbox-awx.io/env"]
        assert json.loads(kept) == CALLER
        adopted = claim["status"]["sandbox"]["name"]
        assert adopted != sandbox.name  # the warm pool's sandbox, not a cold start
        assert all("env" not in c for c in _pod_containers(kube, namespace, adopted)[1:])
        result = sandbox.commands.run(SHOW)
        assert (result.stdout, result.exit_code) == (
            "from the create|/workspace|/elsewhere\n0\n",
            0,
        ), result


def _pod_containers(kube: KubeAPIServer, namespace: str, sandbox: str) -> list[dict[str, Any]]:
    """The containers of the adopted Sandbox's pod template: the template's, nothing added."""
    obj = kube.get(f"/apis/agents.x-k8s.io/v1beta1/namespaces/{namespace}/sandboxes/{sandbox}")
    containers: list[dict[str, Any]] = obj["spec"]["podTemplate"]["spec"]["containers"]
    env = containers[0].get("env") or []
    assert env == [{"name": "SANDBOX_WORKSPACE_DIR", "value": "/workspace"}], env
    return containers
