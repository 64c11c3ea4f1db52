"""docs/broker/deploy.md on a real node: kubelet, containerd and runc, kube-scheduler and
kube-controller-manager on our API server, in a network namespace of the test's own
(``tests/_support/real_node.py``). The guide's kubectl commands run two broker pods from the
broker image (the unmodified deploy/broker), the example warm pools' pods from the runtime
image, and the example client Job, whose log is ``42``; then an SDK caller of the test's own
goes through the broker's Service to a sandbox pod the kubelet runs.

The scenario runs in a child process (``tests/_support/real_node_scenario.py``: the
namespaces are the child's, and everything the node mounts ends with them); it reports what
it saw as JSON, asserted here. Without the node's parts (``.ci/kube-tools``) or the images
(``.ci/images``) the test skips, unless CI requires them (``AGENT_SANDBOX_REQUIRE_KUBE``,
``AGENT_SANDBOX_REQUIRE_IMAGES``): then it fails, naming what is missing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.broker.backends.local._owned_dirs import sweep_dead_owners
from tests._support import _oci
from tests._support.deploy import REPO_ROOT
from tests._support.kube import KubeToolsMissing, build_wait, find_kube_tools, kube_required
from tests._support.real_node import (
    WORKDIR_PREFIX,
    find_node_tools,
    run_in_namespace,
    sweep_leftovers,
)

# the scenario's own bound, plus the wait for a background .ci/kube-tools or .ci/images build
pytestmark = pytest.mark.timeout(900 + build_wait() + _oci.images_wait())


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _parts_or_skip() -> None:
    try:
        find_kube_tools()
        find_node_tools()
    except KubeToolsMissing as exc:
        if kube_required():
            pytest.fail(f"AGENT_SANDBOX_REQUIRE_KUBE is set, and {exc}", pytrace=False)
        pytest.skip(str(exc))
    try:
        _oci.find_image("broker")
        _oci.find_image("runtime")
    except _oci.ImagesMissing as exc:
        if _oci.images_required():
            pytest.fail(f"AGENT_SANDBOX_REQUIRE_IMAGES is set, and {exc}", pytrace=False)
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _parts_or_skip()
    out = tmp_path_factory.mktemp("real-node") / "report.json"
    argv = [sys.executable, "-m", "tests._support.real_node_scenario", str(out)]
    try:
        done = run_in_namespace(argv, cwd=REPO_ROOT, timeout=840)
    except subprocess.TimeoutExpired as exc:  # the scenario was killed: no report, no stop
        swept = sweep_leftovers()
        sweep_dead_owners(WORKDIR_PREFIX)
        pytest.fail(f"the scenario did not end in 840 s (swept {len(swept)} processes it "
                    f"left):\n{_text(exc.stdout)[-3000:]}{_text(exc.stderr)[-6000:]}",
                    pytrace=False)  # fmt: skip
    found: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    swept = sweep_leftovers()  # what a failed scenario left: containerd's shims
    sweep_dead_owners(WORKDIR_PREFIX)  # and its work folder
    if found.get("workdir"):  # the namespaces are gone: only the folders are left
        shutil.rmtree(found["workdir"], ignore_errors=True)
    assert done.returncode != 0 or not swept, f"the scenario left processes running: {swept}"
    if done.returncode != 0 or found.get("error"):
        pytest.fail(
            f"the scenario failed ({done.returncode}):\n{found.get('error', '')}\n"
            f"{found.get('logs', '')[-12000:]}\n--- its output:\n{done.stdout[-3000:]}"
            f"{done.stderr[-6000:]}",
            pytrace=False,
        )
    return found


def test_the_guide_runs_two_broker_pods_from_the_image(report: dict[str, Any]) -> None:
    brokers = [p for p in report["pods"] if p["namespace"] == "agent-sandbox-broker"]
    assert len(brokers) == 2, brokers
    for pod in brokers:
        assert pod["node"] == "node-1" and pod["phase"] == "Running" and pod["ready"], pod
        assert pod["images"] == ["registry.example.com/agent-sandbox-awx/broker:0.0.0"]
        assert pod["ip"].startswith("10.88."), pod  # a pod address on the node's bridge
    assert report["readyz"] == {"status": 200, "body": '{"status": "ready"}'}


def test_the_example_client_job_prints_42(report: dict[str, Any]) -> None:
    assert report["job_log"] == "42\n"
    [job_pod] = [p for p in report["pods"] if p["name"].startswith("sandbox-hello-")]
    assert job_pod["phase"] == "Succeeded"


def test_sandbox_pods_run_the_runtime_image_as_the_template_says(report: dict[str, Any]) -> None:
    runtime = [p for p in report["pods"] if p["name"].startswith("awx-runtime-warmpool-")]
    assert runtime and all(
        p["images"] == ["registry.example.com/agent-sandbox-awx/runtime:0.0.0"] for p in runtime
    )
    sdk = report["sdk"]
    assert sdk["identity"] == ["1000", "1000", "/app", "/home/sandbox"]
    assert "Read-only file system" in sdk["write_outside"] and sdk["write_outside"].endswith("rc=1")
    assert sdk["file"] == "from the real node\n"
    assert report["router_requests"] > 0  # the data plane went through the router


def test_nothing_outlives_its_caller_and_no_token_is_logged(report: dict[str, Any]) -> None:
    assert report["left_claims"] == [] and report["orphan_pods"] == []
    assert report["broker_logs_name_caller"]
    assert report["broker_logs_hold_a_token"] is False
    assert report["controller_errors"] == []
    assert report["proxy_failing"] is None and report["dns_failing"] is None


def test_the_scenario_report_is_complete(report: dict[str, Any]) -> None:
    commands = [entry["command"] for entry in report["kubectl"]]
    assert "kubectl apply --server-side -k deploy/examples" in commands
    assert "kubectl apply --server-side -k deploy/examples/client" in commands
    assert all(entry["rc"] == 0 for entry in report["kubectl"])
    assert Path(report["workdir"]).exists() is False
