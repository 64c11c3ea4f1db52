"""The pod labels and annotations of a claim (``spec.additionalPodMetadata``), checked as
agent-sandbox's claim controller checks them, before the claim is made.

The controller (``validateAdditionalPodMetadata`` in extensions/controllers/
sandboxclaim_controller.go, commit 2fd412d5) refuses a claim whose pod metadata breaks its rules
with ``Ready=False``, reason ``InvalidMetadata``, after the claim exists; the broker refuses the
create instead (``400``) with the rule and the setting. Its rules, beyond the syntax of keys and
label values (which the broker checks for every label: ``broker.common._metadata``):

- a pod **label** needs a domain prefix (``DOMAIN/name``), and the domain must be one of the
  controller's allowed label domains or a subdomain of one (compared in lower case); the
  controller reads them from ``/etc/sandbox-config/allowed-label-domains`` in its pod (comma-
  or line-separated) and falls back to ``sandbox.users.io`` when there are none; the broker's
  copy of that list is ``backend.kubernetes.pod_label_domains`` (:data:`DEFAULT_LABEL_DOMAINS`);
- the label ``app=sandbox-router`` (any case) is refused: it would admit the pod where the
  router's pods are admitted;
- a pod **annotation** may not be in a system domain (:data:`RESTRICTED_DOMAINS` or a
  subdomain), except the cluster autoscaler's ``safe-to-evict``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from .._interface import ClaimInvalid

__all__ = ["DEFAULT_LABEL_DOMAINS", "RESTRICTED_DOMAINS", "check_pod_metadata"]

DEFAULT_LABEL_DOMAINS: Final = ("sandbox.users.io",)
"""The controller's allowed label domains when it is given none (its "secure default")."""
RESTRICTED_DOMAINS: Final = ("kubernetes.io", "k8s.io", "agents.x-k8s.io")
SAFE_TO_EVICT: Final = "cluster-autoscaler.kubernetes.io/safe-to-evict"
SETTING: Final = "backend.kubernetes.pod_label_domains"


def _in(domain: str, domains: Sequence[str]) -> bool:
    return any(domain == d or domain.endswith("." + d) for d in domains)


def check_pod_metadata(
    pod_metadata: Mapping[str, Mapping[str, str]], label_domains: Sequence[str]
) -> None:
    """Raise :class:`ClaimInvalid` naming the first pod label or annotation the controller
    would refuse (see the module)."""
    domains = ", ".join(label_domains)
    for key, value in (pod_metadata.get("labels") or {}).items():
        prefix, _, _ = key.rpartition("/")
        if key.lower() == "app" and value.lower() == "sandbox-router":
            raise ClaimInvalid(
                f"pod label {key}={value} is refused by agent-sandbox's controller: it marks the "
                "router's own pods (whose traffic the sandboxes' NetworkPolicy admits); use "
                "another label"
            )
        if not prefix or not _in(prefix.lower(), label_domains):
            why = "has no domain prefix" if not prefix else f"is in domain {prefix!r}"
            example = f"{label_domains[0]}/{key.rpartition('/')[2] or 'team'}"
            raise ClaimInvalid(
                f"pod label {key!r} {why}: agent-sandbox takes only DOMAIN/NAME pod labels in "
                f"{domains} or a subdomain ({SETTING}), e.g. {example!r}"
            )
    for key in pod_metadata.get("annotations") or {}:
        prefix, _, _ = key.rpartition("/")
        if prefix and _in(prefix.lower(), RESTRICTED_DOMAINS) and key != SAFE_TO_EVICT:
            raise ClaimInvalid(
                f"pod annotation {key!r} is in a system domain ({', '.join(RESTRICTED_DOMAINS)} "
                "and their subdomains), which agent-sandbox's controller refuses on a sandbox's "
                "pod; use a domain of your own"
            )
