"""The per-request observing work made cheaper records the same (issue 29): the timestamp is
``datetime``'s text, a made request id is a version-4 UUID's hex, the data-plane headers are
read as starlette reads them, and a metric's series looked up once is the metric's own."""

from __future__ import annotations

import random
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from starlette.datastructures import Headers

from k8s_agent_sandbox_awx.broker.observability._access import _data_headers, new_request_id
from k8s_agent_sandbox_awx.broker.server._logs import timestamp


def _datetime_text(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def test_the_timestamp_is_datetimes_text() -> None:
    now = time.time()
    rng = random.Random(29)
    moments = [now + rng.uniform(-3e7, 3e7) for _ in range(20_000)]
    # where rounding to microseconds carries into the next millisecond or second
    edges = [1e9 + k / 1000 + d for k in range(0, 3000, 7) for d in (0, 5e-4, 9.999995e-4)]
    for at in [*moments, *edges, 0.0, 0.9999996, 1.9999995, 253402300799.999]:
        assert timestamp(at) == _datetime_text(at), at
    assert abs(datetime.fromisoformat(timestamp()).timestamp() - time.time()) < 5


def test_a_made_request_id_is_a_uuid4_hex() -> None:
    made = {new_request_id() for _ in range(5000)}
    assert len(made) == 5000
    for text in made:
        value = uuid.UUID(hex=text)
        assert value.hex == text and value.version == 4 and value.variant == uuid.RFC_4122


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"x-sandbox-id", b"sb-1")],
        [(b"x-sandbox-port", b"8080"), (b"x-sandbox-id", b"sb-1"), (b"x-sandbox-id", b"sb-2")],
        [(b"x-sandbox-port", b"1"), (b"x-sandbox-port", b"2"), (b"X-Sandbox-ID", b"upper")],
        [(b"x-sandbox-id", "s\u00e9".encode("latin-1")), (b"host", b"h")],
    ],
)
def test_the_data_plane_headers_read_as_starlette_reads_them(
    headers: list[tuple[bytes, bytes]],
) -> None:
    scope: dict[str, Any] = {"type": "http", "headers": headers}
    read = Headers(scope={"type": "http", "headers": list(headers)})
    assert _data_headers(scope) == (read.get("x-sandbox-port"), read.get("x-sandbox-id"))


def test_a_series_looked_up_once_is_the_metrics_own() -> None:
    pytest.importorskip("prometheus_client")
    from k8s_agent_sandbox_awx.broker.observability import _metrics

    metrics = _metrics.Metrics()
    children = _metrics._Children()
    first = children(metrics.requests, "/v1/whoami", "GET", "200")
    assert first is metrics.requests.labels("/v1/whoami", "GET", "200")
    assert children(metrics.requests, "/v1/whoami", "GET", "200") is first
    assert children(metrics.endings, "complete") is metrics.endings.labels("complete")
    few = _metrics._Children()
    few_max = _metrics.MAX_CHILDREN
    try:
        _metrics.MAX_CHILDREN = 1  # type: ignore[misc]
        few(metrics.endings, "a")
        few(metrics.endings, "b")
        assert len(few._series) == 1  # bounded; the series is still the metric's
        assert few(metrics.endings, "b") is metrics.endings.labels("b")
    finally:
        _metrics.MAX_CHILDREN = few_max  # type: ignore[misc]
