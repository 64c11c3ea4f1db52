"""The local runtime's import path holds no caller's file: a caller granted only the
``files`` scope writes Python files into ``/app``, the runtime's working directory. A runtime
whose import path holds its working directory (``''`` for ``python -c``, the directory itself
for ``python -m``) would import them on its next lazy import (``ctypes`` on the first no-replace
move), and run the caller's code: commands without the ``commands`` scope. Isolated (bubblewrap)
and not."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker
from tests._support.isolation import need_bwrap
from tests._support.planted import PLANTED, scoped_broker


@pytest.fixture(scope="module")
def isolated() -> Iterator[LocalBroker]:
    need_bwrap()
    with scoped_broker("bwrap", ("files",)) as broker:
        yield broker


@pytest.fixture(scope="module")
def host() -> Iterator[LocalBroker]:
    with scoped_broker("none", ("files",)) as broker:
        yield broker


def _plant_and_trigger(client: Any, sandbox: dict[str, Any]) -> bool:
    """Plant ``ctypes.py`` (and a package of that name) in /app, make the runtime look for
    ``ctypes`` (a no-replace move), and say whether the planted code ran."""
    headers = client.data_headers(sandbox)
    for path in ("ctypes.py", "renameat.txt"):
        body = PLANTED.encode() if path.endswith(".py") else b"x"
        written = client.http.post(
            "/fs/write", data={"path": path}, files={"file": ("f", body)}, headers=headers
        )
        assert written.status_code == 200, written.text
    moved = client.http.post(
        "/fs/move",
        json={"source": "renameat.txt", "destination": "moved.txt", "overwrite": False},
        headers=headers,
    )
    assert moved.status_code in (200, 400), moved.text
    exists = client.http.get("/fs/exists", params={"path": "/workspace/PWNED"}, headers=headers)
    assert exists.status_code == 200, exists.text
    ran: bool = exists.json()["exists"]
    return ran


@pytest.mark.parametrize("template", ["python", "module"])
def test_an_isolated_runtime_never_imports_from_app(
    isolated: LocalBroker, api: Callable[..., Any], template: str
) -> None:
    client = api(isolated.issue_kubernetes_token("team-a", "files-only"), isolated)
    sandbox = client.ready(template=template)
    assert not _plant_and_trigger(client, sandbox)


@pytest.mark.parametrize("template", ["python", "module"])
def test_a_host_runtime_never_imports_from_its_base_directory(
    host: LocalBroker, api: Callable[..., Any], template: str
) -> None:
    client = api(host.issue_kubernetes_token("team-a", "files-only"), host)
    sandbox = client.ready(template=template)
    assert not _plant_and_trigger(client, sandbox)


def test_the_runtime_as_its_image_starts_it_never_imports_from_app(tmp_path: Any) -> None:
    """The deployed runtime (deploy/runtime/Containerfile: ``python -m ...`` from WORKDIR /app,
    the base directory): a file written through the file API is never imported."""
    import httpx

    from tests._support.kube import free_ports
    from tests._support.runtime_image import as_the_image_starts, started

    argv, env, cwd = as_the_image_starts(tmp_path, free_ports(1)[0])
    with started(argv, env, cwd, tmp_path / "runtime.log") as url, httpx.Client(base_url=url) as c:
        workspace = env["SANDBOX_WORKSPACE_DIR"]
        planted = PLANTED.replace("os.environ.get('SANDBOX_WORKSPACE_DIR', '.')", repr(workspace))
        for path, body in (("ctypes.py", planted.encode()), ("renameat.txt", b"x")):
            written = c.post("/fs/write", data={"path": path}, files={"file": ("f", body)})
            assert written.status_code == 200, written.text
        moved = c.post(
            "/fs/move", json={"source": "renameat.txt", "destination": "m.txt", "overwrite": False}
        )
        assert moved.status_code in (200, 400), moved.text
    assert not (Path(workspace) / "PWNED").exists()
