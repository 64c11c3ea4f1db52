"""``connection = "kubeconfig"`` with an ``exec`` credential plugin (issue 28, item 8): what the
usual EKS, GKE and AKS kubeconfigs hold. The plugin is the test's own (a small Python script
that prints a ``client.authentication.k8s.io`` ExecCredential, as ``aws eks get-token`` does),
and the tokens it prints are checked by the real API server. client-go's rules
(pkg/client/auth/exec): the token cached until its ``expirationTimestamp``, the plugin run again
on a ``401``, ``KUBERNETES_EXEC_INFO`` (``interactive: false``, the cluster with
``provideClusterInfo``); ours besides: a time limit, its standard error never shown, the token
never in a message or a log record.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx import Sandbox
from k8s_agent_sandbox_awx.broker.backends.kubernetes._api import KubeClient
from k8s_agent_sandbox_awx.broker.backends.kubernetes._api_config import (
    ExecCredential,
    from_kubeconfig,
)
from k8s_agent_sandbox_awx.broker.backends.kubernetes._api_errors import (
    KubeConfigError,
    Unauthorized,
)
from k8s_agent_sandbox_awx.broker.backends.kubernetes._api_types import NAMESPACES
from tests._support.kube import KubeAPIServer
from tests._support.kube_broker import BrokerIdentity, SdkReplica

pytestmark = pytest.mark.slow

V1 = "client.authentication.k8s.io/v1"
V1BETA1 = "client.authentication.k8s.io/v1beta1"
BAD_TOKEN = "refused-token-0123456789abcdef"
PLUGIN = """\
#!{python}
# A kubeconfig exec credential plugin for the tests (tests/kube/test_kubeconfig_exec.py).
import json, os, sys, time
state = os.environ["PLUGIN_STATE"]
plan = json.load(open(os.path.join(state, "plan.json")))
runs = len(os.listdir(os.path.join(state, "runs")))
with open(os.path.join(state, "runs", str(runs)), "w") as seen:
    json.dump({{"info": json.loads(os.environ["KUBERNETES_EXEC_INFO"]),
               "from_kubeconfig": os.environ.get("FROM_KUBECONFIG"),
               "stdin": sys.stdin.read(), "pid": os.getpid()}}, seen)
sys.stderr.write(plan.get("stderr", ""))
time.sleep(plan.get("sleep", 0))
if plan.get("exit"):
    sys.exit(plan["exit"])
tokens = plan["tokens"]
status = {{"token": tokens[min(runs, len(tokens) - 1)]}}
if plan.get("expires_in") is not None:
    moment = time.gmtime(time.time() + plan["expires_in"])
    status["expirationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", moment)
print(json.dumps({{"apiVersion": plan.get("answer_version", os.environ["PLUGIN_VERSION"]),
                  "kind": "ExecCredential", "status": status}}))
"""


class Plugin:
    """The test's plugin in ``folder``: ``plan`` (what the next runs print), ``runs`` (what
    each run saw)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (folder / "runs").mkdir(parents=True)
        self.script = folder / "kube-token-plugin"
        self.script.write_text(PLUGIN.format(python=sys.executable))
        self.script.chmod(self.script.stat().st_mode | stat.S_IXUSR)

    def plan(self, **plan: Any) -> None:
        (self.folder / "plan.json").write_text(json.dumps(plan))

    @property
    def runs(self) -> list[dict[str, Any]]:
        found = sorted((self.folder / "runs").iterdir(), key=lambda p: int(p.name))
        return [json.loads(p.read_text()) for p in found]

    def user(self, version: str = V1, **more: Any) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "apiVersion": version,
            "command": str(self.script),
            "args": ["--region", "test"],
            "env": [
                {"name": "PLUGIN_STATE", "value": str(self.folder)},
                {"name": "PLUGIN_VERSION", "value": version},
                {"name": "FROM_KUBECONFIG", "value": "yes"},
            ],
        }
        if version == V1:
            spec["interactiveMode"] = "Never"
        return {"exec": {**spec, **more}}


@pytest.fixture
def plugin(tmp_path: Path) -> Plugin:
    return Plugin(tmp_path / "plugin")


def kubeconfig(path: Path, kube: KubeAPIServer, user: dict[str, Any], **cluster: Any) -> Path:
    document = {
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "c", "cluster": {"server": kube.url,
                      "certificate-authority": str(kube.ca_file), **cluster}}],
        "users": [{"name": "me", "user": user}],
        "contexts": [{"name": "test", "context": {"cluster": "c", "user": "me"}}],
    }  # fmt: skip
    path.write_text(json.dumps(document))
    return path


