"""The ``dev`` / ``demo`` commands (``agent-sandbox-awx dev``, ``agent-sandbox-awx demo``)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.cli import _local
from k8s_agent_sandbox_awx.cli._local import demo_main, dev_main
from k8s_agent_sandbox_awx.testing import BWRAP_ISOLATION_WARNING, NO_ISOLATION_WARNING
from tests._support.isolation import fake_bwrap, need_bwrap


def test_demo_prints_the_answer(capsys: pytest.CaptureFixture[str]) -> None:
    before = dict(os.environ)
    assert demo_main([]) == 0
    captured = capsys.readouterr()
    assert "42" in captured.out.splitlines()
    assert "NO isolation" in captured.err
    assert dict(os.environ) == before


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def _dev(
    tmp_path: Path, *args: str, warning: str = "NO isolation", said: list[str] | None = None
) -> Iterator[tuple[dict[str, str], str]]:
    """Run ``agent-sandbox-awx dev`` with ``args``; yield its exports and the token; Ctrl-C.
    Its stderr must hold ``warning``; ``said``: gets the line after the exports."""
    token_file = tmp_path / "tok" / "token"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from k8s_agent_sandbox_awx.cli._local import dev_main; "
            "sys.exit(dev_main(sys.argv[1:]))",
            "--namespace",
            "team-a",
            "--service-account",
            "dev",
            "--ttl",
            "600",
            "--token-file",
            str(token_file),
            "--state-dir",
            str(tmp_path / "state"),
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell without job control starts background jobs with SIGINT ignored, and Python
        # keeps an inherited SIG_IGN: give the child the default disposition, as a terminal would.
        preexec_fn=_default_sigint,
    )
    token = ""
    try:
        assert proc.stdout is not None
        exports: dict[str, str] = {}
        deadline = time.monotonic() + 30
        while len(exports) < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("export "):
                name, _, value = line[len("export ") :].strip().partition("=")
                exports[name] = value
        assert set(exports) == {
            "AGENT_SANDBOX_BROKER_URL",
            "AGENT_SANDBOX_CA_BUNDLE",
            "AGENT_SANDBOX_TOKEN_FILE",
        }
        token = Path(exports["AGENT_SANDBOX_TOKEN_FILE"]).read_text()
        if said is not None:
            said.append(proc.stdout.readline())
        yield exports, token
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        if said is not None:
            said.append(err)
    assert proc.returncode == 0, err
    assert warning in err
    assert not token or token not in err


def _dev_client(exports: dict[str, str], token: str) -> httpx.Client:
    return httpx.Client(
        base_url=exports["AGENT_SANDBOX_BROKER_URL"],
        verify=ssl.create_default_context(cafile=exports["AGENT_SANDBOX_CA_BUNDLE"]),
        headers={"Authorization": f"Bearer {token}"},
    )


def test_dev_prints_exports_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    with _dev(tmp_path) as (exports, token), _dev_client(exports, token) as http:
        me = http.get("/v1/whoami").json()
        assert me["subject"] == "system:serviceaccount:team-a:dev"
        assert http.post("/rpc", json={"op": "status", "claim_name": "broker-x"}).status_code == 404


def test_dev_serves_only_the_dialects_asked_for(tmp_path: Path) -> None:
    with (
        _dev(tmp_path, "--protocols", "rpc") as (exports, token),
        _dev_client(exports, token) as http,
    ):
        assert http.get("/v1/whoami").status_code == 404
        created = http.post("/rpc", json={"op": "create"})
        assert created.status_code == 200, created.text
        assert created.json()["namespace"] == "team-a"


@pytest.mark.parametrize("value", ["v2", "", "v1,grpc"])
def test_dev_refuses_unknown_protocols(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        dev_main(["--protocols", value])
    assert exc.value.code == 2
    assert "--protocols" in capsys.readouterr().err


def test_cli_demo_console_script() -> None:
    script = Path(sys.executable).with_name("agent-sandbox-awx")
    if not script.exists():  # pragma: no cover - not installed as a console script
        pytest.skip("the agent-sandbox-awx console script is not installed")
    proc = subprocess.run([str(script), "demo"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "42" in proc.stdout.splitlines()


# What [broker] installs and [local] does not, as the modules they import: `demo` and `dev` must
# run without them (the release check's fresh environment has [local] only). PyYAML and
# prometheus-client are in [broker] too, but upstream's client brings them to every install.
_BROKER_ONLY = {"httptools": "httptools"}
_WITH_UPSTREAM = {"pyyaml": "kubernetes", "prometheus-client": "k8s-agent-sandbox"}

_BLOCKED_DEMO = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not installed (a [broker]-only dependency)")
sys.meta_path.insert(0, Refuse())
from k8s_agent_sandbox_awx.cli._cli import main
sys.exit(main(["demo"]))
"""


def _extra(pyproject: dict[str, Any], name: str) -> set[str]:
    specs = pyproject["project"]["optional-dependencies"][name]
    return {re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0].lower() for spec in specs}


def test_demo_runs_with_the_local_extra_alone() -> None:
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert _extra(pyproject, "broker") - _extra(pyproject, "local") == {
        *_BROKER_ONLY,
        *_WITH_UPSTREAM,
    }
    for dist, needed_by in _WITH_UPSTREAM.items():
        assert any(r.lower().startswith(dist) for r in metadata.requires(needed_by) or [])
    code = _BLOCKED_DEMO.format(blocked=set(_BROKER_ONLY.values()))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "42" in proc.stdout.splitlines()


