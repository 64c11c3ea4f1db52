"""The control-plane logic both dialects share: a caller's claims, from admission to deletion.

The v1 and ``/rpc`` front-ends parse their wire shapes and call :class:`Claims`, which applies
the caller's policy (its namespace, templates, quota, lifetime cap), stamps the attribution
(who made the claim, under the reserved prefix) and keeps the answers' rules (owner-only
lookups, idempotent creates), over the :class:`.backends._interface.Backend` that keeps the
state. Errors are :class:`..common._errors.ApiError`; each front-end writes them in its own shape.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ..backends._interface import (
    Backend,
    ClaimForgotten,
    ClaimInvalid,
    ClaimRequest,
    ClaimState,
    Created,
    Idempotency,
    IdempotencyConflict,
    Owner,
    QuotaExceeded,
    WarmPool,
    rfc3339,
)
from ..backends._stamps import owner_stamps
from ..common._errors import ApiError
from ..common._observed import current, note_decision, note_sandbox
from ..identity._policy import Caller, Policy
from ..identity._rules import PolicyDenied, PolicySource


def owner_of(caller: Caller) -> Owner:
    return Owner(caller.issuer, caller.subject, caller.provider)


def stamps(caller: Caller, now: float, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The attribution stamps of a sandbox ``caller`` creates ``now`` (and ``extra``): see
    :mod:`..backends._stamps`."""
    made = owner_stamps(owner_of(caller), now, caller.attributes)
    made.update(extra or {})
    return made