@pytest.mark.asyncio
async def test_an_exec_kubeconfig_authenticates_and_caches_its_token(
    kube: KubeAPIServer, namespace: str, plugin: Plugin, tmp_path: Path
) -> None:
    """One run for many requests (no expiry); the plugin gets its env, no standard input,
    ``KUBERNETES_EXEC_INFO`` with ``interactive: false`` and (``provideClusterInfo``) the
    cluster: server, CA, the exec extension."""
    plugin.plan(tokens=[kube.admin_token])
    extension = {"name": "client.authentication.k8s.io/exec", "extension": {"audience": "x"}}
    path = kubeconfig(tmp_path / "config", kube, plugin.user(provideClusterInfo=True),
                      extensions=[extension])  # fmt: skip
    config = from_kubeconfig(path)
    assert isinstance(config.token, ExecCredential)
    assert kube.admin_token not in repr(config)
    async with KubeClient(config) as client:
        for _ in range(3):
            assert (await client.get(NAMESPACES, namespace))["metadata"]["name"] == namespace
    [run] = plugin.runs
    assert run["from_kubeconfig"] == "yes" and run["stdin"] == ""
    info = run["info"]
    assert (info["apiVersion"], info["kind"], info["spec"]["interactive"]) == (
        V1, "ExecCredential", False,
    )  # fmt: skip
    cluster = info["spec"]["cluster"]
    assert cluster["server"] == kube.url and cluster["config"] == {"audience": "x"}
    assert base64.b64decode(cluster["certificate-authority-data"]) == kube.ca_file.read_bytes()


@pytest.mark.asyncio
async def test_v1beta1_without_cluster_info(
    kube: KubeAPIServer, namespace: str, plugin: Plugin, tmp_path: Path
) -> None:
    """``v1beta1`` (what gke-gcloud-auth-plugin kubeconfigs use): ``interactiveMode`` may be
    left out; without ``provideClusterInfo`` the request has no cluster."""
    plugin.plan(tokens=[kube.admin_token])
    config = from_kubeconfig(kubeconfig(tmp_path / "config", kube, plugin.user(V1BETA1)))
    async with KubeClient(config) as client:
        await client.get(NAMESPACES, namespace)
    assert "cluster" not in plugin.runs[0]["info"]["spec"]


@pytest.mark.parametrize(("expires_in", "runs"), [(3600, 1), (-60, 3)])
@pytest.mark.asyncio
async def test_the_token_is_cached_until_its_expiration(
    kube: KubeAPIServer, namespace: str, plugin: Plugin, tmp_path: Path, expires_in: int, runs: int
) -> None:
    plugin.plan(tokens=[kube.admin_token], expires_in=expires_in)
    config = from_kubeconfig(kubeconfig(tmp_path / "config", kube, plugin.user()))
    async with KubeClient(config) as client:
        for _ in range(3):
            await client.get(NAMESPACES, namespace)
    assert len(plugin.runs) == runs


