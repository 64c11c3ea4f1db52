"""The broker's Kubernetes API client (``broker/backends/kubernetes/_api*``) against the real
kube-apiserver 1.20 of the session (tests/_support/kube.py), and against a scripted loopback
HTTPS server for what a real server will not do on demand (5xx, 429, redirects, dropped and
stalled connections).

Facts of 1.20 these tests rely on (see also tests/kube/test_apiserver.py): a watch from a too
old resourceVersion is answered 200 and then ONE ERROR event (code 410, reason Expired); a
failed JSON-patch ``test`` is a 422 with no causes; a stale resourceVersion in a patch or a
wrong uid in a delete precondition is 409 Conflict; the watch cache sends a BOOKMARK only when
its resourceVersion moved past what the watcher has seen (events it filtered out), about 2 s
before the watch's deadline (apiserver/pkg/storage/cacher/cacher.go of 1.20:
``nextBookmarkTime``, ``dispatchEvents``).
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import yaml  # type: ignore[import-untyped]

from k8s_agent_sandbox_awx.broker.backends.kubernetes._api import USER_AGENT, KubeClient, WatchEnd
from k8s_agent_sandbox_awx.broker.backends.kubernetes._api_config import (
    KubeConfig,
    StaticToken,
    TokenFile,
    connection,
    from_kubeconfig,
    in_cluster,
)
from k8s_agent_sandbox_awx.broker.backends.kubernetes._api_errors import (
    AlreadyExists,
    BadRequest,
    Conflict,
    Forbidden,
    Invalid,
    KubeConfigError,
    KubeError,
    KubeUsageError,
    MissingPermissions,
    NotFound,
    PatchTestFailed,
    Unauthorized,
    Unavailable,
    WatchExpired,
)
from k8s_agent_sandbox_awx.broker.backends.kubernetes._api_types import (
    CONFIG_MAPS,
    NAMESPACES,
    SANDBOX_CLAIMS,
    Access,
    Resource,
    Retry,
    Timeouts,
)
from tests._support.kube import KubeAPIServer
from tests._support.scripted_https import Reply, ScriptedHTTPS, Seen, status

pytestmark = pytest.mark.slow  # the session's API server: ~4 s to start

FAST = Retry(attempts=4, backoff=0.01, backoff_max=0.05)


def claim(name: str | None = None, **spec: Any) -> dict[str, Any]:
    meta = {"name": name} if name else {"generateName": "claim-"}
    return {"metadata": meta, "spec": {"warmPoolRef": {"name": "python"}, **spec}}


def admin_config(kube: KubeAPIServer) -> KubeConfig:
    return connection(
        kube.url,
        ca_file=kube.ca_file,
        token=StaticToken(kube.admin_token, source="the test's admin token"),
    )


@pytest_asyncio.fixture
async def admin(kube: KubeAPIServer) -> AsyncIterator[KubeClient]:
    async with KubeClient(admin_config(kube)) as client:
        yield client


def write_kubeconfig(
    path: Path,
    kube: KubeAPIServer,
    user: dict[str, Any],
    *,
    cluster: dict[str, Any] | None = None,
    fmt: str = "yaml",
    namespace: str | None = None,
    current: str | None = "test",
) -> Path:
    """A kubeconfig with one cluster (the test server, its CA by file), one user, one context."""
    context: dict[str, Any] = {"cluster": "kind-test", "user": "me"}
    if namespace:
        context["namespace"] = namespace
    document: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "kind-test",
                "cluster": cluster
                if cluster is not None
                else {"server": kube.url, "certificate-authority": str(kube.ca_file)},
            }
        ],
        "users": [{"name": "me", "user": user}],
        "contexts": [{"name": "test", "context": context}],
    }
    if current is not None:
        document["current-context"] = current
    path.write_text(json.dumps(document) if fmt == "json" else yaml.safe_dump(document))
    return path


async def wait_allowed(client: KubeClient, access: Access, within: float = 15) -> None:
    """RBAC reaches the authorizer through an informer: wait until ``access`` is allowed."""
    deadline = time.monotonic() + within
    while not (await client.access_review(access)).allowed:
        assert time.monotonic() < deadline, f"RBAC not applied: {access}"
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------------------ operations


@pytest.mark.asyncio
async def test_create_get_list_with_selectors_and_field_manager(
    admin: KubeClient, namespace: str
) -> None:
    named = await admin.create(SANDBOX_CLAIMS, claim("one"), namespace=namespace)
    assert named["kind"] == "SandboxClaim" and named["metadata"]["name"] == "one"
    assert [m["manager"] for m in named["metadata"]["managedFields"]] == ["agent-sandbox-awx"]
    labelled = claim()
    labelled["metadata"]["labels"] = {"owner": "abc"}
    generated = await admin.create(
        SANDBOX_CLAIMS, labelled, namespace=namespace, field_manager="someone-else"
    )
    name = generated["metadata"]["name"]
    assert name.startswith("claim-")
    assert generated["metadata"]["managedFields"][0]["manager"] == "someone-else"
    got = await admin.get(SANDBOX_CLAIMS, name, namespace=namespace)
    assert got["metadata"]["uid"] == generated["metadata"]["uid"]
    everything = await admin.list(SANDBOX_CLAIMS, namespace=namespace)
    assert sorted(i["metadata"]["name"] for i in everything.items) == sorted(["one", name])
    assert int(everything.resource_version) >= int(generated["metadata"]["resourceVersion"])
    assert everything.continue_token is None
    by_label = await admin.list(SANDBOX_CLAIMS, namespace=namespace, label_selector="owner=abc")
    assert [i["metadata"]["name"] for i in by_label.items] == [name]
    by_field = await admin.list(
        SANDBOX_CLAIMS, namespace=namespace, field_selector="metadata.name=one"
    )
    assert [i["metadata"]["name"] for i in by_field.items] == ["one"]
    across = await admin.list(SANDBOX_CLAIMS, label_selector="owner=abc")  # every namespace
    assert [i["metadata"]["namespace"] for i in across.items] == [namespace]


@pytest.mark.asyncio
async def test_list_pages_with_limit_and_continue(admin: KubeClient, namespace: str) -> None:
    for i in range(5):
        await admin.create(SANDBOX_CLAIMS, claim(f"c{i}"), namespace=namespace)
    first = await admin.list(SANDBOX_CLAIMS, namespace=namespace, limit=2)
    assert [i["metadata"]["name"] for i in first.items] == ["c0", "c1"]
    assert first.continue_token and first.remaining_item_count == 3
    await admin.create(SANDBOX_CLAIMS, claim("c5"), namespace=namespace)  # after the snapshot
    second = await admin.list(
        SANDBOX_CLAIMS, namespace=namespace, limit=2, continue_token=first.continue_token
    )
    assert [i["metadata"]["name"] for i in second.items] == ["c2", "c3"]
    assert second.resource_version == first.resource_version  # one snapshot
    every = await admin.list_all(SANDBOX_CLAIMS, namespace=namespace, page_size=2)
    assert [i["metadata"]["name"] for i in every.items] == [f"c{i}" for i in range(6)]
    assert every.continue_token is None
    with pytest.raises(BadRequest, match="invalid continue token") as bad:
        await admin.list(SANDBOX_CLAIMS, namespace=namespace, continue_token="garbage")
    assert bad.value.status == 400 and bad.value.verb == "list"
    with pytest.raises(KubeUsageError, match="limit=0"):
        await admin.list(SANDBOX_CLAIMS, namespace=namespace, limit=0)


@pytest.mark.asyncio
async def test_typed_errors_name_the_request(admin: KubeClient, namespace: str) -> None:
    await admin.create(SANDBOX_CLAIMS, claim("taken"), namespace=namespace)
    with pytest.raises(AlreadyExists) as taken:
        await admin.create(SANDBOX_CLAIMS, claim("taken"), namespace=namespace)
    error = taken.value
    assert (error.status, error.reason, error.verb) == (409, "AlreadyExists", "create")
    assert error.resource == "sandboxclaims.extensions.agents.x-k8s.io"
    assert error.namespace == namespace and error.name is None
    assert str(error).startswith(
        f"create sandboxclaims.extensions.agents.x-k8s.io {namespace}: 409 AlreadyExists: "
    )
    with pytest.raises(NotFound) as missing:
        await admin.get(SANDBOX_CLAIMS, "nobody", namespace=namespace)
    assert missing.value.name == "nobody" and missing.value.status == 404
    unknown = Resource("example.invalid", "v1", "widgets")
    with pytest.raises(NotFound, match=r"does not serve widgets\.example\.invalid; is its CRD"):
        await admin.list(unknown, namespace=namespace)
    with pytest.raises(Invalid) as invalid:
        await admin.create(
            SANDBOX_CLAIMS, claim(lifecycle={"shutdownPolicy": "Forever"}), namespace=namespace
        )
    assert invalid.value.fields == ("spec.lifecycle.shutdownPolicy",)
    assert invalid.value.causes[0].reason == "FieldValueNotSupported"
    with pytest.raises(KubeUsageError, match=r"neither metadata\.name nor metadata\.generateName"):
        await admin.create(SANDBOX_CLAIMS, {"spec": {}}, namespace=namespace)
    with pytest.raises(KubeUsageError, match="namespaced: give namespace="):
        await admin.get(SANDBOX_CLAIMS, "x")
    for bad in ("a/b", "..", "", "a b", "%2e"):
        with pytest.raises(KubeUsageError, match="cannot be part of a Kubernetes API path"):
            await admin.get(SANDBOX_CLAIMS, bad, namespace=namespace)
    assert (await admin.get(NAMESPACES, namespace))["status"]["phase"] == "Active"


@pytest.mark.asyncio
async def test_merge_patch_with_a_resource_version_precondition_and_the_status_subresource(
    admin: KubeClient, namespace: str
) -> None:
    created = await admin.create(SANDBOX_CLAIMS, claim("p"), namespace=namespace)
    stale = created["metadata"]["resourceVersion"]
    lifecycle = {"spec": {"lifecycle": {"shutdownTime": "2030-01-01T00:00:00Z"}}}
    patched = await admin.merge_patch(
        SANDBOX_CLAIMS, "p", lifecycle, namespace=namespace, resource_version=stale
    )
    assert patched["spec"]["lifecycle"]["shutdownTime"] == "2030-01-01T00:00:00Z"
    later = {"spec": {"lifecycle": {"shutdownTime": "2031-01-01T00:00:00Z"}}}
    with pytest.raises(Conflict, match="the object has been modified") as conflict:
        await admin.merge_patch(
            SANDBOX_CLAIMS, "p", later, namespace=namespace, resource_version=stale
        )
    assert conflict.value.verb == "patch" and conflict.value.name == "p"
    assert not isinstance(conflict.value, PatchTestFailed)
    unchanged = await admin.get(SANDBOX_CLAIMS, "p", namespace=namespace)
    assert unchanged["spec"]["lifecycle"]["shutdownTime"] == "2030-01-01T00:00:00Z"
    status = {"status": {"sandbox": {"name": "python-abcde", "podIPs": ["127.0.0.5"]}}}
    written = await admin.merge_patch(
        SANDBOX_CLAIMS, "p", status, namespace=namespace, subresource="status"
    )
    assert written["status"] == status["status"]


@pytest.mark.asyncio
async def test_json_patch_with_a_test_precondition(admin: KubeClient, namespace: str) -> None:
    created = await admin.create(
        SANDBOX_CLAIMS,
        claim("j", lifecycle={"shutdownTime": "2030-01-01T00:00:00Z"}),
        namespace=namespace,
    )
    path = "/spec/lifecycle/shutdownTime"

    def extend(expected: str, to: str) -> list[dict[str, Any]]:
        return [
            {"op": "test", "path": path, "value": expected},
            {"op": "replace", "path": path, "value": to},
        ]

    done = await admin.json_patch(
        SANDBOX_CLAIMS,
        "j",
        extend("2030-01-01T00:00:00Z", "2030-06-01T00:00:00Z"),
        namespace=namespace,
    )
    assert done["spec"]["lifecycle"]["shutdownTime"] == "2030-06-01T00:00:00Z"
    with pytest.raises(PatchTestFailed) as failed:  # someone else extended it meanwhile
        await admin.json_patch(
            SANDBOX_CLAIMS,
            "j",
            extend("2030-01-01T00:00:00Z", "2031-01-01T00:00:00Z"),
            namespace=namespace,
        )
    assert isinstance(failed.value, Conflict) and failed.value.status == 422
    replace = [{"op": "replace", "path": path, "value": "2032-01-01T00:00:00Z"}]
    with pytest.raises(Conflict) as stale:
        await admin.json_patch(
            SANDBOX_CLAIMS,
            "j",
            replace,
            namespace=namespace,
            resource_version=created["metadata"]["resourceVersion"],
        )
    assert stale.value.status == 409
    now = await admin.get(SANDBOX_CLAIMS, "j", namespace=namespace)
    assert now["spec"]["lifecycle"]["shutdownTime"] == "2030-06-01T00:00:00Z"
    fresh = await admin.json_patch(
        SANDBOX_CLAIMS,
        "j",
        replace,
        namespace=namespace,
        resource_version=now["metadata"]["resourceVersion"],
    )
    assert fresh["spec"]["lifecycle"]["shutdownTime"] == "2032-01-01T00:00:00Z"
    with pytest.raises(KubeUsageError, match="at least one operation"):
        await admin.json_patch(SANDBOX_CLAIMS, "j", [], namespace=namespace)


@pytest.mark.asyncio
async def test_delete_with_preconditions_and_already_gone(
    admin: KubeClient, namespace: str
) -> None:
    created = await admin.create(SANDBOX_CLAIMS, claim("d"), namespace=namespace)
    with pytest.raises(Conflict, match="the UID in the precondition"):
        await admin.delete(SANDBOX_CLAIMS, "d", namespace=namespace, uid="not-its-uid")
    with pytest.raises(Conflict):
        await admin.delete(SANDBOX_CLAIMS, "d", namespace=namespace, resource_version="1")
    answer = await admin.delete(
        SANDBOX_CLAIMS,
        "d",
        namespace=namespace,
        propagation_policy="Background",
        uid=created["metadata"]["uid"],
        resource_version=created["metadata"]["resourceVersion"],
    )
    assert answer["status"] == "Success" and answer["details"]["uid"] == created["metadata"]["uid"]
    with pytest.raises(NotFound) as gone:  # already gone
        await admin.delete(SANDBOX_CLAIMS, "d", namespace=namespace)
    assert gone.value.verb == "delete" and gone.value.name == "d"
    with pytest.raises(KubeUsageError, match="propagation_policy='Later'"):
        await admin.delete(SANDBOX_CLAIMS, "d", namespace=namespace, propagation_policy="Later")


# ------------------------------------------------------------------------------ watches


@pytest.mark.asyncio
async def test_a_watch_resumed_from_its_resource_version_loses_no_event(
    admin: KubeClient, namespace: str
) -> None:
    since = (await admin.list(SANDBOX_CLAIMS, namespace=namespace)).resource_version
    for i in range(3):
        await admin.create(SANDBOX_CLAIMS, claim(f"w{i}"), namespace=namespace)
    seen: list[tuple[str, str]] = []
    async with admin.watch(
        SANDBOX_CLAIMS, namespace=namespace, resource_version=since, timeout_seconds=30
    ) as events:
        async for kind, obj in events:
            seen.append((kind, obj["metadata"]["name"]))
            if len(seen) == 2:
                break  # the caller stops half-way
    assert events.end is WatchEnd.CLOSED and events.events == 2
    resume_from = events.resource_version
    assert resume_from is not None and int(resume_from) > int(since)
    await admin.merge_patch(
        SANDBOX_CLAIMS, "w0", {"metadata": {"labels": {"a": "b"}}}, namespace=namespace
    )
    await admin.delete(SANDBOX_CLAIMS, "w1", namespace=namespace)
    async with admin.watch(
        SANDBOX_CLAIMS, namespace=namespace, resource_version=resume_from, timeout_seconds=30
    ) as events:
        async for kind, obj in events:
            seen.append((kind, obj["metadata"]["name"]))
            if kind == "DELETED":
                break
    assert seen == [
        ("ADDED", "w0"),
        ("ADDED", "w1"),
        ("ADDED", "w2"),
        ("MODIFIED", "w0"),
        ("DELETED", "w1"),
    ]


@pytest.mark.asyncio
async def test_a_bookmark_moves_past_filtered_events_and_the_timeout_ends_cleanly(
    admin: KubeClient, namespace: str, kube: KubeAPIServer
) -> None:
    """1.20 sends a BOOKMARK ~2 s before the deadline, when the cache moved on (here: events
    in another namespace, filtered out of this watch); resuming from it misses nothing."""
    other = kube.create_namespace()
    since = (await admin.list(SANDBOX_CLAIMS, namespace=namespace)).resource_version
    kinds: list[str] = []
    started = time.monotonic()
    async with admin.watch(
        SANDBOX_CLAIMS, namespace=namespace, resource_version=since, timeout_seconds=4
    ) as events:
        for i in range(3):
            await admin.create(SANDBOX_CLAIMS, claim(f"elsewhere-{i}"), namespace=other)
        async for kind, obj in events:
            kinds.append(kind)
            assert set(obj) <= {"kind", "apiVersion", "metadata"}
    assert 3.5 < time.monotonic() - started < 10
    assert kinds and set(kinds) == {"BOOKMARK"}
    assert events.end is WatchEnd.TIMEOUT  # not DROPPED: the server ended it
    bookmark = events.resource_version
    assert bookmark is not None and int(bookmark) > int(since)
    await admin.create(SANDBOX_CLAIMS, claim("here"), namespace=namespace)
    async with admin.watch(
        SANDBOX_CLAIMS, namespace=namespace, resource_version=bookmark, timeout_seconds=10
    ) as events:
        async for kind, obj in events:
            assert (kind, obj["metadata"]["name"]) == ("ADDED", "here")
            break


@pytest.mark.asyncio
async def test_a_too_old_resource_version_raises_watch_expired(
    admin: KubeClient, namespace: str
) -> None:
    """1.20 answers 200, then one ERROR event with code 410 Expired (test_apiserver.py)."""
    await admin.create(SANDBOX_CLAIMS, claim("x"), namespace=namespace)
    with pytest.raises(WatchExpired, match="too old resource version: 1") as expired:
        async with admin.watch(
            SANDBOX_CLAIMS, namespace=namespace, resource_version="1", timeout_seconds=5
        ) as events:
            async for _ in events:
                pytest.fail("no event before the ERROR")
    assert (expired.value.status, expired.value.reason) == (410, "Expired")
    assert "list again" in str(expired.value)
    assert events.end is WatchEnd.ERROR
    # a fresh list gives a resourceVersion to watch from
    current = await admin.list(SANDBOX_CLAIMS, namespace=namespace)
    async with admin.watch(
        SANDBOX_CLAIMS,
        namespace=namespace,
        resource_version=current.resource_version,
        timeout_seconds=1,
    ) as again:
        assert [kind async for kind, _ in again] == []
    assert again.end is WatchEnd.TIMEOUT


@pytest.mark.asyncio
async def test_a_watch_without_a_resource_version_starts_with_the_current_objects(
    admin: KubeClient, namespace: str
) -> None:
    await admin.create(SANDBOX_CLAIMS, claim("now"), namespace=namespace)
    async with admin.watch(
        SANDBOX_CLAIMS, namespace=namespace, timeout_seconds=5, field_selector="metadata.name=now"
    ) as events:
        async for kind, obj in events:
            assert (kind, obj["metadata"]["name"]) == ("ADDED", "now")
            break


@pytest.mark.asyncio
async def test_an_api_server_restart_during_a_watch_and_a_list(
    kube: KubeAPIServer, namespace: str
) -> None:
    """The watch ends DROPPED (not TIMEOUT) at once, with the last resourceVersion; a list
    with too few retries fails typed (``Unavailable``), one with enough rides the restart
    out; the resumed watch either continues or says ``WatchExpired`` (then: list again).
    Never a hang."""
    # a starting 1.20 answers 503 "server is starting" with Retry-After: 10; cap it at 1 s
    patient = Retry(attempts=60, backoff=0.1, backoff_max=0.5, retry_after_max=1.0)
    client = KubeClient(admin_config(kube), retry=patient)
    impatient = KubeClient(admin_config(kube), retry=Retry(attempts=1))
    async with client, impatient:
        await client.create(SANDBOX_CLAIMS, claim("before"), namespace=namespace)
        since = (await client.list(SANDBOX_CLAIMS, namespace=namespace)).resource_version
        async with client.watch(
            SANDBOX_CLAIMS, namespace=namespace, resource_version=since, timeout_seconds=120
        ) as events:
            restarting = asyncio.ensure_future(asyncio.to_thread(kube.restart, crash=True))
            started = time.monotonic()
            assert [kind async for kind, _ in events] == []
        assert events.end is WatchEnd.DROPPED, events.detail
        assert time.monotonic() - started < 5
        assert events.resource_version == since
        with pytest.raises(Unavailable) as down:
            await impatient.list(SANDBOX_CLAIMS, namespace=namespace)
        # down (no answer) or, when the restart was quicker than this list on a loaded
        # machine, up again but still starting (503 "server is starting"): typed either way
        assert down.value.verb == "list"
        assert down.value.status in (0, 503), down.value
        if down.value.status == 0:
            assert "did not answer" in str(down.value)
        else:
            assert "server is starting" in str(down.value)
        listed = await client.list(SANDBOX_CLAIMS, namespace=namespace)  # rides it out
        assert [i["metadata"]["name"] for i in listed.items] == ["before"]
        assert await restarting < 60
        await client.create(SANDBOX_CLAIMS, claim("after"), namespace=namespace)
        names = await _follow(client, namespace, events.resource_version)
        assert names == ["after"]


async def _follow(client: KubeClient, namespace: str, since: str | None) -> list[str]:
    """What a caller does: resume from ``since``; on WatchExpired list again and watch from
    the list. The names ADDED after ``since`` (from the list: those not in ``known``)."""
    known = {"before"}
    try:
        async with client.watch(
            SANDBOX_CLAIMS, namespace=namespace, resource_version=since, timeout_seconds=10
        ) as events:
            async for kind, obj in events:
                return [obj["metadata"]["name"]] if kind == "ADDED" else []
    except WatchExpired:
        listed = await client.list(SANDBOX_CLAIMS, namespace=namespace)
        return [i["metadata"]["name"] for i in listed.items if i["metadata"]["name"] not in known]
    return []


# ------------------------------------------------------------------------------ identity


@pytest.mark.asyncio
async def test_a_service_account_can_do_exactly_what_its_role_allows(
    kube: KubeAPIServer, namespace: str
) -> None:
    kube.create_service_account(namespace, "broker")
    kube.bind_role(
        (namespace, "broker"),
        "claims-reader",
        namespace=namespace,
        rules=[
            {
                "apiGroups": ["extensions.agents.x-k8s.io"],
                "resources": ["sandboxclaims"],
                "verbs": ["get", "list"],
            },
        ],
    )
    kube.create(
        {
            "apiVersion": "extensions.agents.x-k8s.io/v1beta1",
            "kind": "SandboxClaim",
            **claim("seen"),
        },
        namespace,
    )
    token = kube.token_request(namespace, "broker")
    config = connection(kube.url, ca_file=kube.ca_file, token=StaticToken(token, source="t"))
    async with KubeClient(config) as broker:
        await wait_allowed(broker, Access("list", SANDBOX_CLAIMS, namespace))
        assert (await broker.get(SANDBOX_CLAIMS, "seen", namespace=namespace))["metadata"]
        assert len((await broker.list(SANDBOX_CLAIMS, namespace=namespace)).items) == 1
        with pytest.raises(Forbidden) as refused:
            await broker.create(SANDBOX_CLAIMS, claim(), namespace=namespace)
        error = refused.value
        assert (error.verb, error.resource, error.namespace) == (
            "create",
            "sandboxclaims.extensions.agents.x-k8s.io",
            namespace,
        )
        assert f"system:serviceaccount:{namespace}:broker" in error.message
        assert (
            f"grant `create` on `sandboxclaims.extensions.agents.x-k8s.io` in namespace "
            f"{namespace}" in str(error)
        )
        with pytest.raises(Forbidden, match="cannot watch"):
            async with broker.watch(SANDBOX_CLAIMS, namespace=namespace, timeout_seconds=5):
                pass
        with pytest.raises(Forbidden):
            await broker.list(SANDBOX_CLAIMS, namespace=kube.create_namespace())
        needed = [
            Access(verb, SANDBOX_CLAIMS, namespace)
            for verb in ("get", "list", "watch", "create", "patch", "delete")
        ]
        needed.append(Access("get", path="/openid/v1/jwks"))  # every SA may, in 1.20
        with pytest.raises(MissingPermissions) as missing:
            await broker.require_access(
                needed,
                who="the broker's ServiceAccount",
                fix="add the verbs to its Role (deploy/broker/rbac.yaml)",
            )
        assert [verb for verb, _, _ in missing.value.missing] == [
            "watch",
            "create",
            "patch",
            "delete",
        ]
        assert str(missing.value) == (
            f"the broker's ServiceAccount may not `watch` `sandboxclaims` "
            f"(extensions.agents.x-k8s.io) in namespace {namespace}; may not `create` "
            f"`sandboxclaims` (extensions.agents.x-k8s.io) in namespace {namespace}; may not "
            f"`patch` `sandboxclaims` (extensions.agents.x-k8s.io) in namespace {namespace}; "
            f"may not `delete` `sandboxclaims` (extensions.agents.x-k8s.io) in namespace "
            f"{namespace}: add the verbs to its Role (deploy/broker/rbac.yaml)"
        )
        assert isinstance(missing.value, Forbidden) and missing.value.verb == "watch"
        reviews = await broker.require_access(needed[:2] + needed[-1:])
        assert all(r.allowed for r in reviews)


@pytest.mark.asyncio
async def test_token_review_with_audiences_and_no_token_in_what_fails(
    admin: KubeClient, kube: KubeAPIServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    kube.create_service_account(namespace, "agent")
    token = kube.token_request(namespace, "agent", "https://broker.test")
    caplog.set_level(logging.DEBUG)
    review = await admin.token_review(token, ["https://other.test", "https://broker.test"])
    assert review["authenticated"] is True and review["audiences"] == ["https://broker.test"]
    assert review["user"]["username"] == f"system:serviceaccount:{namespace}:agent"
    own = await admin.token_review(token)  # the API server's own audience: not this one
    assert own.get("authenticated") is not True and "error" in own
    forged = await admin.token_review(token[:-6] + "AAAAAA", ["https://broker.test"])
    assert forged.get("authenticated") is not True
    assert token not in caplog.text and token[:-6] not in json.dumps(forged)


# ------------------------------------------------------------------------------ in-cluster


def _kubelet_volume(folder: Path, files: dict[str, str], generation: int) -> None:
    """Write ``files`` the way the kubelet updates a projected volume: a new timestamped
    folder, then ``..data`` swapped to it atomically (the visible names are symlinks)."""
    data = folder / f"..2026_12_01_00_00_0{generation}"
    data.mkdir()
    for name, text in files.items():
        (data / name).write_text(text)
    (folder / "..data_tmp").symlink_to(data.name)
    os.replace(folder / "..data_tmp", folder / "..data")
    for name in files:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")


@pytest.mark.asyncio
async def test_in_cluster_configuration_reads_the_rotated_token(
    kube: KubeAPIServer, namespace: str, tmp_path: Path
) -> None:
    for account in ("old", "new"):
        kube.create_service_account(namespace, account)
    kube.bind_role(
        (namespace, "new"),
        "configmap-reader",
        namespace=namespace,
        rules=[{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
    )
    ca = kube.ca_file.read_text()
    folder = tmp_path / "serviceaccount"
    folder.mkdir()
    old = kube.token_request(namespace, "old")
    _kubelet_volume(folder, {"token": old, "ca.crt": ca, "namespace": namespace}, 1)
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(kube.port)}
    config = in_cluster(folder, environ=env)
    assert config.server == kube.url and config.namespace == namespace
    assert old not in repr(config)
    async with KubeClient(config) as pod:
        assert pod.namespace == namespace
        with pytest.raises(Forbidden, match=f"system:serviceaccount:{namespace}:old"):
            await pod.list(CONFIG_MAPS, namespace=namespace)
        new = kube.token_request(namespace, "new")
        _kubelet_volume(folder, {"token": new, "ca.crt": ca, "namespace": namespace}, 2)
        await wait_allowed(pod, Access("list", CONFIG_MAPS, namespace))
        assert (await pod.list(CONFIG_MAPS, namespace=namespace)).items == []
        _kubelet_volume(
            folder, {"token": "revoked-" + new[8:], "ca.crt": ca, "namespace": namespace}, 3
        )
        with pytest.raises(Unauthorized, match="read again for every request") as refused:
            await pod.list(CONFIG_MAPS, namespace=namespace)
        assert new[8:] not in str(refused.value) and new[8:] not in repr(refused.value)
        (folder / "..data").unlink()
        with pytest.raises(KubeConfigError, match="cannot be read") as unreadable:
            await pod.list(CONFIG_MAPS, namespace=namespace)
        assert unreadable.value.source == str(folder / "token")


def test_in_cluster_refusals(tmp_path: Path, kube: KubeAPIServer) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_HOST is not set: this is not"):
        in_cluster(tmp_path, environ={})
    with pytest.raises(KubeConfigError, match="KUBERNETES_SERVICE_PORT is 'https'"):
        in_cluster(tmp_path, environ={**env, "KUBERNETES_SERVICE_PORT": "https"})
    with pytest.raises(KubeConfigError, match=r"token file .*token .* cannot be read") as no_token:
        in_cluster(tmp_path, environ=env)
    assert no_token.value.source == str(tmp_path / "token")
    (tmp_path / "token").write_text("\n")
    with pytest.raises(KubeConfigError, match="is empty: write a token into it"):
        in_cluster(tmp_path, environ=env)
    (tmp_path / "token").write_text("a-token-value\n")
    with pytest.raises(KubeConfigError, match=r"ca\.crt is missing"):
        in_cluster(tmp_path, environ=env)
    shutil.copy(kube.ca_file, tmp_path / "ca.crt")
    config = in_cluster(tmp_path, environ={**env, "KUBERNETES_SERVICE_HOST": "fd00::1"})
    assert config.server == "https://[fd00::1]:6443" and config.namespace is None
    (tmp_path / "token").write_text("two words\n")
    with pytest.raises(KubeConfigError, match="characters a token cannot have") as spaced:
        TokenFile(tmp_path / "token", source="t").read()
    assert "two" not in str(spaced.value)


# ------------------------------------------------------------------------------ kubeconfig


@pytest.mark.asyncio
async def test_kubeconfig_with_a_token_and_a_namespace(
    kube: KubeAPIServer, namespace: str, tmp_path: Path
) -> None:
    path = write_kubeconfig(
        tmp_path / "config", kube, {"token": kube.admin_token}, namespace=namespace
    )
    config = from_kubeconfig(path)
    assert config.namespace == namespace and config.source == f"kubeconfig {path} (context 'test')"
    assert kube.admin_token not in repr(config)
    async with KubeClient(config) as client:
        assert (await client.get(NAMESPACES, namespace))["metadata"]["name"] == namespace
    as_json = write_kubeconfig(
        tmp_path / "config.json", kube, {"token": kube.admin_token}, fmt="json"
    )
    assert from_kubeconfig(as_json).namespace == "default"


@pytest.mark.asyncio
async def test_kubeconfig_token_file_is_read_again_and_wins_over_token(
    kube: KubeAPIServer, namespace: str, tmp_path: Path
) -> None:
    kube.create_service_account(namespace, "reader")
    kube.bind_role(
        (namespace, "reader"),
        "ns-reader",
        rules=[{"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get"]}],
    )
    token_file = tmp_path / "token"
    token_file.write_text("not-a-valid-token-at-all")
    path = write_kubeconfig(
        tmp_path / "config", kube, {"tokenFile": "token", "token": kube.admin_token}
    )
    async with KubeClient(from_kubeconfig(path)) as client:
        with pytest.raises(Unauthorized):
            await client.get(NAMESPACES, namespace)
        token_file.write_text(kube.token_request(namespace, "reader") + "\n")
        deadline = time.monotonic() + 15
        while True:  # the ClusterRoleBinding reaches the authorizer through an informer
            try:
                assert (await client.get(NAMESPACES, namespace))["metadata"]["name"] == namespace
                break
            except Forbidden:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_kubeconfig_client_certificates_as_files_and_as_data(
    kube: KubeAPIServer, namespace: str, tmp_path: Path
) -> None:
    import base64

    cert, key = kube.client_certificate("cert-admin", "system:masters")
    files = write_kubeconfig(
        tmp_path / "files", kube, {"client-certificate": str(cert), "client-key": str(key)}
    )
    async with KubeClient(from_kubeconfig(files)) as client:
        assert (await client.get(NAMESPACES, namespace))["metadata"]["name"] == namespace
    plain_cert, plain_key = kube.client_certificate("cert-nobody")
    data = write_kubeconfig(
        tmp_path / "data",
        kube,
        {
            "client-certificate-data": base64.b64encode(plain_cert.read_bytes()).decode(),
            "client-key-data": base64.b64encode(plain_key.read_bytes()).decode(),
        },
        cluster={
            "server": kube.url,
            "certificate-authority-data": base64.b64encode(kube.ca_file.read_bytes()).decode(),
        },
    )
    config = from_kubeconfig(data)
    assert "client certificate" in repr(config) and "BEGIN" not in repr(config)
    async with KubeClient(config) as client:
        with pytest.raises(Forbidden, match='User "cert-nobody" cannot get resource "namespaces"'):
            await client.get(NAMESPACES, namespace)
    assert not glob.glob(os.path.join(tempfile.gettempdir(), "kube-client-cert-*"))
    no_key = write_kubeconfig(tmp_path / "nokey", kube, {"client-certificate": str(cert)})
    with pytest.raises(KubeConfigError, match=r"users\[me\].user.client-key\[-data\] is missing"):
        from_kubeconfig(no_key)


@pytest.mark.parametrize(
    ("user", "refused"),
    [
        ({"username": "u", "password": "p"}, "basic authentication"),
        ({"token": "t0ken-value-123", "as": "someone"}, "impersonation (`as`)"),
    ],
)
def test_kubeconfig_refuses_plugins_and_says_what_to_do(
    user: dict[str, Any], refused: str, kube: KubeAPIServer, tmp_path: Path
) -> None:
    path = write_kubeconfig(tmp_path / "config", kube, user)
    with pytest.raises(KubeConfigError) as error:
        from_kubeconfig(path)
    text = str(error.value)
    assert text.startswith(f"kubeconfig {path}: ") and refused in text
    assert "give user 'me' a token file instead (tokenFile:" in text
    assert error.value.source == str(path) and error.value.key.startswith("users[me].user.")
    assert "t0ken-value-123" not in text and "'p'" not in text


def test_kubeconfig_refusals_name_the_file_the_key_and_the_fix(
    kube: KubeAPIServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(path: Path, pattern: str, **kwargs: Any) -> KubeConfigError:
        with pytest.raises(KubeConfigError, match=pattern) as error:
            from_kubeconfig(path, **kwargs)
        assert str(path) in str(error.value)
        return error.value

    missing = refused(tmp_path / "nowhere", r"cannot be read \(FileNotFoundError")
    assert missing.source == str(tmp_path / "nowhere")
    token = "sekrit-token-0123456789"
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"users:\n- name: me\n  user:\n    token: {token}\n   oops: [\n")
    error = refused(bad, r"is not valid YAML \(line \d+, column \d+: ")
    assert token not in str(error)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"clusters": [}')
    refused(bad_json, r"is not valid JSON \(line 1, column 15")
    ok = write_kubeconfig(tmp_path / "ok", kube, {"token": token})
    err = refused(
        ok, r"contexts\[prod\] does not exist: name one of its contexts: test", context="prod"
    )
    assert err.key == "contexts[prod]"
    no_current = write_kubeconfig(tmp_path / "nocurrent", kube, {"token": token}, current=None)
    refused(no_current, r"current-context is not set: name the context to use \(its contexts: test")
    assert from_kubeconfig(no_current, context="test").server == kube.url
    ca_gone = write_kubeconfig(
        tmp_path / "cagone",
        kube,
        {"token": token},
        cluster={"server": kube.url, "certificate-authority": "nope.pem"},
    )
    refused(ca_gone, r"certificate-authority names .*nope.pem, which is not a file")
    insecure = write_kubeconfig(
        tmp_path / "insecure",
        kube,
        {"token": token},
        cluster={"server": kube.url, "insecure-skip-tls-verify": True},
    )
    refused(insecure, r"insecure-skip-tls-verify\): a bearer token sent that way can be stolen")
    assert from_kubeconfig(insecure, allow_insecure=True).insecure
    plain = write_kubeconfig(
        tmp_path / "plain", kube, {"token": token}, cluster={"server": "http://127.0.0.1:8080"}
    )
    refused(plain, "is plain http: tokens would cross the network in the clear")
    proxy = write_kubeconfig(
        tmp_path / "proxy",
        kube,
        {"token": token},
        cluster={"server": kube.url, "proxy-url": "http://proxy:3128"},
    )
    refused(proxy, r"clusters\[kind-test\].cluster.proxy-url configures a proxy")
    no_server = write_kubeconfig(tmp_path / "noserver", kube, {"token": token}, cluster={})
    refused(no_server, r"clusters\[kind-test\].cluster.server must be a non-empty string")
    monkeypatch.setitem(sys.modules, "yaml", None)  # PyYAML not installed
    refused(
        ok,
        r"is YAML, and reading YAML needs PyYAML: the \[broker\] extra installs it: "
        r"python3 -m pip install -e \"\.\[broker\]\" in a clone",
    )
    as_json = write_kubeconfig(tmp_path / "ok.json", kube, {"token": token}, fmt="json")
    assert from_kubeconfig(as_json).server == kube.url  # JSON needs no PyYAML


@pytest.mark.asyncio
async def test_insecure_when_allowed_skips_the_certificate_check(
    kube: KubeAPIServer, namespace: str, tmp_path: Path
) -> None:
    path = write_kubeconfig(
        tmp_path / "insecure",
        kube,
        {"token": kube.admin_token},
        cluster={"server": kube.url, "insecure-skip-tls-verify": True},
    )
    config = from_kubeconfig(path, allow_insecure=True)
    assert "INSECURE" in repr(config)
    async with KubeClient(config) as client:
        assert (await client.get(NAMESPACES, namespace))["metadata"]["name"] == namespace


@pytest.mark.asyncio
async def test_a_certificate_that_does_not_verify_fails_at_once_naming_the_ca(
    kube: KubeAPIServer, namespace: str
) -> None:
    wrong_ca = connection(kube.url, token=StaticToken(kube.admin_token, source="t"))  # system CAs
    pauses: list[float] = []  # a retry's pause is drawn from rand: none drawn, none retried

    def rand(low: float, high: float) -> float:
        pauses.append(high)
        return 0.0

    async with KubeClient(wrong_ca, retry=Retry(attempts=5, backoff=1, rand=rand)) as client:
        with pytest.raises(
            Unavailable, match=r"certificate does not verify .*give the cluster's CA"
        ):
            await client.get(NAMESPACES, namespace)
        assert pauses == []  # not retried


# ------------------------------------------------------------------------------ secrets


@pytest.mark.asyncio
async def test_no_token_in_any_message_repr_or_log(
    kube: KubeAPIServer, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    bad = "bad-token-" + "x" * 30
    config = connection(kube.url, ca_file=kube.ca_file, token=StaticToken(bad, source="t"))
    async with KubeClient(config) as client:
        with pytest.raises(Unauthorized, match=r"expired or revoked\? Renew it in t$") as refused:
            await client.get(NAMESPACES, namespace)
        texts = [
            str(refused.value),
            repr(refused.value),
            repr(client),
            repr(config),
            repr(config.token),
            str(refused.value.__context__),
        ]
    async with KubeClient(admin_config(kube)) as admin:
        await admin.list(SANDBOX_CLAIMS, namespace=namespace)
        with pytest.raises(NotFound) as missing:
            await admin.get(SANDBOX_CLAIMS, "nobody", namespace=namespace)
        texts += [str(missing.value), repr(admin)]
    for secret in (bad, kube.admin_token):
        assert all(secret not in text for text in texts)
        assert secret not in caplog.text
    assert "Authorization" not in caplog.text


# ------------------------------------------------------------------------------ retries


def _scripted_client(server: ScriptedHTTPS, **kwargs: Any) -> KubeClient:
    config = connection(
        server.url, ca_data=server.ca_pem, token=StaticToken("scripted-token-value", source="t")
    )
    return KubeClient(config, retry=kwargs.pop("retry", FAST), **kwargs)


def _script(*replies: Reply) -> Callable[[Seen], Reply]:
    queue = list(replies)
    return lambda seen: queue.pop(0) if len(queue) > 1 else queue[0]


OBJECT = Reply(200, {"kind": "SandboxClaim", "metadata": {"name": "c", "resourceVersion": "7"}})


@pytest.mark.asyncio
async def test_idempotent_requests_are_retried_on_5xx_and_dropped_connections(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    answers = _script(
        status(503, "ServiceUnavailable"), Reply(mode="drop"), status(500, "InternalError"), OBJECT
    )
    async with ScriptedHTTPS(answers) as server, _scripted_client(server) as client:
        got = await client.get(SANDBOX_CLAIMS, "c", namespace="ns")
        assert got["metadata"]["name"] == "c"
        assert [s.method for s in server.requests] == ["GET"] * 4
        first = server.requests[0]
        assert (
            first.target == "/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/ns/sandboxclaims/c"
        )
        assert first.headers["authorization"] == "Bearer scripted-token-value"
        assert first.headers["user-agent"] == USER_AGENT
    retries = [r.getMessage() for r in caplog.records if r.name.endswith("._api")]
    assert retries[0].startswith(
        "get sandboxclaims.extensions.agents.x-k8s.io ns/c: attempt 1 of 4 failed (503 Scripted)"
    )
    assert "RemoteProtocolError" in retries[1] and len(retries) == 3
    assert "scripted-token-value" not in caplog.text


@pytest.mark.asyncio
async def test_a_create_is_never_sent_again_after_it_may_have_arrived() -> None:
    for reply in (status(503, "ServiceUnavailable"), status(504, "Timeout"), Reply(mode="drop")):
        async with ScriptedHTTPS(_script(reply, OBJECT)) as server, _scripted_client(server) as c:
            with pytest.raises(Unavailable) as error:
                await c.create(SANDBOX_CLAIMS, claim("c"), namespace="ns")
            assert len(server.requests) == 1, reply
            assert error.value.verb == "create"
            if reply.mode == "drop":
                assert "not sent again: it may have reached the server" in str(error.value)
    # a patch with or without a precondition: likewise
    async with ScriptedHTTPS(_script(status(502, "BadGateway"), OBJECT)) as server:
        async with _scripted_client(server) as c:
            with pytest.raises(Unavailable):
                await c.merge_patch(SANDBOX_CLAIMS, "c", {}, namespace="ns", resource_version="7")
            assert len(server.requests) == 1


@pytest.mark.asyncio
async def test_429_is_retried_for_every_request_honouring_retry_after() -> None:
    busy = Reply(
        429,
        {"kind": "Status", "reason": "TooManyRequests", "code": 429},
        headers={"Retry-After": "0.3"},
    )
    async with ScriptedHTTPS(_script(busy, OBJECT)) as server, _scripted_client(server) as c:
        started = time.monotonic()
        await c.create(SANDBOX_CLAIMS, claim("c"), namespace="ns")
        assert len(server.requests) == 2 and time.monotonic() - started >= 0.3
        body = json.loads(server.requests[0].body)
        assert body["kind"] == "SandboxClaim" and server.requests[0].target.endswith(
            "/sandboxclaims?fieldManager=agent-sandbox-awx"
        )


@pytest.mark.asyncio
async def test_retries_are_bounded_then_unavailable() -> None:
    async with ScriptedHTTPS(_script(status(503, "ServiceUnavailable", "etcd down"))) as server:
        async with _scripted_client(server) as c:
            with pytest.raises(Unavailable, match=r"503 ServiceUnavailable: etcd down \(after 4"):
                await c.list(SANDBOX_CLAIMS, namespace="ns")
            assert len(server.requests) == 4
            # a delete without a precondition is not idempotent; with one it is
            with pytest.raises(Unavailable):
                await c.delete(SANDBOX_CLAIMS, "c", namespace="ns")
            assert len(server.requests) == 5
            with pytest.raises(Unavailable):
                await c.delete(SANDBOX_CLAIMS, "c", namespace="ns", uid="u")
            assert len(server.requests) == 9
            assert json.loads(server.requests[-1].body)["preconditions"] == {"uid": "u"}


@pytest.mark.asyncio
async def test_a_request_that_cannot_connect_is_retried_even_a_create() -> None:
    async with ScriptedHTTPS(_script(OBJECT)) as server:
        url = server.url
    config = connection(url, token=StaticToken("scripted-token-value", source="t"))  # closed port
    async with KubeClient(config, retry=FAST) as client:
        with pytest.raises(Unavailable, match=r"ConnectError.*after 4 attempts"):
            await client.create(SANDBOX_CLAIMS, claim("c"), namespace="ns")


@pytest.mark.asyncio
async def test_redirects_are_never_followed() -> None:
    moved = Reply(302, {}, headers={"Location": "https://elsewhere.invalid/steal"})
    async with ScriptedHTTPS(_script(moved)) as server, _scripted_client(server) as c:
        with pytest.raises(Unavailable, match="redirects are never followed") as error:
            await c.get(SANDBOX_CLAIMS, "c", namespace="ns")
        assert len(server.requests) == 1 and error.value.status == 302
        assert "https://elsewhere.invalid/steal" in str(error.value)


@pytest.mark.asyncio
async def test_a_stalled_watch_ends_dropped_and_an_http_410_is_watch_expired() -> None:
    """A server that sends the headers of the watch and then nothing: the read waits
    timeoutSeconds plus the margin, then the iterator ends DROPPED, never a hang."""
    event = json.dumps({"type": "ADDED", "object": {"metadata": {"resourceVersion": "42"}}})
    stall = Reply(mode="stall", chunks=(event.encode() + b"\n",))
    async with ScriptedHTTPS(_script(status(503, "ServiceUnavailable"), stall)) as server:
        async with _scripted_client(server, timeouts=Timeouts(watch_margin=0.5)) as c:
            started = time.monotonic()
            async with c.watch(
                SANDBOX_CLAIMS, namespace="ns", resource_version="41", timeout_seconds=1
            ) as events:
                assert [kind async for kind, _ in events] == ["ADDED"]
            assert 1.4 < time.monotonic() - started < 5
            assert events.end is WatchEnd.DROPPED and "ReadTimeout" in events.detail
            assert events.resource_version == "42"
            assert len(server.requests) == 2  # the start is retried after the 503
            target = server.requests[1].target
            assert "watch=1" in target and "resourceVersion=41" in target
            assert "allowWatchBookmarks=true" in target and "timeoutSeconds=1" in target
    gone = status(410, "Expired", "too old resource version: 41 (100)")
    async with ScriptedHTTPS(_script(gone)) as server, _scripted_client(server) as c:
        with pytest.raises(WatchExpired, match="too old resource version: 41"):
            async with c.watch(SANDBOX_CLAIMS, namespace="ns", resource_version="41"):
                pass
        assert len(server.requests) == 1


# ------------------------------------------------------------------------------ concurrency


@pytest.mark.asyncio
async def test_one_client_serves_concurrent_tasks_within_its_connection_limit(
    kube: KubeAPIServer, namespace: str
) -> None:
    async with KubeClient(admin_config(kube), max_connections=2) as client:
        await asyncio.gather(
            *(client.create(SANDBOX_CLAIMS, claim(f"n{i}"), namespace=namespace) for i in range(20))
        )
        got = await asyncio.gather(
            *(client.get(SANDBOX_CLAIMS, f"n{i}", namespace=namespace) for i in range(20))
        )
        assert [g["metadata"]["name"] for g in got] == [f"n{i}" for i in range(20)]
        # a watch holds a connection; the other one still serves requests
        async with client.watch(SANDBOX_CLAIMS, namespace=namespace, timeout_seconds=5) as w:
            assert len((await client.list(SANDBOX_CLAIMS, namespace=namespace)).items) == 20
            await w.aclose()
    with pytest.raises(KubeUsageError, match="max_connections=0"):
        KubeClient(admin_config(kube), max_connections=0)
    with pytest.raises(KubeUsageError, match="attempts must be at least 1"):
        Retry(attempts=0)
    assert isinstance(Unavailable("x"), KubeError)