class Claims:
    """A caller's claims over ``backend``, with the broker's rules; ``policies`` gives each
    verified caller its policy (the local broker's issuers' own, or a configuration's rules)."""

    def __init__(self, backend: Backend, policies: PolicySource) -> None:
        self.backend = backend
        self.policies = policies

    # -- policy --------------------------------------------------------------------------------
    def namespace_of(self, caller: Caller) -> str | None:
        """Where the caller's claims go (its policy's namespace), as a lookup's hint; ``None``
        when its policy gives none (the lookup then finds nothing the backend must search)."""
        try:
            return self.policies.policy_for(caller).namespace_for(caller)
        except (PolicyDenied, ValueError, KeyError):
            return None

    def policy(self, caller: Caller) -> Policy:
        """The policy of ``caller``; 403 when none admits it."""
        try:
            policy = self.policies.policy_for(caller)
        except PolicyDenied as exc:
            raise ApiError(403, exc.code, exc.detail) from None
        if current() is not None:  # the audit log names the rule that admitted the caller
            note_decision(policy=self.policy_name(caller))
        return policy

    def policy_name(self, caller: Caller) -> str | None:
        """The name of the rule that gives ``caller`` its policy (``None``: unnamed)."""
        rule_for = getattr(self.policies, "rule_for", None)
        if rule_for is None:
            return None
        try:
            name: str = rule_for(caller).name
        except PolicyDenied:
            return None
        return name

    @staticmethod
    def describe(caller: Caller, policy: Policy) -> dict[str, Any]:
        """The policy as ``whoami`` shows it; 403 when it has no place for the caller."""
        try:
            return policy.describe(caller)
        except (ValueError, KeyError) as exc:
            raise ApiError(
                403, "policy_denied", f"no policy applies to this caller: {exc}"
            ) from None

    async def check_template(self, caller: Caller, policy: Policy, template: str) -> None:
        """A v1 create's template exists (404) and the caller's policy allows it (403)."""
        known = await self.backend.templates()
        if template not in known:
            raise ApiError(
                404,
                "template_not_found",
                f"template {template!r} does not exist; known: {sorted(known)}",
                logged=f"the template the request names does not exist; known: {sorted(known)}",
            )
        if template not in policy.templates:
            raise ApiError(
                403,
                "template_not_allowed",
                f"provider {caller.provider!r} may not use template {template!r}; allowed: "
                f"{list(policy.templates)}",
            )

    async def resolve_pool(self, caller: Caller, policy: Policy, pool: str) -> WarmPool:
        """An ``/rpc`` create's warm pool: its template, or why a claim on it fails (the claim
        is still made, Failed); 403 when the caller's policy does not allow its template."""
        resolved = await self.backend.resolve_warm_pool(pool)
        if resolved.failure is None and resolved.template not in policy.templates:
            raise ApiError(
                403,
                "template_not_allowed",
                f"provider {caller.provider!r} may not use warm pool {pool!r} (template "
                f"{resolved.template!r}); allowed templates: {list(policy.templates)}",
            )
        return resolved

    # -- create --------------------------------------------------------------------------------
    async def replay(self, caller: Caller, key: str, digest: str) -> ClaimState | None:
        """The claim an earlier create of ``caller`` with Idempotency-Key ``key`` made
        (``None``: a new key); 409 for another body, 404 once that claim is forgotten."""
        try:
            found = await self.backend.replay(
                owner_of(caller), Idempotency(key, digest), namespace=self.namespace_of(caller)
            )
        except IdempotencyConflict:
            raise _idempotency_conflict() from None
        except ClaimForgotten as exc:
            raise ApiError(
                404,
                "not_found",
                f"sandbox {exc.name!r}, which this Idempotency-Key created, was deleted "
                "and is no longer remembered; use a new Idempotency-Key to create another "
                "sandbox",
            ) from None
        if found is not None:
            note_sandbox(found.name, claim=found.claim_name)
            note_decision(replayed=True, namespace=found.namespace)
        return found

    async def admit(
        self,
        caller: Caller,
        policy: Policy,
        *,
        template: str,
        labels: Mapping[str, str],
        annotations: Mapping[str, str],
        env: Mapping[str, str],
        lifetime: float,
        scopes: frozenset[str],
        extra_stamps: Mapping[str, str] | None = None,
        **claim: Any,
    ) -> Created:
        """Admit one sandbox for ``caller`` (both dialects): its namespace (403), the
        attribution stamps, the quota (429), the claim (``claim``: the other fields of
        :class:`.backends._interface.ClaimRequest`). ``replayed``: an idempotent create found
        the claim an earlier one made (on another replica)."""
        try:
            namespace = policy.namespace_for(caller)
        except (ValueError, KeyError) as exc:
            raise ApiError(403, "policy_denied", f"no namespace for this caller: {exc}") from None
        now = time.time()
        request = ClaimRequest(
            owner=owner_of(caller),
            namespace=namespace,
            template=template,
            labels=labels,
            annotations=annotations,
            stamps=stamps(caller, now, extra_stamps),
            env=env,
            created_at=now,
            lifetime_seconds=lifetime,
            scopes=scopes,
            max_live=policy.max_sandboxes,
            network=policy.network,
            **claim,
        )
        note_decision(
            namespace=namespace,
            template=template,
            pool=claim.get("warm_pool") or template,
            lifetime_seconds=round(lifetime),  # whole seconds (an int) in both dialects
        )
        try:
            made = await self.backend.create(request)
        except IdempotencyConflict:
            raise _idempotency_conflict() from None
        except ClaimInvalid as exc:  # the API server's message may quote the request's metadata
            logged = "the backend refused the claim (its reason is in the answer)"
            raise ApiError(400, "invalid_request", exc.detail, logged=logged) from None
        except QuotaExceeded as exc:
            raise self._quota_exceeded(caller, exc) from None
        note_sandbox(made.state.name, claim=made.state.claim_name)
        note_decision(expires_at=rfc3339(made.state.expires_at))
        if made.replayed:
            note_decision(replayed=True)
        return made

    def _quota_exceeded(self, caller: Caller, exc: QuotaExceeded) -> ApiError:
        """The 429 of a create over the caller's quota: which quota, its value, how many the
        caller holds (the same words under both dialects; noted for the audit log)."""
        note_decision(quota={"name": "max_sandboxes", "limit": exc.maximum, "held": exc.held})
        name = self.policy_name(caller)
        policy = f"policy {name!r}" if name else "its policy"
        pending = f" ({exc.pending} of them still being created)" if exc.pending else ""
        return ApiError(
            429,
            "quota_exceeded",
            f"quota max_sandboxes exceeded: caller {caller.subject!r} holds {exc.held} live "
            f"sandboxes{pending}, the maximum of {policy} (max_sandboxes = {exc.maximum}); "
            "delete one first",
        )

    # -- the caller's claims -------------------------------------------------------------------
    async def owned(self, caller: Caller, name: str) -> ClaimState:
        """The caller's claim ``name``; 404 for a claim that is not the caller's, as for one
        that does not exist (nothing about another identity's claim is disclosed)."""
        state = await self.backend.get(name, namespace=self.namespace_of(caller))
        if state is None or state.owner.key != (caller.issuer, caller.subject):
            raise ApiError(404, "not_found", f"sandbox {name!r} does not exist for this caller")
        return state

    async def find(self, caller: Caller, claim_name: str) -> ClaimState | None:
        """The ``/rpc`` claim ``claim_name`` where the caller's claims go (its policy's
        namespace; of any owner there: the caller checks). A claim in another namespace is
        ``None``, as one that does not exist, whatever the backend keeps: no tenant learns that
        another's claim exists (v1's rule for another caller's sandbox), and the local backend,
        one store for all namespaces, answers as the Kubernetes one, which looks only there."""
        namespace = self.namespace_of(caller)
        if namespace is None:
            return None
        state = await self.backend.find_claim(claim_name, namespace=namespace)
        return state if state is not None and state.namespace == namespace else None

    async def mine(self, caller: Caller) -> list[ClaimState]:
        return await self.backend.list_owned(owner_of(caller), namespace=self.namespace_of(caller))

    async def delete(self, state: ClaimState) -> ClaimState:
        """Begin deleting the claim of ``state`` (Terminating; gone once its runtime stopped)."""
        note_sandbox(state.name, claim=state.claim_name)
        note_decision(namespace=state.namespace)
        deleted = await self.backend.delete(state.name, namespace=state.namespace, uid=state.uid)
        return deleted or state

    async def set_expiry(self, state: ClaimState, expires_at: float) -> ClaimState:
        """Move the expiry of the claim of ``state`` (the caller's cap checked before); 409 when
        it went meanwhile."""
        note_sandbox(state.name, claim=state.claim_name)
        note_decision(
            namespace=state.namespace,
            expires_at=rfc3339(expires_at),
            previous_expires_at=rfc3339(state.expires_at),
        )
        moved = await self.backend.set_expiry(state.name, expires_at, namespace=state.namespace)
        if moved is None:
            raise ApiError(409, "terminating", f"sandbox {state.name!r} is being deleted")
        return moved

    async def wait_ready(self, state: ClaimState, within: float) -> ClaimState:
        """The claim of ``state`` once it is no longer Pending, or after ``within`` s."""
        return await self.backend.wait_ready(state.name, within, namespace=state.namespace) or state


def _idempotency_conflict() -> ApiError:
    return ApiError(
        409,
        "idempotency_conflict",
        "this Idempotency-Key was used with a different body; use a new key for a different create",
    )