# -- which isolation is in force ---------------------------------------------------------------
def test_dev_and_demo_say_when_sandboxes_are_host_processes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo_main(["--isolation", "none"]) == 0
    out, err = capsys.readouterr()
    assert "42" in out.splitlines()
    assert "sandboxes' isolation none (isolation='none' was asked for)" in out
    assert "WARNING: isolation none (isolation='none' was asked for): sandboxes are host " in err
    assert NO_ISOLATION_WARNING in err and BWRAP_ISOLATION_WARNING not in err
    said: list[str] = []
    with _dev(tmp_path, "--isolation", "none", warning=NO_ISOLATION_WARNING, said=said):
        pass
    assert said[0].startswith("# local broker up in "), said
    assert "sandboxes' isolation none (isolation='none' was asked for)" in said[0]
    assert BWRAP_ISOLATION_WARNING not in said[1]


def test_dev_and_demo_say_when_sandboxes_are_in_bubblewrap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    need_bwrap()
    assert demo_main(["--isolation", "bwrap"]) == 0
    out, err = capsys.readouterr()
    assert "42" in out.splitlines()
    assert "sandboxes' isolation bwrap (bubblewrap " in out
    assert "WARNING: isolation bwrap (bubblewrap " in err and "namespaces of its own" in err
    assert BWRAP_ISOLATION_WARNING in err and NO_ISOLATION_WARNING not in err
    said: list[str] = []
    with (
        _dev(tmp_path, "--isolation", "bwrap", warning=BWRAP_ISOLATION_WARNING, said=said) as (
            exports,
            token,
        ),
        _dev_client(exports, token) as http,
    ):
        created = http.post("/rpc", json={"op": "create"})
        assert created.status_code == 200, created.text
    assert "sandboxes' isolation bwrap (bubblewrap " in said[0], said
    assert NO_ISOLATION_WARNING not in said[1]


def test_dev_and_demo_refuse_bwrap_without_it_naming_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake_bwrap(tmp_path, monkeypatch, None):
        assert demo_main(["--isolation", "bwrap"]) == 1
        err = capsys.readouterr().err
        assert "IsolationUnavailable" in err and "apt-get install bubblewrap" in err
        with pytest.raises(SystemExit) as exited:
            dev_main(["--isolation", "bwrap", "--token-file", str(tmp_path / "token")])
        message = str(exited.value.code)
        assert message.startswith("agent-sandbox-awx dev: isolation='bwrap' needs bubblewrap")
        assert "apt-get install bubblewrap" in message
    with pytest.raises(SystemExit) as refused:
        dev_main(["--isolation", "vm"])
    assert refused.value.code == 2
    assert "--isolation: invalid choice: 'vm'" in capsys.readouterr().err


class _InterruptedBroker:
    """A local broker whose start is over and whose announcement meets a Ctrl-C (as a Ctrl-C
    right after dev printed its exports): deterministic, where a real one is a race."""

    isolation_info = None
    stopped = False
    url = "https://127.0.0.1:9"
    ca_bundle = "/nonexistent/ca.pem"

    def __init__(self, **options: Any) -> None:
        pass

    def start(self) -> _InterruptedBroker:
        return self

    def stop(self) -> None:
        _InterruptedBroker.stopped = True

    def keep_projected_token_rotated(self, *args: Any) -> str:
        raise KeyboardInterrupt


def test_dev_stops_quietly_on_a_ctrl_c_right_after_it_is_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_local, "_import_broker", lambda: _InterruptedBroker)
    try:
        code = dev_main(["--token-file", str(tmp_path / "token")])
    except KeyboardInterrupt:
        pytest.fail("dev let a Ctrl-C right after its exports out as a traceback")
    assert code == 0
    assert _InterruptedBroker.stopped
    assert "# stopping the local broker" in capsys.readouterr().err


def test_dev_mints_a_gitlab_job_token_with_the_claims_given(tmp_path: Path) -> None:
    """Issue 30, item 7: ``dev`` wrote only a Kubernetes token; ``--issuer gitlab --claims``
    makes the token file a GitLab CI job's, to try a CI identity on this machine."""
    said: list[str] = []
    claims = "project_path=team/app,ref=release,environment=staging"
    with (
        _dev(tmp_path, "--issuer", "gitlab", "--claims", claims, said=said) as (exports, token),
        _dev_client(exports, token) as http,
    ):
        me = http.get("/v1/whoami").json()
        assert me["subject"] == "project_path:team/app:ref_type:branch:ref:release", me
        assert me["provider"] == "gitlab", me
        payload = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
        assert (payload["project_path"], payload["environment"]) == ("team/app", "staging")
    assert "as GitLab CI job project_path:team/app:ref_type:branch:ref:release" in said[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--claims", "ref=main"], "--claims is for --issuer gitlab"),
        (["--issuer", "gitlab", "--claims", "ref"], "is not KEY=VALUE"),
        (["--issuer", "gitlab", "--claims", "project_path=solo"], "must be GROUP/PROJECT"),
    ],
)
def test_dev_refuses_bad_claims(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        dev_main(args)
    assert says in capsys.readouterr().err
