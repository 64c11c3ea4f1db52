"""Policies as rules: which identities may use which warm pools, where, how much.

A :class:`PolicySet` is an ordered list of :class:`PolicyRule` (a configuration file's
``[[policies]]`` tables, field for field). For a verified :class:`Caller` the first rule that
matches gives its :class:`Policy`; none matching is :class:`PolicyDenied` (the broker answers
``403 policy_denied``). A rule matches when:

- ``issuer`` names the caller's issuer (and so its provider);
- ``subject``, an ``fnmatch`` glob (case-sensitive; ``*`` also crosses ``/`` and ``:``),
  matches the caller's ``sub``;
- every entry of ``claims`` matches: the key is a claim name, dotted for a nested claim
  (``kubernetes.io.namespace``); the value is a glob or a list of globs, one of which must
  match. A claim the token does not have never matches; a claim that is not a string is
  compared by its compact JSON text (``true``, ``42``, ``["a","b"]``).

The local broker's per-issuer ``Policy`` is the one-rule set :meth:`PolicySet.single`
(:class:`IssuerPolicies` applies it to whichever issuer verified the caller).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, NoReturn, Protocol

from ._issuer import TrustedIssuer
from ._policy import SCOPES, Caller, Policy, caller_namespace
from ._ports import DEFAULT_PORTS
from ._providers import MISSING, claim_at, claim_text
from ._settings import IssuerSettings, SettingsError

__all__ = [
    "CALLER_NAMESPACE",
    "IssuerPolicies",
    "PolicyDenied",
    "PolicyRule",
    "PolicySet",
    "PolicySource",
]

CALLER_NAMESPACE: Final = "{caller.namespace}"
"""The ``namespace`` of a rule that puts each caller's sandboxes in its own namespace."""


class PolicyDenied(Exception):
    """No policy admits the caller: a ``403`` with code ``policy_denied``. The message names
    the identity (issuer and subject), never the token."""

    status: Final = 403
    code: Final = "policy_denied"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class PolicySource(Protocol):
    """What the broker asks for a verified caller's policy."""

    def policy_for(self, caller: Caller) -> Policy: ...


@dataclass(frozen=True)
class PolicyRule:
    """One ``[[policies]]`` entry (see the module for matching).

    ``warm_pools``: the pools (v1 templates) allowed, the first the default; ``namespace``: a
    fixed namespace, or :data:`CALLER_NAMESPACE`; ``max_sandboxes``: live sandboxes per
    caller; ``max_lifetime_seconds``: the cap from creation; ``scopes``: the data-plane
    scopes granted; ``ports``: the sandbox ports its callers may reach (``Policy.ports``)."""

    name: str
    issuer: str
    warm_pools: tuple[str, ...]
    namespace: str
    subject: str = "*"
    claims: Mapping[str, str | Sequence[str]] = field(default_factory=dict)
    max_sandboxes: int = 5
    max_lifetime_seconds: int = 3600
    scopes: tuple[str, ...] = SCOPES
    ports: tuple[int | str, ...] = DEFAULT_PORTS

    def __post_init__(self) -> None:
        for name in ("warm_pools", "scopes", "ports"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Sequence):
                kind = "ports and ranges" if name == "ports" else "strings"
                self._fail(name, f"must be a list of {kind}, not {value!r}")
            object.__setattr__(self, name, tuple(value))
        if not isinstance(self.name, str) or not self.name:
            self._fail("name", "must name the policy (it is logged with each admission)")
        if not isinstance(self.subject, str) or not self.subject:
            self._fail("subject", "must be a glob of the token's sub, e.g. '*'")
        claims: object = self.claims
        if not isinstance(claims, Mapping):
            self._fail("claims", f"must be a table of claim = glob(s), not {claims!r}")
        accepted = {key: self._globs(key, value) for key, value in claims.items()}
        object.__setattr__(self, "claims", accepted)

    def _fail(self, field_name: str, message: str) -> NoReturn:
        raise SettingsError(f"policy {self.name!r}", field_name, message)

    def _globs(self, key: object, value: object) -> tuple[str, ...]:
        if not isinstance(key, str) or not key or "" in key.split("."):
            self._fail("claims", f"{key!r} is not a claim name (dotted for a nested claim)")
        globs = (value,) if isinstance(value, str) else value
        if (
            not isinstance(globs, Sequence)
            or not globs
            or not all(isinstance(g, str) and g for g in globs)
        ):
            self._fail(
                f"claims.{key}", f"must be a glob or a non-empty list of globs, not {value!r}"
            )
        assert isinstance(globs, Sequence)
        return tuple(globs)

    def policy(self) -> Policy:
        """The :class:`Policy` this rule grants (its checks raise :class:`SettingsError`)."""
        namespace: str | Callable[[Caller], str] = self.namespace
        if self.namespace == CALLER_NAMESPACE:
            namespace = caller_namespace
        elif isinstance(self.namespace, str) and "{" in self.namespace:
            self._fail(
                "namespace", f"{self.namespace!r}: the only placeholder is {CALLER_NAMESPACE}"
            )
        try:
            return Policy(
                templates=self.warm_pools,
                namespace=namespace,
                max_sandboxes=self.max_sandboxes,
                max_lifetime_seconds=self.max_lifetime_seconds,
                scopes=self.scopes,
                ports=self.ports,
            )
        except (ValueError, TypeError) as exc:
            raise SettingsError(f"policy {self.name!r}", "policy", str(exc)) from None

    def matches(self, caller: Caller) -> bool:
        """Whether the caller's subject and claims match (its issuer is the set's to check)."""
        if not fnmatch.fnmatchcase(caller.subject, self.subject):
            return False
        for key, globs in self.claims.items():
            value = claim_at(caller.claims, key)
            if value is MISSING:
                return False
            text = claim_text(value)
            if not any(fnmatch.fnmatchcase(text, glob) for glob in globs):
                return False
        return True


