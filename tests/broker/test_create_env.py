"""A create's ``env``: the caller's variables are the environment of the commands the sandbox
runs, never the runtime's own.

The runtime serves the file API to callers granted only the ``files`` scope. Had it the
caller's variables in its own environment, ``PYTHONPATH=/workspace`` plus an uploaded
``/workspace/ctypes.py`` would run the caller's code in it on its next lazy import (``python
-P`` still honours ``PYTHONPATH``), and ``LD_PRELOAD`` or ``LD_LIBRARY_PATH`` act before any
interpreter flag does: commands without the ``commands`` scope. So the runtime process starts
without them (the local backend's: built-in or a template's command, isolated or not) and the
broker hands them to it with each command start, for the commands it starts (managed commands,
terminals, the legacy ``/execute``).

Real HTTPS, real tokens, httpx. The isolated half needs a working ``bwrap`` (skipped where it
cannot run, failed with ``AGENT_SANDBOX_REQUIRE_BWRAP=1``, as CI sets it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from k8s_agent_sandbox_awx.broker.runtime import _env as runtime_env
from k8s_agent_sandbox_awx.client.wire import _dialect_v1 as client_v1
from k8s_agent_sandbox_awx.testing import (
    LocalBroker,
    LocalProcessLauncher,
    SandboxSpec,
)
from tests._support.isolation import need_bwrap
from tests._support.planted import PLANTED, RUNTIME_TEMPLATES, scoped_broker

CALLER = {
    "PYTHONPATH": "/workspace",
    "PYTHONSTARTUP": "/workspace/ctypes.py",
    "LD_LIBRARY_PATH": "/workspace",
    "AWX_CALLER_MARKER": "from the create",
}


@pytest.fixture(scope="module", params=["bwrap", "none"])
def isolation(request: pytest.FixtureRequest) -> str:
    if request.param == "bwrap":
        need_bwrap()
    mode: str = request.param
    return mode


@pytest.fixture(scope="module")
def files_only(isolation: str) -> Iterator[LocalBroker]:
    with scoped_broker(isolation, ("files",)) as broker:
        yield broker


@pytest.fixture(scope="module")
def full(isolation: str) -> Iterator[LocalBroker]:
    with scoped_broker(isolation, ("commands", "files")) as broker:
        yield broker


def _workspace(client: Any, sandbox: dict[str, Any]) -> str:
    """Where ``/workspace`` is for the sandbox's runtime (the host path without isolation)."""
    if client.broker.isolation == "bwrap":
        return "/workspace"
    store = client.broker._require_store()
    handle = store.sandboxes[sandbox["name"]].handle
    return f"{handle.root}/workspace"


def _plant(client: Any, sandbox: dict[str, Any]) -> None:
    """Plant ``ctypes.py`` in the sandbox's /workspace (the ``files`` scope suffices)."""
    written = client.http.post(
        "/fs/write",
        data={"path": "/workspace/ctypes.py"},
        files={"file": ("f", PLANTED.encode())},
        headers=client.data_headers(sandbox),
    )
    assert written.status_code == 200, written.text


def _trigger(client: Any, sandbox: dict[str, Any], planted_in: dict[str, Any]) -> bool:
    """Make ``sandbox``'s runtime look for ``ctypes`` (a no-replace move) and say whether the
    code planted in ``planted_in`` ran (its ``PWNED``)."""
    headers = client.data_headers(sandbox)
    written = client.http.post(
        "/fs/write", data={"path": "renameat.txt"}, files={"file": ("f", b"x")}, headers=headers
    )
    assert written.status_code == 200, written.text
    moved = client.http.post(
        "/fs/move",
        json={"source": "renameat.txt", "destination": "moved.txt", "overwrite": False},
        headers=headers,
    )
    assert moved.status_code in (200, 400), moved.text
    exists = client.http.get(
        "/fs/exists", params={"path": "/workspace/PWNED"}, headers=client.data_headers(planted_in)
    )
    assert exists.status_code == 200, exists.text
    ran: bool = exists.json()["exists"]
    return ran


