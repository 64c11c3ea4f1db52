"""Retry decisions, without any I/O: the one :class:`RetryPolicy` (the exchange asks it, the
transports perform what it says)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

from ..wire._protocol import RequestSpec

__all__ = ["RETRYABLE_STATUSES", "RetryPolicy", "SingleAttempt", "parse_retry_after"]

RETRYABLE_STATUSES = frozenset({502, 503, 504})


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """``Retry-After`` as seconds (delta-seconds or HTTP date); ``None`` if absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # isdigit() alone: also "²" and other digits
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    now = now or datetime.now(UTC)
    return max(0.0, (when - now).total_seconds())


@dataclass(frozen=True)
class RetryPolicy:
    """Every decision to send a request again, in one place.

    Only idempotent requests (``spec.retryable``: GET, DELETE, create with its key, a
    replayable upload) are retried, with bounded exponential backoff and full jitter
    (``Retry-After`` honoured up to the cap); a mutating request is never sent again after it may
    have been sent, and a read timeout is never retried (the server had the request).
    """

    max_attempts: int = 4
    backoff_base: float = 0.2
    backoff_max: float = 10.0
    rand: Callable[[float, float], float] = field(default=random.uniform, repr=False)

    def backoff(self, attempt: int) -> float:
        """Delay before attempt ``attempt + 1`` (``attempt`` counts from 1)."""
        ceiling = min(self.backoff_max, self.backoff_base * (2 ** (attempt - 1)))
        return self.rand(0.0, ceiling)

    def after_status(
        self,
        spec: RequestSpec,
        attempt: int,
        status: int,
        headers: Mapping[str, str],
        now: datetime | None = None,
    ) -> float | None:
        """Seconds to wait before retrying after ``status``, or ``None``: do not retry."""
        if not spec.retryable or attempt >= self.max_attempts:
            return None
        retry_after = parse_retry_after(headers.get("retry-after"), now)
        if status == 429:
            if retry_after is None:  # quota_exceeded: retrying cannot help
                return None
        elif status not in RETRYABLE_STATUSES:
            return None
        if retry_after is not None:
            return min(self.backoff_max, retry_after)
        return self.backoff(attempt)

    def after_transport_error(
        self,
        spec: RequestSpec,
        attempt: int,
        *,
        request_sent: bool,
        timed_out: bool = False,
        permanent: bool = False,
    ) -> float | None:
        """Seconds to wait before retrying after a connection error, or ``None``.

        ``request_sent``: the request may have reached the server. A read timeout of a sent
        request is never retried; a non-idempotent request (``POST /execute``) never is; a
        ``permanent`` failure (a certificate that does not verify) never is."""
        if permanent or not spec.retryable or attempt >= self.max_attempts:
            return None
        if timed_out and request_sent:
            return None
        return self.backoff(attempt)

    @staticmethod
    def after_unauthorized(*, retried: bool, replayable: bool) -> bool:
        """Whether to re-read the credential and send once more after the broker's 401."""
        return not retried and replayable


@dataclass(frozen=True)
class SingleAttempt(RetryPolicy):
    """One attempt, never repeated, not even after the broker's 401 (whose credential is still
    invalidated): the activity keepalive's extension, best effort."""

    max_attempts: int = 1

    @staticmethod
    def after_unauthorized(*, retried: bool, replayable: bool) -> bool:
        return False
