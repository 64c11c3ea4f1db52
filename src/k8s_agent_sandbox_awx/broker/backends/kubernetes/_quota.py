"""Each owner's quota ledger: the serialization point of creates across replicas.

One Lease (``coordination.k8s.io/v1``) per owner and namespace, ``sbx-quota-`` + the owner
hash, labelled like the claims (:data:`._claims.OWNER_LABEL`, managed-by), annotated with the
owner's issuer and subject and with :data:`QUOTA`: a JSON object from claim name to a
reservation deadline (epoch seconds; ``0``: the claim was seen made and live). The rules
(docs/broker/kubernetes.md, "Quotas"):

- **reserve**: before its claim is POSTed, a create writes the claim's name into the ledger,
  with a ``resourceVersion`` precondition (or creates the ledger). Of two writes from the same
  version one wins; the other reads the ledger again and decides again. So every admitted create
  is in the ledger before its claim exists, and a create is admitted only while the ledger holds
  fewer than the maximum other entries: under any interleaving, on any number of replicas,
  exactly ``min(maximum - held, racers)`` are admitted.
- **reconcile**: an entry stays while its claim is live, or while the claim does not exist yet
  and its reservation has not lapsed. Whenever the ledger is full (or missing, or unreadable),
  the owner's claims are listed (a consistent read) before the decision: an entry whose claim is
  gone, Failed or Terminating (deleted or expired by anyone), or whose reservation lapsed (a
  replica killed between its reservation and its claim, a POST refused) is dropped, and a live
  claim the ledger lacks (made by an older broker, or a ledger deleted by someone) is added. A
  reservation whose claim is not listed but which the claim cache saw go (a claim of that name
  whose ``reservation`` annotation is that reservation's, deleted) was made and is gone: it is
  dropped too, and so is a reservation whose deadline lies further ahead than a broker ever
  writes one (someone else's write: it cannot hold a slot forever). The entries of claims made
  are marked made (``0``) there, and by every write of a replica whose claim cache holds them
  (:meth:`._informer.ClaimCache.made`). A refusal is decided on that list: what it says the
  owner holds is what the race decided.
- **lapse**: a reservation holds :attr:`QuotaLedger.reservation_seconds` (15 s). The claim's
  POST must be answered within two thirds of it (the API server is told the same deadline:
  its ``timeout`` parameter), so a reservation dropped as lapsed (its deadline before the list
  that drops it began) can no longer become a claim, even with clocks 5 s apart.
- **release**: a create whose POST the API server refused removes the name it added; one whose
  outcome is unknown leaves it to lapse (or to be found made).

A replica keeps the last version of each ledger it read or wrote (:data:`MEMO_SIZE` ledgers):
a create tries its write on that version first, so on one replica a create costs the ledger's
write and the claim's POST; a version another replica changed since costs a 409 and a GET. A
replica makes one reservation at a time per ledger (the claims' POSTs are not held), so that
one owner's concurrent creates on one replica do not conflict with each other.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from cachetools import LRUCache

from .._interface import BackendUnavailable, Owner, QuotaExceeded
from .._stamps import ISSUER, MANAGED_BY, MANAGED_BY_LABEL, SUBJECT
from ._api import KubeClient
from ._api_errors import AlreadyExists, Conflict, KubeError, NotFound
from ._api_types import LEASES
from ._claims import OWNER_LABEL, owner_hash, reservation_token

__all__ = [
    "LEASE_VERBS",
    "LEDGER_PREFIX",
    "QUOTA",
    "RESERVATION_SECONDS",
    "ClaimListed",
    "Ledger",
    "QuotaLedger",
    "Reservation",
    "ledger_name",
]

log = logging.getLogger("k8s_agent_sandbox_awx.broker.kubernetes")

QUOTA: Final = "broker.agent-sandbox-awx.io/quota"
"""The ledger's annotation: JSON ``{claim name: reservation deadline, or 0 once made}``."""
LEDGER_PREFIX: Final = "sbx-quota-"
RESERVATION_SECONDS: Final = 15.0
ATTEMPTS: Final = 64
"""Writes a create tries before it gives up (503): each lost one is another's that won."""
MEMO_SIZE: Final = 4096
LEASE_VERBS: Final = ("get", "create", "patch")
"""What the broker does with Leases (its quota ledgers; docs/broker/deploy.md, "RBAC")."""