@pytest.mark.parametrize("template", ["python", "module"])
def test_a_files_only_caller_cannot_run_code_in_the_runtime_through_env(
    files_only: LocalBroker, api: Callable[..., Any], template: str
) -> None:
    """Isolated, the workspace is ``/workspace`` in every sandbox; as host processes, a
    directory of the host's (``planted_in``'s, which a caller who learnt it names)."""
    client = api(files_only.issue_kubernetes_token("team-a", "files-only"), files_only)
    planted_in = client.ready(template=template)
    workspace = _workspace(client, planted_in)
    env = {"PYTHONPATH": workspace, "PYTHONSTARTUP": f"{workspace}/ctypes.py"}
    sandbox = client.ready(template=template, env=env)
    if workspace == "/workspace":  # isolated: the sandbox's own
        planted_in = sandbox
    _plant(client, planted_in)
    assert not _trigger(client, sandbox, planted_in)


def _command_env(client: Any, sandbox: dict[str, Any], argv: list[str], **body: Any) -> str:
    """A managed command's stdout (run to its end)."""
    headers = client.data_headers(sandbox)
    started = client.http.post(
        "/commands",
        json={"command": argv, "request_id": str(uuid.uuid4()), **body},
        headers=headers,
    )
    assert started.status_code == 200, started.text
    command_id = started.json()["command_id"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        status = client.http.get(f"/commands/{command_id}", headers=headers).json()
        if status["state"] != "running":
            assert status["exit_code"] == 0, status
            out: str = status["stdout"]
            return out
        time.sleep(0.02)
    raise AssertionError(f"command {argv} did not end")


SHOW = (
    'echo "command: $AWX_CALLER_MARKER|$PYTHONPATH|$LD_LIBRARY_PATH"; '
    'tr "\\0" "\\n" < /proc/$PPID/environ | grep -c -e ^AWX_CALLER_MARKER= -e ^PYTHONPATH= '
    "-e ^PYTHONSTARTUP= -e ^LD_LIBRARY_PATH= || true"
)
"""What a command sees of the create's env, and how many of its variables the environment of
its parent, the runtime, holds (``sh``'s parent: the runtime started it)."""
EXPECTED = "command: from the create|/workspace|/workspace\n0\n"


@pytest.mark.parametrize("template", ["python", "module"])
def test_the_commands_get_the_env_and_the_runtime_never_holds_it(
    full: LocalBroker, api: Callable[..., Any], template: str
) -> None:
    client = api(full.issue_kubernetes_token("team-a", "alice"), full)
    sandbox = client.ready(template=template, env=CALLER)
    headers = client.data_headers(sandbox)
    legacy = client.http.post(
        "/execute", json={"command": f"sh -c '{SHOW}'"}, headers=headers
    ).json()
    assert (legacy["stdout"], legacy["exit_code"]) == (EXPECTED, 0), legacy
    assert _command_env(client, sandbox, ["sh", "-c", SHOW]) == EXPECTED
    on_a_terminal = _command_env(client, sandbox, ["sh", "-c", SHOW], pty={"cols": 80})
    assert on_a_terminal.replace("\r\n", "\n") == EXPECTED
    # a command's own envs still win over the sandbox's
    mine = _command_env(
        client, sandbox, ["sh", "-c", "echo $AWX_CALLER_MARKER"], envs={"AWX_CALLER_MARKER": "x"}
    )
    assert mine == "x\n"


@pytest.mark.parametrize("isolation", ["none", "bwrap"])
@pytest.mark.parametrize("command", [None, RUNTIME_TEMPLATES["module"]])
def test_no_runtime_is_started_with_the_callers_variables(
    tmp_path: Path, isolation: str, command: str | None
) -> None:
    """What the fork server is asked to start (a forked runtime, whose environment /proc does
    not show, included): the caller's variables are not in it, the runtime's own settings are;
    an isolated built-in runtime is an isolated interpreter (``-I``)."""
    if isolation == "bwrap":
        need_bwrap()
    backend = LocalProcessLauncher(command, root_dir=str(tmp_path / "r"), isolation=isolation)
    settings = {"SANDBOX_COMMAND_MAX_RUNNING": "3", "SANDBOX_FS_READ_MAX_BYTES": "10"}
    spec = SandboxSpec("sbx-a", "team-a", "python", env={**CALLER, **settings})
    plan = backend._plan(spec, str(tmp_path / "r" / "sbx-a"))
    request = backend._spawn_request(spec, plan, 0)
    assert not set(CALLER) & set(request["env"]), request["env"]
    assert {k: request["env"][k] for k in settings} == settings
    if isolation == "bwrap" and command is None:
        assert request["argv"][request["argv"].index("--") + 2] == "-I", request["argv"]


def test_an_env_over_its_limit_is_refused_at_create_by_the_broker_and_the_sdk(alice: Any) -> None:
    """The environment travels to the runtime in one header with each command start (a
    router reads at most 16 KiB of request head): at most ``MAX_ENV_BYTES`` of JSON, refused
    at create (the broker's 400, the SDK's ValueError before anything is sent), never a
    command start that a router refuses later; neither message holds a value."""
    assert client_v1.MAX_ENV_BYTES == runtime_env.MAX_ENV_BYTES
    secret = "s3cr3t-" + "x" * runtime_env.MAX_ENV_BYTES
    refused = alice.create(env={"BIG": secret})
    assert refused.status_code == 400, refused.text
    assert str(runtime_env.MAX_ENV_BYTES) in refused.text and "s3cr3t" not in refused.text
    with pytest.raises(ValueError, match=str(client_v1.MAX_ENV_BYTES)) as info:
        client_v1.create(idempotency_key="k", env={"BIG": secret})
    assert "s3cr3t" not in str(info.value)
    nul = alice.create(env={"A": "a\0b"})
    assert nul.status_code == 400 and "NUL" in nul.text, nul.text
    # just under the limit: created, and its commands get it
    fits = {"FITS": "y" * (runtime_env.MAX_ENV_BYTES - len('{"FITS":""}'))}
    assert runtime_env.json_size(fits) == runtime_env.MAX_ENV_BYTES
    sandbox = alice.ready(env=fits)
    out = alice.run(sandbox, "sh -c 'echo ${#FITS}'").json()
    assert out["stdout"] == f"{len(fits['FITS'])}\n", out


def test_a_malformed_sandbox_environment_header_is_a_400_of_the_runtime() -> None:
    """Only the broker sends the header; one that is not base64url of an object of strings is
    refused, naming it, and nothing runs."""
    for bad in ("%%%", runtime_env.encode({"A": "b"})[:-2] + "!!", "WzFd"):  # "[1]"
        with pytest.raises(ValueError, match=runtime_env.HEADER):
            runtime_env.decode(bad)
    assert runtime_env.decode(runtime_env.encode({"A": "é b"})) == {"A": "é b"}


def test_the_runtime_image_starts_an_isolated_interpreter(tmp_path: Path) -> None:
    """The runtime's image (deploy/runtime/Containerfile) starts ``python -I``: were a
    ``PYTHONPATH`` ever in the pod's environment (a template's), a module planted there is
    never what the runtime imports."""
    import httpx

    from tests._support.kube import free_ports
    from tests._support.runtime_image import as_the_image_starts, started

    argv, env, cwd = as_the_image_starts(tmp_path, free_ports(1)[0])
    planted = tmp_path / "planted"
    planted.mkdir()
    workspace = env["SANDBOX_WORKSPACE_DIR"]
    (planted / "ctypes.py").write_text(
        f"open({str(Path(workspace) / 'PWNED')!r}, 'w').write('x')\nraise OSError('planted')\n"
    )
    env.update(PYTHONPATH=str(planted), PYTHONSTARTUP=str(planted / "ctypes.py"))
    with started(argv, env, cwd, tmp_path / "runtime.log") as url, httpx.Client(base_url=url) as c:
        written = c.post("/fs/write", data={"path": "r.txt"}, files={"file": ("f", b"x")})
        assert written.status_code == 200, written.text
        moved = c.post(
            "/fs/move", json={"source": "r.txt", "destination": "m.txt", "overwrite": False}
        )
        assert moved.status_code in (200, 400), moved.text
    assert not (Path(workspace) / "PWNED").exists()
