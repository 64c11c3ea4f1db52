"""The broker's stamps on a claim: the metadata keys under its reserved prefix, in one place for
the claims logic that writes them (``control._claims``, ``control._rpc``) and the backends that
keep them and read them back (the local backend's records, the Kubernetes backend's
SandboxClaims).

- who made the claim (:func:`owner_stamps`, read back by :func:`stamped_owner`): the
  annotations ``issuer``, ``subject``, ``provider``, ``created-at`` and ``attr.<name>`` (the
  caller's attributes, a value that is not a string as JSON);
- what an ``/rpc`` create asked for: ``rpc-claim`` (its claim's name) and ``scopes``;
- the label every claim the broker made carries: :data:`MANAGED_BY_LABEL` = :data:`MANAGED_BY`.

The owner of a claim is ``(issuer, subject)`` (:class:`._interface.Owner`); a backend that
needs more (the Kubernetes backend's owner label, its bookkeeping annotations) builds its keys
from :data:`RESERVED_PREFIX` too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final

from ._interface import Owner, rfc3339

__all__ = [
    "ATTRIBUTE",
    "CREATED_AT",
    "ISSUER",
    "MANAGED_BY",
    "MANAGED_BY_LABEL",
    "PROVIDER",
    "RESERVED_PREFIX",
    "RPC_CLAIM",
    "SCOPES",
    "SUBJECT",
    "owner_stamps",
    "stamped_owner",
]

RESERVED_PREFIX: Final = "broker.agent-sandbox-awx.io/"
"""The broker's own metadata keys (= ``identity._policy.RESERVED_PREFIX``, which refuses them
in what callers send: the layers below the broker cannot import each other, so it is written
twice; tests/broker/test_stamps.py holds them equal)."""
ISSUER: Final = RESERVED_PREFIX + "issuer"
SUBJECT: Final = RESERVED_PREFIX + "subject"
PROVIDER: Final = RESERVED_PREFIX + "provider"
CREATED_AT: Final = RESERVED_PREFIX + "created-at"
ATTRIBUTE: Final = RESERVED_PREFIX + "attr."
"""The prefix of a caller's attribute (``attr.namespace``, ``attr.repository``, ...)."""
RPC_CLAIM: Final = RESERVED_PREFIX + "rpc-claim"
SCOPES: Final = RESERVED_PREFIX + "scopes"
MANAGED_BY_LABEL: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "agent-sandbox-awx-broker"


def owner_stamps(
    owner: Owner, created_at: float, attributes: Mapping[str, object]
) -> dict[str, str]:
    """The stamps that say who made a claim ``created_at`` (epoch seconds), with the caller's
    ``attributes``."""
    made = {
        ISSUER: owner.issuer,
        SUBJECT: owner.subject,
        PROVIDER: owner.provider,
        CREATED_AT: rfc3339(created_at),
    }
    for attr, value in attributes.items():
        made[ATTRIBUTE + attr] = json.dumps(value) if not isinstance(value, str) else value
    return made


def stamped_owner(annotations: Mapping[str, str]) -> Owner:
    """The owner a claim's stamps name (empty fields where a stamp is missing)."""
    return Owner(
        annotations.get(ISSUER, ""), annotations.get(SUBJECT, ""), annotations.get(PROVIDER, "")
    )