def ledger_name(owner: Owner) -> str:
    """The Lease of ``owner``'s ledger (in each namespace its claims are in)."""
    return LEDGER_PREFIX + owner_hash(owner)


@dataclass(frozen=True)
class Ledger:
    """A ledger as read (or written): ``version`` ``None`` when there is none yet;
    ``trusted`` ``False`` when its annotation does not parse (it is rebuilt from the claims)."""

    namespace: str
    name: str
    version: str | None
    entries: Mapping[str, float]
    trusted: bool = True


@dataclass(frozen=True)
class Reservation:
    """A slot reserved in a ledger for claim ``claim`` until ``until`` (epoch seconds);
    ``added``: the name was not in the ledger before (a release removes it)."""

    namespace: str
    ledger: str
    claim: str
    until: float
    added: bool
    reservation_seconds: float

    def post_timeout(self) -> float:
        """Seconds left for the claim's POST to be answered (at least 1): two thirds of the
        reservation's time (the rest allows for the replicas' clocks to differ)."""
        deadline = self.until - self.reservation_seconds / 3
        return max(1.0, deadline - time.time())


class ClaimListed(QuotaExceeded):
    """The owner holds the maximum, and a claim of the name to reserve exists already (the
    list shows it, in any phase): it takes no new slot, and a keyed create replays it."""


class Seen(Protocol):
    """What the claim cache saw of the claim made under a reservation."""

    def made(self, namespace: str, name: str, reservation: str) -> bool: ...

    def gone(self, namespace: str, name: str, reservation: str) -> bool: ...


class _Changed(Exception):
    """The ledger changed since it was read (a lost write): read it again, decide again."""


def _parse(obj: Mapping[str, Any], namespace: str, name: str) -> Ledger:
    meta = obj.get("metadata") or {}
    raw = (meta.get("annotations") or {}).get(QUOTA, "{}")
    try:
        entries = json.loads(raw)
        valid = isinstance(entries, dict) and all(
            isinstance(k, str) and isinstance(v, int | float) and math.isfinite(v)
            for k, v in entries.items()
        )
    except ValueError:
        valid = False
    version = str(meta.get("resourceVersion", "")) or None
    if not valid:
        return Ledger(namespace, name, version, {}, trusted=False)
    return Ledger(namespace, name, version, {k: float(v) for k, v in entries.items()})


def _jitter(attempt: int) -> float:
    """Seconds to wait after the ``attempt``-th lost write: random, growing to 0.5 s (the
    losers of one round do not all write again at once)."""
    ceiling_ms = min(500, 10 * (attempt + 1))
    return secrets.randbelow(ceiling_ms + 1) / 1000


def _others(entries: Mapping[str, float], claim: str) -> list[str]:
    return [name for name in entries if name != claim]


