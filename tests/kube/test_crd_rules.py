"""What the CRDs the tests install refuse, as upstream's generated CRDs refuse it (issue 28,
item 9; tests/deploy/test_crds_upstream.py compares the schemas): a pod template's containers
are a list keyed by name (``x-kubernetes-list-type: map``), and a volume claim template's
``dataSource`` needs ``kind`` and ``name``. Both were accepted by the hand copy before."""

from __future__ import annotations

from typing import Any

import pytest

from tests._support._api import TEMPLATE
from tests._support.kube import KubeAPIServer, KubeError

pytestmark = pytest.mark.slow


def template(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": TEMPLATE[0], "kind": TEMPLATE[1], "metadata": {"name": name},
            "spec": spec}  # fmt: skip


def test_two_containers_of_one_name_are_refused(kube: KubeAPIServer, namespace: str) -> None:
    twice = [{"name": "runtime", "image": "a"}, {"name": "runtime", "image": "b"}]
    with pytest.raises(KubeError) as refused:
        kube.create(template("twice", podTemplate={"spec": {"containers": twice}}), namespace)
    assert refused.value.status_code == 422 and "Duplicate value" in str(refused.value)
    once = [{"name": "runtime", "image": "a"}, {"name": "sidecar", "image": "b"}]
    kube.create(template("once", podTemplate={"spec": {"containers": once}}), namespace)


def test_a_volume_claim_templates_data_source_needs_kind_and_name(
    kube: KubeAPIServer, namespace: str
) -> None:
    pod = {"spec": {"containers": [{"name": "runtime", "image": "a"}]}}

    def claims(source: dict[str, str]) -> list[dict[str, Any]]:
        return [{"metadata": {"name": "data"}, "spec": {"dataSource": source}}]

    with pytest.raises(KubeError) as refused:
        kube.create(template("vct", podTemplate=pod, volumeClaimTemplates=claims({"kind": "X"})),
                    namespace)  # fmt: skip
    assert refused.value.status_code == 422 and "dataSource.name" in str(refused.value)
    whole = claims(
        {"kind": "VolumeSnapshot", "name": "snap", "apiGroup": "snapshot.storage.k8s.io"}
    )
    kube.create(template("vct-ok", podTemplate=pod, volumeClaimTemplates=whole), namespace)
