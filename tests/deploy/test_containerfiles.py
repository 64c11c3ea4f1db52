"""The two Containerfiles (issue 22, "An image definition" and "The sandbox runtime, as an
image for SandboxTemplates").

No container engine runs on our CI machines, so the images are never built here. What is
checked instead: each Containerfile is read (a pinned base, a numeric non-root user, the wheel
CI builds, an exec-form entry point that names a command the package has), and the runtime's
entry point is started exactly as its image starts it (its ENTRYPOINT, CMD, ENV and WORKDIR,
with the addresses and directories mapped to the test's: 127.0.0.1 for 0.0.0.0, a free port
for 8888, temporary folders for /app and /workspace) with nothing importable but the standard
library, our package and python-multipart (what ``pip install --no-deps`` of the wheel plus
python-multipart leaves in the image), then used: health, a managed command in /workspace,
a file written and read there, the legacy endpoint.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import pytest

from tests._support.deploy import (
    BROKER_CONTAINERFILE,
    REPO_ROOT,
    RUNTIME_CONTAINERFILE,
    Containerfile,
)
from tests._support.kube import free_ports

BASE_IMAGE: Final = re.compile(r"^python:3\.12\.\d+-slim-bookworm$")
DOCUMENTED_SERVE: Final = [
    "agent-sandbox-awx", "broker", "serve", "--config", "/etc/agent-sandbox-broker/broker.toml",
]  # fmt: skip
SECRETISH: Final = re.compile(r"TOKEN|SECRET|PASSWORD|KEY|CREDENTIAL", re.IGNORECASE)


@pytest.mark.parametrize("path", [BROKER_CONTAINERFILE, RUNTIME_CONTAINERFILE],
                         ids=["broker", "runtime"])  # fmt: skip
def test_the_image_is_pinned_non_root_and_built_from_the_ci_wheel(path: Path) -> None:
    image = Containerfile(path)
    [base] = image.all("FROM")  # one stage
    assert BASE_IMAGE.match(base), f"{path}: FROM {base}: pin a python:3.12.N-slim-bookworm tag"
    assert "@sha256:<" in path.read_text(), f"{path}: keep the digest placeholder comment"
    user, _, group = image.last("USER").partition(":")
    assert user.isdigit() and int(user) != 0, f"{path}: USER must be a numeric non-root uid"
    assert group.isdigit() and int(group) != 0
    assert image.last("COPY") == "dist/k8s_agent_sandbox_awx-*.whl /tmp/wheels/"
    assert any(f"--uid {user}" in run for run in image.all("RUN"))  # a passwd entry for it
    assert not [k for k in image.env() if SECRETISH.search(k)], "an image holds no credential"
    assert image.instructions[-1].keyword in ("ENTRYPOINT", "CMD")
    # USER comes after every RUN: nothing the image runs at start runs as root
    keywords = [i.keyword for i in image.instructions]
    assert max(i for i, k in enumerate(keywords) if k == "RUN") < keywords.index("USER")


def test_the_broker_image_installs_the_broker_extra_and_serves_the_mounted_config() -> None:
    image = Containerfile(BROKER_CONTAINERFILE)
    [install] = image.all("RUN")
    assert "k8s_agent_sandbox_awx-*.whl)[broker]" in install
    assert image.exec_form("ENTRYPOINT") == DOCUMENTED_SERVE
    assert image.all("CMD") == []


def test_the_broker_entry_point_is_the_documented_command() -> None:
    """The command of docs/broker/deploy.md and of the design of issue 21 (``broker serve
    --config FILE``). The console script is ours (pyproject.toml)."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert 'agent-sandbox-awx = "k8s_agent_sandbox_awx.cli._cli:main"' in pyproject
    assert " ".join(DOCUMENTED_SERVE) in (REPO_ROOT / "docs/broker/deploy.md").read_text()