@dataclass(frozen=True)
class _Compiled:
    rule: PolicyRule
    issuer_url: str
    policy: Policy


class PolicySet:
    """The rules in order, each bound to its issuer's URL; built once at start (every rule's
    issuer must be one of ``issuers``, every rule's policy valid)."""

    def __init__(self, rules: Sequence[PolicyRule], issuers: Sequence[IssuerSettings]) -> None:
        urls = {settings.name: settings.url for settings in issuers}
        self._names = {settings.url: settings.name for settings in issuers}
        seen: set[str] = set()
        compiled: list[_Compiled] = []
        for rule in rules:
            if rule.name in seen:
                rule._fail("name", "is used twice; give each policy its own name")
            seen.add(rule.name)
            if rule.issuer not in urls:
                known = ", ".join(repr(n) for n in sorted(urls)) or "none"
                rule._fail("issuer", f"{rule.issuer!r} is no configured issuer (known: {known})")
            compiled.append(_Compiled(rule, urls[rule.issuer], rule.policy()))
        self._rules = tuple(compiled)

    @classmethod
    def single(cls, issuer_url: str, policy: Policy, *, name: str = "issuer") -> PolicySet:
        """The one-rule set that gives every caller of ``issuer_url`` ``policy`` (the local
        broker's per-issuer policy)."""
        rules = cls([], [])
        namespace = policy.namespace
        if not isinstance(namespace, str):  # a function of the caller: described, not parsed
            shown = getattr(namespace, "__name__", "rule")
            namespace = CALLER_NAMESPACE if namespace is caller_namespace else f"<{shown}>"
        rule = PolicyRule(
            name,
            name,
            policy.templates,
            namespace,
            max_sandboxes=policy.max_sandboxes,
            max_lifetime_seconds=policy.max_lifetime_seconds,
            scopes=policy.scopes,
            ports=policy.ports,
        )
        rules._rules = (_Compiled(rule, issuer_url, policy),)
        rules._names = {issuer_url: name}
        return rules

    @property
    def rules(self) -> tuple[PolicyRule, ...]:
        return tuple(c.rule for c in self._rules)

    def rule_for(self, caller: Caller) -> PolicyRule:
        """The first rule that admits ``caller``; else :class:`PolicyDenied`."""
        return self._match(caller).rule

    def policy_for(self, caller: Caller) -> Policy:
        """The policy of the first rule that admits ``caller``; else :class:`PolicyDenied`."""
        return self._match(caller).policy

    def _match(self, caller: Caller) -> _Compiled:
        for compiled in self._rules:
            if compiled.issuer_url == caller.issuer and compiled.rule.matches(caller):
                return compiled
        name = self._names.get(caller.issuer)
        issuer = f"issuer {name!r} ({caller.issuer})" if name else f"issuer {caller.issuer!r}"
        raise PolicyDenied(
            f"no policy admits {issuer} subject {caller.subject!r}: ask the broker's "
            "operators for a policy that matches this identity"
        )


class IssuerPolicies:
    """The local broker's policies: each issuer's own ``policy``, as a one-rule set."""

    def __init__(self, issuers: Callable[[], Mapping[str, TrustedIssuer]]) -> None:
        self._issuers = issuers

    def policy_for(self, caller: Caller) -> Policy:
        return self._single(caller).policy_for(caller)

    def rule_for(self, caller: Caller) -> PolicyRule:
        """The one rule of the caller's issuer (named after the issuer)."""
        return self._single(caller).rule_for(caller)

    def _single(self, caller: Caller) -> PolicySet:
        issuer = self._issuers().get(caller.issuer)
        if issuer is None:
            raise PolicyDenied(f"no policy admits issuer {caller.issuer!r}: it is not trusted")
        return PolicySet.single(issuer.url, issuer.policy, name=issuer.settings.name)