class QuotaLedger:
    """The ledgers of the owners, over ``client`` (see the module docstring). ``list_owned``
    lists an owner's claims in a namespace now (the backend's consistent read) as
    ``{name: live}``; ``cache``: the claim cache (what it holds and saw go, by reservation:
    :meth:`._informer.ClaimCache.made` and ``gone``)."""

    def __init__(
        self,
        client: KubeClient,
        list_owned: Callable[[Owner, str], Awaitable[Mapping[str, bool]]],
        cache: Seen,
    ) -> None:
        self.client = client
        self.list_owned = list_owned
        self.cache = cache
        self.reservation_seconds = RESERVATION_SECONDS
        self._memo: LRUCache[tuple[str, str], Ledger] = LRUCache(MEMO_SIZE)
        self._turns: LRUCache[tuple[str, str], asyncio.Lock] = LRUCache(MEMO_SIZE)
        """One reservation at a time per ledger on this replica: a create waits for the one
        before it, then writes on the version that one wrote (no 409 between them). Only
        other replicas' writes conflict; a lock evicted while held costs a conflict, never
        the quota (the writes keep their precondition)."""

    def __repr__(self) -> str:
        return f"QuotaLedger(ledgers={len(self._memo)})"

    async def reserve(self, owner: Owner, namespace: str, claim: str, maximum: int) -> Reservation:
        """A slot for ``claim`` in ``owner``'s ledger; QuotaExceeded when the owner holds
        ``maximum`` others (live, or being created)."""
        name = ledger_name(owner)
        async with self._turn(namespace, name):
            return await self._reserve(owner, namespace, name, claim, maximum)

    def _turn(self, namespace: str, name: str) -> asyncio.Lock:
        turn = self._turns.get((namespace, name))
        if turn is None:
            turn = self._turns[(namespace, name)] = asyncio.Lock()
        return turn

    async def _reserve(
        self, owner: Owner, namespace: str, name: str, claim: str, maximum: int
    ) -> Reservation:
        for attempt in range(ATTEMPTS):
            ledger = self._memo.get((namespace, name)) if attempt == 0 else None
            if ledger is None:
                ledger = await self._read(namespace, name)
            try:
                return await self._decide(owner, ledger, claim, maximum)
            except _Changed:
                await asyncio.sleep(_jitter(attempt))
        raise BackendUnavailable(
            f"the quota ledger {namespace}/{name} changed {ATTEMPTS} times while this create "
            "waited for a decision (many creates at once); retry the create"
        )

    async def _decide(self, owner: Owner, ledger: Ledger, claim: str, maximum: int) -> Reservation:
        entries, listed = dict(ledger.entries), frozenset[str]()
        stale = ledger.version is None or not ledger.trusted
        if stale or len(_others(entries, claim)) >= maximum:
            entries, listed = await self._reconcile(owner, ledger)
        others = _others(entries, claim)
        if len(others) >= maximum:
            if entries != ledger.entries:  # what the list showed, kept for the next create
                await self._write(owner, ledger, entries)
            pending = sum(1 for name in others if entries[name] > 0)
            refusal = ClaimListed if claim in listed else QuotaExceeded
            raise refusal(len(others), maximum, pending=pending)
        until = float(math.ceil(time.time() + self.reservation_seconds))  # stored whole
        added = claim not in entries
        self._mark_made(ledger.namespace, entries)
        entries[claim] = until
        await self._write(owner, ledger, entries)
        return Reservation(
            ledger.namespace, ledger.name, claim, until, added, self.reservation_seconds
        )

    def _mark_made(self, namespace: str, entries: dict[str, float]) -> None:
        """Mark ``0`` the reservations whose claims the claim cache holds (free: on a write
        made anyway)."""
        for name, until in entries.items():
            if until and self.cache.made(namespace, name, reservation_token(until)):
                entries[name] = 0.0

    async def _reconcile(
        self, owner: Owner, ledger: Ledger
    ) -> tuple[dict[str, float], frozenset[str]]:
        """The ledger's entries that still hold, and the live claims it lacks (see the module
        docstring), from a list of the owner's claims begun now; the names listed."""
        listed_at, ns = time.time(), ledger.namespace
        latest = listed_at + 2 * self.reservation_seconds  # later: not the broker's (dropped)
        claims = await self.list_owned(owner, ns)
        kept: dict[str, float] = {}
        for name, until in ledger.entries.items():
            if name in claims:
                if claims[name]:
                    kept[name] = 0.0
            elif listed_at < until <= latest and not self.cache.gone(
                ns, name, reservation_token(until)
            ):
                kept[name] = until  # being created (or made since the list began)
        for name, live in claims.items():
            if live and name not in kept:
                kept[name] = 0.0
        return kept, frozenset(claims)

    async def release(self, reservation: Reservation) -> None:
        """Remove the name ``reservation`` added (its claim was refused: it will not be made);
        a ledger that changed it meanwhile keeps it. A failure is logged: it lapses."""
        if not reservation.added:
            return
        why = f"the ledger changed {ATTEMPTS} times"
        async with self._turn(reservation.namespace, reservation.ledger):
            for _ in range(ATTEMPTS):
                try:
                    if await self._unreserve(reservation):
                        return
                except BackendUnavailable as exc:
                    why = exc.detail
                    break
        left = max(0, round(reservation.until - time.time()))
        log.warning(
            "the reservation of claim %s/%s in quota ledger %s could not be released "
            "(%s): it lapses in %d s",
            reservation.namespace,
            reservation.claim,
            reservation.ledger,
            why,
            left,
        )

    async def _unreserve(self, reservation: Reservation) -> bool:
        """One attempt of :meth:`release`: ``False`` when the ledger changed meanwhile."""
        key = (reservation.namespace, reservation.ledger)
        ledger = self._memo.get(key) or await self._read(*key)
        if ledger.entries.get(reservation.claim) != reservation.until:
            return True  # not ours any more (made since, dropped, or reserved again)
        entries = {k: v for k, v in ledger.entries.items() if k != reservation.claim}
        try:
            await self._write(None, ledger, entries)
        except _Changed:
            return False
        return True

    # ---------------------------------------------------------------------- the Lease

    async def _read(self, namespace: str, name: str) -> Ledger:
        try:
            obj = await self.client.get(LEASES, name, namespace=namespace)
        except NotFound:
            return Ledger(namespace, name, None, {})
        except KubeError as exc:
            raise BackendUnavailable(
                f"the Kubernetes API server did not answer a read of quota ledger "
                f"{namespace}/{name}: {exc}"
            ) from None
        ledger = _parse(obj, namespace, name)
        self._memo[(namespace, name)] = ledger
        return ledger

    async def _write(
        self, owner: Owner | None, ledger: Ledger, entries: Mapping[str, float]
    ) -> None:
        """Write ``entries`` over exactly ``ledger``'s version (create it when it has none);
        _Changed when another write came first."""
        key = (ledger.namespace, ledger.name)
        text = json.dumps({k: round(v) for k, v in entries.items()}, separators=(",", ":"))
        try:
            if ledger.version is None:
                assert owner is not None
                obj = await self.client.create(
                    LEASES, _lease(owner, ledger, text), namespace=ledger.namespace
                )
            else:
                patch = {"metadata": {"annotations": {QUOTA: text}}}
                obj = await self.client.merge_patch(
                    LEASES,
                    ledger.name,
                    patch,
                    namespace=ledger.namespace,
                    resource_version=ledger.version,
                )
        except (Conflict, AlreadyExists, NotFound):
            self._memo.pop(key, None)
            raise _Changed() from None
        except KubeError as exc:
            self._memo.pop(key, None)
            raise BackendUnavailable(
                f"the Kubernetes API server did not answer a write of quota ledger "
                f"{ledger.namespace}/{ledger.name}: {exc}"
            ) from None
        self._memo[key] = _parse(obj, *key)


def _lease(owner: Owner, ledger: Ledger, text: str) -> dict[str, Any]:
    labels = {MANAGED_BY_LABEL: MANAGED_BY, OWNER_LABEL: owner_hash(owner)}
    annotations = {ISSUER: owner.issuer, SUBJECT: owner.subject, QUOTA: text}
    return {
        "metadata": {
            "name": ledger.name,
            "namespace": ledger.namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": {"holderIdentity": MANAGED_BY},
    }