def test_the_cli_parses_the_brokers_entry_point() -> None:
    """``agent-sandbox-awx broker serve --config FILE`` is a command of the CLI (it lands with
    the broker's server, issue 21: skipped until then)."""
    main = "import sys; from k8s_agent_sandbox_awx.cli._cli import main; sys.exit(main())"
    done = subprocess.run(
        [sys.executable, "-c", main, *DOCUMENTED_SERVE[1:3], "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if "invalid choice: 'broker'" in done.stderr:
        pytest.skip("the CLI has no `broker` command on this branch yet (issue 21's server)")
    assert done.returncode == 0, done.stderr
    assert DOCUMENTED_SERVE[3] in done.stdout


def test_the_runtime_image_holds_only_the_runtime() -> None:
    image = Containerfile(RUNTIME_CONTAINERFILE)
    install = " ".join(image.all("RUN"))
    assert "--no-deps /tmp/wheels/k8s_agent_sandbox_awx-*.whl" in install
    assert "python-multipart" in install
    assert image.exec_form("ENTRYPOINT") == [
        "python",
        "-P",  # /app is written by callers: never on the import path, even before main()
        "-m",
        "k8s_agent_sandbox_awx.broker.runtime",
    ]
    assert image.exec_form("CMD") == ["--host", "0.0.0.0", "--port", "8888", "--base-dir", "/app"]
    assert image.env()["SANDBOX_WORKSPACE_DIR"] == "/workspace"
    assert image.last("WORKDIR") == "/app"


# ------------------------------------------------------------------------------ the runtime


def minimal_site(folder: Path) -> Path:
    """A folder with nothing but our package and python-multipart (links to them)."""
    folder.mkdir()
    (folder / "k8s_agent_sandbox_awx").symlink_to(REPO_ROOT / "src" / "k8s_agent_sandbox_awx")
    spec = importlib.util.find_spec("python_multipart")
    assert spec is not None and spec.submodule_search_locations
    (folder / "python_multipart").symlink_to(next(iter(spec.submodule_search_locations)))
    return folder


def as_the_image_starts(tmp_path: Path, port: int) -> tuple[list[str], dict[str, str], Path]:
    """argv, environment and working directory of the runtime's image, mapped to the test's
    places: ``python`` -> this interpreter with ``-S`` (no site-packages: only the minimal
    site is importable), 0.0.0.0 -> 127.0.0.1, 8888 -> ``port``, /app and /workspace ->
    folders under ``tmp_path``."""
    image = Containerfile(RUNTIME_CONTAINERFILE)
    places = {"/app": tmp_path / "app", "/workspace": tmp_path / "workspace"}
    for folder in places.values():
        folder.mkdir()
    mapped = {"0.0.0.0": "127.0.0.1", "8888": str(port), **{k: str(v) for k, v in places.items()}}
    argv = [mapped.get(a, a) for a in image.exec_form("ENTRYPOINT") + image.exec_form("CMD")]
    assert argv[0] == "python"
    argv[:1] = [sys.executable, "-S"]
    env = {k: mapped.get(v, v) for k, v in image.env().items()}
    env.update(PATH=os.environ.get("PATH", "/usr/bin:/bin"), HOME=str(tmp_path),
               PYTHONPATH=str(minimal_site(tmp_path / "site")))  # fmt: skip
    return argv, env, places[image.last("WORKDIR")]


@contextlib.contextmanager
def started(argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> Iterator[str]:
    with log.open("wb") as out:
        process = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, f"the runtime exited: {log.read_text()}"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"the runtime did not answer: {log.read_text()}"
            time.sleep(0.05)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)  # as the kubelet stops it
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
            raise AssertionError("the runtime ignored SIGTERM") from None
    assert process.returncode is not None


def events(client: httpx.Client, command_id: str) -> list[dict[str, Any]]:
    with client.stream("GET", f"/commands/{command_id}/events", params={"after": 0}) as answer:
        assert answer.status_code == 200
        return [json.loads(line) for line in answer.iter_lines() if line.strip()]


def test_the_runtime_runs_standalone_as_its_image_starts_it(tmp_path: Path) -> None:
    argv, env, cwd = as_the_image_starts(tmp_path, free_ports(1)[0])
    workspace = Path(env["SANDBOX_WORKSPACE_DIR"])
    with (
        started(argv, env, cwd, tmp_path / "runtime.log") as url,
        httpx.Client(base_url=url, timeout=30) as client,
    ):
        assert client.get("/").json()["status"] == "ok"
        start = client.post("/commands", json={
            "command": ["sh", "-c", "printf made > made-by-command.txt; echo done"],
            "cwd": "/workspace",
        })  # fmt: skip
        assert start.status_code == 200, start.text
        seen = events(client, start.json()["command_id"])
        assert [e["data"] for e in seen if e["type"] == "stdout"] == ["done\n"]
        assert seen[-1]["type"] == "exit" and seen[-1]["exit_code"] == 0, seen[-1]
        made = client.get("/fs/read", params={"path": "/workspace/made-by-command.txt"})
        assert made.status_code == 200 and made.content == b"made"
        written = client.post(
            "/fs/write",
            data={"path": "/workspace/notes/hello.txt"},
            files={"file": ("hello.txt", b"hello from the test")},
        )
        assert written.status_code == 200, written.text  # python-multipart is importable
        read = client.get("/fs/read", params={"path": "/workspace/notes/hello.txt"})
        assert read.content == b"hello from the test"
        legacy = client.post("/execute", json={"command": "pwd"}).json()
        assert legacy["exit_code"] == 0
    assert (workspace / "notes" / "hello.txt").read_bytes() == b"hello from the test"
    assert (workspace / "made-by-command.txt").read_bytes() == b"made"
    assert legacy["stdout"].strip() == os.path.realpath(cwd)  # the base directory: /app


def test_the_runtime_needs_nothing_but_our_package_and_python_multipart(tmp_path: Path) -> None:
    """The check above cannot pass by luck: with ``-S`` and the minimal site, a module of the
    client's dependencies is not importable (an image with ``--no-deps`` has none of them)."""
    argv, env, cwd = as_the_image_starts(tmp_path, free_ports(1)[0])
    probe = subprocess.run(
        [argv[0], "-S", "-c", "import httpx"], env=env, cwd=cwd, capture_output=True, text=True
    )
    assert probe.returncode != 0 and "No module named 'httpx'" in probe.stderr
