"""The stand-in garbage collector: what kube-controller-manager would do for the kinds the
stand-in controller makes (the test API server runs no kube-controller-manager).

- An owner deleted: each Sandbox, Pod, Service and PersistentVolumeClaim of its namespace whose
  owner references all point at objects that are gone is deleted (background propagation).
- An owner deleted with ``propagationPolicy: Foreground`` (finalizer ``foregroundDeletion``):
  its dependents are deleted (foreground too), and once none is left the finalizer is removed,
  which lets the API server delete the owner. ``Orphan`` (finalizer ``orphan``): the owner
  reference is removed from the dependents, then the finalizer.
- After a relist (start, API server restart, 410): a sweep deletes every dependent whose owners
  are all gone, for the deletions the watch did not deliver.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

from tests._support import _agent_sandbox as rules
from tests._support._api import POD, PVC, SANDBOX, SERVICE, Api, collection, kind_of, path

DEPENDENT_KINDS: Final = (SANDBOX, POD, SERVICE, PVC)
FOREGROUND: Final = "foregroundDeletion"
ORPHAN: Final = "orphan"


class Collector:
    def __init__(self, api: Api, namespaces: list[str] | None) -> None:
        self.api, self.namespaces = api, namespaces

    def owner_deleted(self, namespace: str) -> None:
        """An owner of ``namespace`` is gone: delete the dependents left without owner."""
        for kind, obj in self._dependents(namespace):
            if self._orphaned(obj):
                self._delete(kind, obj)

    def finalize(self, kind: tuple[str, str], namespace: str, name: str) -> float | None:
        """Foreground or orphan deletion of one owner; seconds until it looks again."""
        owner = self.api.get(path(kind, namespace, name))
        if owner is None or not rules.deleting(owner):
            return None
        finalizers = list(owner["metadata"].get("finalizers") or [])
        owner_uid = rules.uid(owner)
        mine = [(k, o) for k, o in self._dependents(namespace) if _refs(o, owner_uid)]
        if FOREGROUND in finalizers:
            for dependent_kind, dependent in mine:
                if not rules.deleting(dependent):  # foreground again if it has dependents
                    again = "Foreground" if dependent_kind == SANDBOX else None
                    self._delete(dependent_kind, dependent, again)
            if mine:
                return 0.1
            self._drop_finalizer(kind, owner, FOREGROUND)
            return None
        if ORPHAN in finalizers:
            for dependent_kind, dependent in mine:
                refs = [
                    r for r in dependent["metadata"]["ownerReferences"] if r.get("uid") != owner_uid
                ]
                metadata = dependent["metadata"]
                self.api.merge(
                    path(dependent_kind, metadata["namespace"], metadata["name"]),
                    {"metadata": {"ownerReferences": refs or None}},
                )
            self._drop_finalizer(kind, owner, ORPHAN)
        return None

    def sweep(self) -> None:
        """Delete the dependents whose owners are all gone, in every namespace watched."""
        scopes: list[str | None] = [None] if self.namespaces is None else [*self.namespaces]
        for namespace in scopes:
            for kind, obj in self._dependents(namespace):
                if not rules.deleting(obj) and self._orphaned(obj):
                    self._delete(kind, obj)

    def _dependents(
        self, namespace: str | None
    ) -> Iterator[tuple[tuple[str, str], dict[str, Any]]]:
        for kind in DEPENDENT_KINDS:
            for obj in self.api.list(collection(kind, namespace)):
                if obj["metadata"].get("ownerReferences"):
                    yield kind, obj

    def _orphaned(self, obj: dict[str, Any]) -> bool:
        """Whether every owner of ``obj`` this collector knows is gone (owners of other
        kinds are taken to exist)."""
        namespace = obj["metadata"]["namespace"]
        for ref in obj["metadata"]["ownerReferences"]:
            kind = kind_of(str(ref.get("apiVersion", "")), str(ref.get("kind", "")))
            if kind is None:
                return False
            owner = self.api.get(path(kind, namespace, ref["name"]))
            if owner is not None and rules.uid(owner) == ref.get("uid"):
                return False
        return True

    def _delete(
        self, kind: tuple[str, str], obj: dict[str, Any], propagation: str | None = None
    ) -> None:
        metadata = obj["metadata"]
        self.api.delete(
            path(kind, metadata["namespace"], metadata["name"]),
            propagation=propagation,
            uid=metadata["uid"],
        )

    def _drop_finalizer(self, kind: tuple[str, str], owner: dict[str, Any], finalizer: str) -> None:
        finalizers = owner["metadata"]["finalizers"]
        index = finalizers.index(finalizer)
        metadata = owner["metadata"]
        self.api.json_patch(
            path(kind, metadata["namespace"], metadata["name"]),
            [
                {"op": "test", "path": f"/metadata/finalizers/{index}", "value": finalizer},
                {"op": "remove", "path": f"/metadata/finalizers/{index}"},
            ],
        )


def _refs(obj: dict[str, Any], owner_uid: str) -> bool:
    return any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or [])
