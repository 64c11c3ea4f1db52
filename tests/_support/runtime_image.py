"""The sandbox runtime started on this host as its image starts it (deploy/runtime/
Containerfile): ``as_the_image_starts`` maps the image's argv, environment and working
directory to a test's places (an interpreter that can import only what the image installs:
``minimal_python``), ``started`` runs it until the block ends (stopped with SIGTERM, as the
kubelet stops it)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import time
import venv
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests._support.deploy import REPO_ROOT, RUNTIME_CONTAINERFILE, Containerfile


def minimal_python(folder: Path) -> Path:
    """The ``python`` of a virtual environment (of this interpreter, without pip) whose
    site-packages holds nothing but our package and python-multipart (links to them): what the
    image installs, importable by an interpreter started isolated (``-I`` reads no
    ``PYTHONPATH``)."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(folder)
    [site] = (folder / "lib").glob("python3*/site-packages")
    (site / "k8s_agent_sandbox_awx").symlink_to(REPO_ROOT / "src" / "k8s_agent_sandbox_awx")
    spec = importlib.util.find_spec("python_multipart")
    assert spec is not None and spec.submodule_search_locations
    (site / "python_multipart").symlink_to(next(iter(spec.submodule_search_locations)))
    return folder / "bin" / "python"


def as_the_image_starts(tmp_path: Path, port: int) -> tuple[list[str], dict[str, str], Path]:
    """argv, environment and working directory of the runtime's image, mapped to the test's
    places: ``python`` -> :func:`minimal_python` (only what the image installs is importable),
    8888 -> ``port``, /app and /workspace -> folders under ``tmp_path`` (``::`` stays: the test
    reaches it on 127.0.0.1)."""
    image = Containerfile(RUNTIME_CONTAINERFILE)
    places = {"/app": tmp_path / "app", "/workspace": tmp_path / "workspace"}
    for folder in places.values():
        folder.mkdir()
    mapped = {"8888": str(port), **{k: str(v) for k, v in places.items()}}
    argv = [mapped.get(a, a) for a in image.exec_form("ENTRYPOINT") + image.exec_form("CMD")]
    assert argv[0] == "python"
    argv[0] = str(minimal_python(tmp_path / "venv"))
    env = {k: mapped.get(v, v) for k, v in image.env().items()}
    env.update(PATH=os.environ.get("PATH", "/usr/bin:/bin"), HOME=str(tmp_path))
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
