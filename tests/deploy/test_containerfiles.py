"""The two Containerfiles (issue 22, "An image definition" and "The sandbox runtime, as an
image for SandboxTemplates"; issue 28: the base a build argument, pins, any uid, dual-stack).

Read as text here (a pinned default base, a numeric non-root user, the wheel CI builds and the
pins, an exec-form entry point that names a command the package has), and the runtime's entry
point is started exactly as its image starts it (its ENTRYPOINT, CMD, ENV and WORKDIR, with the
directories mapped to the test's: a free port for 8888, temporary folders for /app and
/workspace) with nothing importable but the standard library, our package and
python-multipart (what ``pip install --no-deps`` of the wheel plus python-multipart leaves in
the image), then used: health on IPv4 and IPv6, a managed command in /workspace, a file written
and read there, the legacy endpoint. CI also builds both images (.ci/images) and runs them as
real containers (tests/kube/test_images.py and the Kubernetes tests' pods).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests._support.deploy import (
    BROKER_CONTAINERFILE,
    REPO_ROOT,
    RUNTIME_CONTAINERFILE,
    Containerfile,
)
from tests._support.kube import free_ports
from tests._support.runtime_image import as_the_image_starts, started

BASE_IMAGE: Final = re.compile(r"^python:3\.12\.\d+-slim-bookworm$")
DOCUMENTED_SERVE: Final = [
    "agent-sandbox-awx", "broker", "serve", "--config", "/etc/agent-sandbox-broker/broker.toml",
]  # fmt: skip
SECRETISH: Final = re.compile(r"TOKEN|SECRET|PASSWORD|KEY|CREDENTIAL", re.IGNORECASE)


@pytest.mark.parametrize("path", [BROKER_CONTAINERFILE, RUNTIME_CONTAINERFILE],
                         ids=["broker", "runtime"])  # fmt: skip
def test_the_image_is_pinned_non_root_and_built_from_the_ci_wheel(path: Path) -> None:
    """The base is a build argument (CI builds on a Debian base of its own, .ci/images) whose
    default is the published, pinned python image; pip's settings come in at build time only
    (an ARG naming a mounted file, never an index written here); what pip installs is pinned
    by deploy/image-constraints.txt."""
    image = Containerfile(path)
    [base] = image.all("FROM")  # one stage
    assert base == "${BASE}", f"{path}: FROM ${{BASE}} (the base is a build argument)"
    assert image.instructions[0].keyword == "ARG", "ARG BASE comes before FROM"
    default = image.instructions[0].arguments.partition("=")[2]
    assert BASE_IMAGE.match(default), f"{path}: ARG BASE={default}: a python:3.12.N-slim tag"
    assert "@sha256:<" in path.read_text(), f"{path}: keep the digest placeholder comment"
    for setting in ("PIP_CONFIG_FILE", "PIP_NO_INDEX"):  # an offline build: wheels in dist/
        assert setting in image.all("ARG"), f"pip's settings at build time (ARG {setting})"
        assert setting not in image.env(), "the build's pip settings stay out of the image"
    user, _, group = image.last("USER").partition(":")
    assert user.isdigit() and int(user) != 0, f"{path}: USER must be a numeric non-root uid"
    assert group.isdigit()  # group 0 is no privilege (OpenShift runs pods so)
    assert image.all("COPY") == [
        "deploy/image-constraints.txt /tmp/wheels/constraints.txt",
        "dist/ /tmp/wheels/",  # the package's wheel, and any wheels of what it installs
    ]
    assert all("PIP_FIND_LINKS=/tmp/wheels python -m pip install" in i
               for r in image.all("RUN") for i in r.split("&&") if "pip install" in i)  # fmt: skip
    installs = [r for r in image.all("RUN") if "pip install" in r]
    unpinned = [i for i in " ".join(installs).split("&&") if "pip install" in i
                and "--no-deps" not in i and "-c /tmp/wheels/constraints.txt" not in i]  # fmt: skip
    assert not unpinned, f"{path}: every pip install with dependencies is pinned: {unpinned}"
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
        # isolated: no PYTHON* variable, no user site, never the working directory (/app, which
        # callers write) on the import path, even before main()
        "-I",
        "-m",
        "k8s_agent_sandbox_awx.broker.runtime",
    ]
    # every interface, IPv6 and IPv4 (dual-stack)
    assert image.exec_form("CMD") == ["--host", "::", "--port", "8888", "--base-dir", "/app"]
    assert image.env()["SANDBOX_WORKSPACE_DIR"] == "/workspace"
    assert image.last("WORKDIR") == "/app"


# ------------------------------------------------------------------------------ the runtime


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
        if socket.has_ipv6:  # "::" is every interface, IPv6 as well as IPv4
            ipv6 = url.replace("127.0.0.1", "[::1]")
            assert httpx.get(f"{ipv6}/", timeout=5).json()["status"] == "ok"
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


# ------------------------------------------------------------------------------ the pins


def image_pins() -> dict[str, str]:
    """deploy/image-constraints.txt: normalised name -> version."""
    pins: dict[str, str] = {}
    for line in (REPO_ROOT / "deploy" / "image-constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"{line!r}: pin one exact version (name==version)"
            assert "/" not in line and "@" not in line, f"{line!r}: a version, never an address"
            pins[canonicalize_name(name)] = version
    return pins


def test_the_image_pins_are_within_pyprojects_ranges() -> None:
    """Every dependency the images install (the core, the [broker] extra) is pinned, inside
    the range pyproject.toml allows: the images install what the package declares."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    pins = image_pins()
    declared = project["dependencies"] + project["optional-dependencies"]["broker"]
    for requirement in map(Requirement, declared):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement}: not pinned in deploy/image-constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} is outside pyproject.toml's {requirement}"
        )
