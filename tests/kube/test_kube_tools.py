"""Finding etcd and kube-apiserver (tests/_support/kube.py, .ci/kube-tools): the Kubernetes
tests skip locally without them, saying how to build them, and FAIL when CI requires them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests._support.kube import (
    ENV_APISERVER,
    ENV_CACHE,
    ENV_ETCD,
    ENV_REQUIRE,
    REPO_ROOT,
    KubeToolsMissing,
    find_kube_tools,
    kube_required,
)

KUBE_TOOLS = REPO_ROOT / ".ci" / "kube-tools"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kube-tools cache folder, and no binaries named in the environment."""
    monkeypatch.setenv(ENV_CACHE, str(tmp_path))
    monkeypatch.delenv(ENV_ETCD, raising=False)
    monkeypatch.delenv(ENV_APISERVER, raising=False)
    return tmp_path


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def provide(cache: Path) -> tuple[Path, Path]:
    etcd, apiserver = executable(cache / "etcd"), executable(cache / "kube-apiserver")
    (cache / "kube-tools.env").write_text(f"{ENV_ETCD}={etcd}\n{ENV_APISERVER}={apiserver}\n")
    return etcd, apiserver


def test_nothing_built_says_how_to_build(cache: Path) -> None:
    with pytest.raises(KubeToolsMissing, match=r"bash \.ci/kube-tools"):
        find_kube_tools(wait=0)


def test_the_env_file_of_a_finished_build(cache: Path) -> None:
    etcd, apiserver = provide(cache)
    (cache / "kube-tools.status").write_text("ok\n")
    tools = find_kube_tools(wait=0)
    assert (tools.etcd, tools.kube_apiserver) == (etcd, apiserver)


def test_the_environment_wins_and_is_checked(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    provide(cache)
    etcd = executable(cache / "my-etcd")
    monkeypatch.setenv(ENV_ETCD, str(etcd))
    with pytest.raises(KubeToolsMissing, match=f"{ENV_APISERVER} from the environment is None"):
        find_kube_tools(wait=0)
    monkeypatch.setenv(ENV_APISERVER, str(cache / "missing"))
    with pytest.raises(KubeToolsMissing, match="not an executable file"):
        find_kube_tools(wait=0)
    monkeypatch.setenv(ENV_APISERVER, str(executable(cache / "my-apiserver")))
    assert find_kube_tools(wait=0).etcd == etcd


def test_a_failed_background_build_shows_its_log(cache: Path) -> None:
    provide(cache)  # an older build's env file does not hide the failure
    (cache / "kube-tools.status").write_text("failed 2\n")
    (cache / "kube-tools.log").write_text("fetching\nE: Unable to find a source package\n")
    with pytest.raises(KubeToolsMissing, match="failed 2") as missing:
        find_kube_tools(wait=0)
    assert "Unable to find a source package" in str(missing.value)


def test_a_background_build_that_died_is_reported(cache: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    (cache / "kube-tools.status").write_text(f"running {gone.pid}\n")
    with pytest.raises(KubeToolsMissing, match="died without reporting"):
        find_kube_tools(wait=5)


def test_a_running_background_build_is_waited_for(cache: Path) -> None:
    (cache / "kube-tools.status").write_text(f"running {os.getpid()}\n")
    with pytest.raises(KubeToolsMissing, match="still running after 0 s"):
        find_kube_tools(wait=0)

    def finish() -> None:
        time.sleep(1.2)
        provide(cache)
        (cache / "kube-tools.status").write_text("ok\n")

    finisher = threading.Thread(target=finish)
    finisher.start()
    started = time.monotonic()
    assert find_kube_tools(wait=30).etcd == cache / "etcd"
    assert time.monotonic() - started >= 1
    finisher.join()


@pytest.mark.parametrize(
    ("value", "required"), [("1", True), ("yes", True), ("", False), ("0", False)]
)
def test_kube_required(value: str, required: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_REQUIRE, value)
    assert kube_required() is required


def run_a_kube_test(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run one test of tests/kube that needs the API server, with no binaries to be found."""
    environ = {
        k: v for k, v in os.environ.items() if k not in (ENV_ETCD, ENV_APISERVER, ENV_REQUIRE)
    }
    environ.update({ENV_CACHE: str(tmp_path), **env})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         "tests/kube/test_apiserver.py::test_namespace_and_service_account"],
        cwd=REPO_ROOT, env=environ, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.slow
def test_without_binaries_the_kube_tests_skip_locally_and_fail_in_ci(tmp_path: Path) -> None:
    local = run_a_kube_test(tmp_path)
    assert local.returncode == 0, local.stdout + local.stderr
    assert "1 skipped" in local.stdout and "bash .ci/kube-tools" in local.stdout
    ci = run_a_kube_test(tmp_path, **{ENV_REQUIRE: "1"})
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "1 error" in ci.stdout and "skipped" not in ci.stdout
    assert f"{ENV_REQUIRE} is set, and etcd and kube-apiserver are not provided" in ci.stdout


def test_kube_tools_script_refuses_unknown_arguments(tmp_path: Path) -> None:
    env = {**os.environ, ENV_CACHE: str(tmp_path)}
    wrong = subprocess.run(["bash", str(KUBE_TOOLS), "--bogus"], env=env, capture_output=True,
                           text=True, timeout=30)  # fmt: skip
    assert wrong.returncode == 1
    assert "unknown argument '--bogus' (try --help)" in wrong.stderr
    nothing = subprocess.run(["bash", str(KUBE_TOOLS), "--print-env"], env=env,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
    assert nothing.returncode == 1 and nothing.stdout == ""
    usage = subprocess.run(["bash", str(KUBE_TOOLS), "--help"], capture_output=True, text=True,
                           timeout=30)  # fmt: skip
    assert usage.returncode == 0 and "--background" in usage.stdout
