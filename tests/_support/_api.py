"""REST calls of the stand-in controller: paths of the kinds it handles, and a small client.

Every read goes to the API server (no cache): a reconcile always starts from what is stored,
so a write of its own that a watch has not delivered yet cannot be missed (upstream reads its
informer cache and guards that case with expectations and optimistic locks).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

import httpx

from tests._support._agent_sandbox import EXTENSIONS_API, SANDBOX_API
from tests._support.kube import KubeError

CLAIM: Final = (EXTENSIONS_API, "SandboxClaim")
TEMPLATE: Final = (EXTENSIONS_API, "SandboxTemplate")
POOL: Final = (EXTENSIONS_API, "SandboxWarmPool")
SANDBOX: Final = (SANDBOX_API, "Sandbox")
POD: Final = ("v1", "Pod")
SERVICE: Final = ("v1", "Service")
PVC: Final = ("v1", "PersistentVolumeClaim")
SERVICE_ACCOUNT: Final = ("v1", "ServiceAccount")
_PLURALS: Final = {
    "SandboxClaim": "sandboxclaims",
    "SandboxTemplate": "sandboxtemplates",
    "SandboxWarmPool": "sandboxwarmpools",
    "Sandbox": "sandboxes",
    "Pod": "pods",
    "Service": "services",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "ServiceAccount": "serviceaccounts",
}


def collection(kind: tuple[str, str], namespace: str | None) -> str:
    """The collection of ``kind`` in ``namespace`` (None: all namespaces)."""
    api_version, name = kind
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    scope = f"/namespaces/{namespace}" if namespace else ""
    return f"{prefix}{scope}/{_PLURALS[name]}"


def path(kind: tuple[str, str], namespace: str, name: str, sub: str | None = None) -> str:
    return f"{collection(kind, namespace)}/{name}" + (f"/{sub}" if sub else "")


def kind_of(api_version: str, kind: str) -> tuple[str, str] | None:
    """The (apiVersion, kind) this module knows for an owner reference (any version)."""
    group = api_version.rpartition("/")[0]
    for known in (CLAIM, TEMPLATE, POOL, SANDBOX):
        if known[1] == kind and known[0].rpartition("/")[0] == group:
            return known
    return None


class Api:
    """A thin JSON client over one ``httpx.Client`` (the caller's thread's own)."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client

    def request(self, method: str, url: str, **kwargs: Any) -> dict[str, Any]:
        response = self.client.request(method, url, **kwargs)
        if response.is_error:
            raise KubeError(method, url, response)
        return dict(response.json())

    def get(self, url: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", url)
        except KubeError as exc:
            if exc.status_code == 404:
                return None
            raise

    def list(self, url: str, selector: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        params = (
            {"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())} if selector else {}
        )
        return list(self.request("GET", url, params=params).get("items") or [])

    def create(self, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", url, json=body)

    def replace(self, url: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT: an update guarded by the body's ``resourceVersion`` (409 when stale)."""
        return self.request("PUT", url, json=body)

    def merge(self, url: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch; ``metadata.resourceVersion`` in it is a precondition."""
        return self.request(
            "PATCH",
            url,
            content=json.dumps(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )

    def json_patch(self, url: str, operations: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return self.request(
            "PATCH",
            url,
            content=json.dumps(list(operations)),
            headers={"Content-Type": "application/json-patch+json"},
        )

    def delete(self, url: str, *, propagation: str | None = None, uid: str | None = None) -> bool:
        """Delete; False when it was already gone."""
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if propagation:
            options["propagationPolicy"] = propagation
        if uid:
            options["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", url, json=options)
        except KubeError as exc:
            if exc.status_code in (404, 409):  # gone, or gone and replaced (uid precondition)
                return False
            raise
        return True