@pytest.mark.asyncio
async def test_a_refused_token_runs_the_plugin_again_once(
    kube: KubeAPIServer,
    namespace: str,
    plugin: Plugin,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A ``401`` to the plugin's token (revoked before its expiry): the plugin runs again and
    the request is sent once more with the new token; refused again, the error names the
    plugin and neither token."""
    caplog.set_level(logging.DEBUG)
    plugin.plan(tokens=[BAD_TOKEN, kube.admin_token], expires_in=3600)
    config = from_kubeconfig(kubeconfig(tmp_path / "config", kube, plugin.user()))
    async with KubeClient(config) as client:
        await client.get(NAMESPACES, namespace)
        assert len(plugin.runs) == 2
        await client.get(NAMESPACES, namespace)
        assert len(plugin.runs) == 2
    plugin.plan(tokens=[BAD_TOKEN])
    again = from_kubeconfig(kubeconfig(tmp_path / "config2", kube, plugin.user()))
    async with KubeClient(again) as client:
        with pytest.raises(Unauthorized) as refused:
            await client.get(NAMESPACES, namespace)
    assert len(plugin.runs) == 4  # two more: the first, and once again after the 401
    text = str(refused.value)
    assert "exec plugin" in text and str(plugin.script) in text
    for secret in (BAD_TOKEN, kube.admin_token):
        assert secret not in text and secret not in caplog.text


@pytest.mark.asyncio
async def test_a_failing_plugin_is_named_and_its_stderr_never_shown(
    kube: KubeAPIServer,
    namespace: str,
    plugin: Plugin,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    plugin.plan(tokens=[kube.admin_token], exit=3, stderr="SECRET-IN-STDERR account 1234")
    config = from_kubeconfig(kubeconfig(tmp_path / "config", kube, plugin.user()))
    async with KubeClient(config) as client:
        with pytest.raises(KubeConfigError) as failed:
            await client.get(NAMESPACES, namespace)
    text = str(failed.value)
    assert f"the exec credential plugin {str(plugin.script)!r} exited with code 3" in text
    assert "users[me].user.exec" in text and "run the command by hand" in text
    assert "SECRET-IN-STDERR" not in text and "SECRET-IN-STDERR" not in caplog.text
    assert "--region" not in text  # its arguments are not named


@pytest.mark.asyncio
async def test_a_plugin_that_hangs_is_stopped_at_its_time_limit(
    kube: KubeAPIServer, namespace: str, plugin: Plugin, tmp_path: Path
) -> None:
    plugin.plan(tokens=[kube.admin_token], sleep=60)
    config = from_kubeconfig(kubeconfig(tmp_path / "config", kube, plugin.user()))
    assert isinstance(config.token, ExecCredential)
    config.token.plugin = dataclasses.replace(config.token.plugin, timeout=1.0)
    async with KubeClient(config) as client:
        with pytest.raises(KubeConfigError, match="did not print a credential within 1 s"):
            await client.get(NAMESPACES, namespace)
    pid = plugin.runs[0]["pid"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # killed, and reaped


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"apiVersion": "client.authentication.k8s.io/v1alpha1"}, "exec.apiVersion must be one"),
        ({"interactiveMode": None}, "exec.interactiveMode must be one of Never, IfAvailable"),
        ({"interactiveMode": "Always"}, "the plugin needs a terminal, and the broker has none"),
        ({"command": ""}, "exec.command must name the plugin's command"),
        ({"args": "--region"}, "exec.args must be a list of strings"),
    ],
)
def test_exec_settings_are_checked_when_the_kubeconfig_is_read(
    kube: KubeAPIServer, plugin: Plugin, tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    user = plugin.user()
    user["exec"].update(change)
    user["exec"] = {k: v for k, v in user["exec"].items() if v is not None}
    with pytest.raises(KubeConfigError, match=message) as refused:
        from_kubeconfig(kubeconfig(tmp_path / "config", kube, user))
    assert "users[me].user.exec" in str(refused.value)


def test_auth_provider_is_refused_naming_its_replacement(
    kube: KubeAPIServer, tmp_path: Path
) -> None:
    user = {"auth-provider": {"name": "gcp", "config": {"access-token": "ya29.SECRET"}}}
    with pytest.raises(KubeConfigError) as refused:
        from_kubeconfig(kubeconfig(tmp_path / "config", kube, user))
    text = str(refused.value)
    assert "users[me].user.auth-provider is not supported" in text
    assert "gke-gcloud-auth-plugin" in text and "kubelogin" in text
    assert "ya29.SECRET" not in text


@pytest.mark.asyncio
async def test_a_missing_plugin_says_its_install_hint_and_a_relative_one_is_found(
    kube: KubeAPIServer, namespace: str, plugin: Plugin, tmp_path: Path
) -> None:
    user = plugin.user(command="no-such-kube-plugin", installHint="install it with brew")
    config = from_kubeconfig(kubeconfig(tmp_path / "config", kube, user))
    async with KubeClient(config) as client:
        with pytest.raises(KubeConfigError, match=r"cannot be started .*install it with brew"):
            await client.get(NAMESPACES, namespace)
    plugin.plan(tokens=[kube.admin_token])
    relative = plugin.user(command="./plugin/kube-token-plugin")  # beside the kubeconfig
    config = from_kubeconfig(kubeconfig(tmp_path / "config", kube, relative))
    async with KubeClient(config) as client:
        await client.get(NAMESPACES, namespace)


def test_the_broker_serves_with_an_exec_kubeconfig(
    identity: BrokerIdentity,
    namespace: str,
    plugin: Plugin,
    python_replica: SdkReplica,
) -> None:
    """``broker serve`` with ``connection = "kubeconfig"`` whose user is an exec plugin that
    prints the broker's ServiceAccount token: it becomes ready and serves a sandbox."""
    token = identity.token_file.read_text().strip()
    plugin.plan(tokens=[token], expires_in=3600)
    document = json.loads(identity.kubeconfig.read_text())
    document["users"][0]["user"] = plugin.user()
    identity.kubeconfig.write_text(json.dumps(document))
    _, environ = python_replica()
    with Sandbox.create(environ=environ, timeout=600) as sandbox:
        assert sandbox.commands.run("echo exec").stdout == "exec\n"
    assert len(plugin.runs) == 1  # cached: concurrent requests wait for the one run
