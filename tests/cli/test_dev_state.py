"""Issue 30, item 4: after Ctrl-C on ``agent-sandbox-awx dev`` the exported variables point at
a stopped broker. ``dev`` keeps a state directory (``--state-dir``; its CA, server certificate,
token file and record) and a port (``--port``, else the last start's) so that the exports
survive a restart; ``run`` and ``doctor`` say that the broker from ``dev`` no longer runs, and
how to start it again, instead of the advice for a projected ServiceAccount token or "check
the broker URL". Each test reads what the user sees (the CLI's stderr and stdout)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.cli._cli import main

pytest.importorskip("trustme")

_MAIN = "import sys; from k8s_agent_sandbox_awx.cli._cli import main; sys.exit(main(sys.argv[1:]))"
_STOPPED = "The local broker from `agent-sandbox-awx dev` is no longer running"


@pytest.fixture
def nothing_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    from k8s_agent_sandbox_awx import clear_credential_cache

    for name in [n for n in os.environ if n.startswith("AGENT_SANDBOX_") or n == "BROKER_URL"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AGENT_SANDBOX_DISABLE_PLUGIN_AUTOLOAD", "1")
    clear_credential_cache()


class _Dev:
    """A running ``agent-sandbox-awx dev``: its exports, ``stop()`` (Ctrl-C) and what it said."""

    def __init__(self, proc: subprocess.Popen[str], exports: dict[str, str]) -> None:
        self.proc = proc
        self.exports = exports
        self.err = ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        _, self.err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, self.err


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _MAIN, "dev", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's
    )


@contextlib.contextmanager
def _dev(*args: str) -> Iterator[_Dev]:
    proc = _spawn("--ttl", "600", *args)
    assert proc.stdout is not None
    exports: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(exports) < 3 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("export "):
            name, _, value = line[len("export ") :].strip().partition("=")
            exports[name] = value
    dev = _Dev(proc, exports)
    try:
        assert len(exports) == 3, proc.communicate(timeout=30)
        yield dev
    finally:
        if proc.returncode is None:
            dev.stop()


def _use(monkeypatch: pytest.MonkeyPatch, exports: dict[str, str]) -> None:
    from k8s_agent_sandbox_awx import clear_credential_cache

    for name, value in exports.items():
        monkeypatch.setenv(name, value)
    clear_credential_cache()


def _whoami(exports: dict[str, str]) -> str:
    token = Path(exports["AGENT_SANDBOX_TOKEN_FILE"]).read_text()
    with httpx.Client(
        base_url=exports["AGENT_SANDBOX_BROKER_URL"],
        verify=ssl.create_default_context(cafile=exports["AGENT_SANDBOX_CA_BUNDLE"]),
        headers={"Authorization": f"Bearer {token}"},
    ) as http:
        subject: str = http.get("/v1/whoami").json()["subject"]
        return subject


def test_the_exports_survive_a_restart_of_dev(tmp_path: Path) -> None:
    """Each start of ``dev`` had a new port and CA path; with the state directory the second
    start prints the same lines (the last start's port, the CA and server certificate kept)
    and the first start's exports work against it."""
    state = tmp_path / "state"
    with _dev("--state-dir", str(state)) as first:
        assert _whoami(first.exports) == "system:serviceaccount:default:default"
        ca = Path(first.exports["AGENT_SANDBOX_CA_BUNDLE"]).read_bytes()
    assert first.exports["AGENT_SANDBOX_CA_BUNDLE"] == str(state / "ca.pem")
    assert not Path(first.exports["AGENT_SANDBOX_TOKEN_FILE"]).exists()  # removed at the stop
    with _dev("--state-dir", str(state)) as second:
        assert second.exports == first.exports
        assert Path(second.exports["AGENT_SANDBOX_CA_BUNDLE"]).read_bytes() == ca
        assert _whoami(first.exports) == "system:serviceaccount:default:default"
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in state.iterdir() if p.is_file()}
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert modes["server.pem"] == modes["dev.json"] == 0o600, modes
        token = Path(second.exports["AGENT_SANDBOX_TOKEN_FILE"])
        assert stat.S_IMODE(token.resolve().stat().st_mode) == 0o600
        assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    said = "".join([first.err, second.err])
    assert "PRIVATE KEY" not in said and "BEGIN" not in said


def test_run_and_doctor_after_ctrl_c_on_dev_say_it_stopped(
    nothing_configured: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The token file of a stopped ``dev`` got "does not exist ... Mount a projected
    ServiceAccount token"; now ``run`` and ``doctor`` say that the broker from ``dev`` no
    longer runs and give the command that starts it again with the same exports."""
    state = tmp_path / "state"
    with _dev("--state-dir", str(state)) as dev:
        port = dev.exports["AGENT_SANDBOX_BROKER_URL"].rsplit(":", 1)[1]
    _use(monkeypatch, dev.exports)
    again = f"`agent-sandbox-awx dev --port {port} --state-dir {state}`"
    assert main(["run", "--", "true"]) == 1
    err = capsys.readouterr().err
    assert _STOPPED in err and again in err and "the exported lines stay valid" in err, err
    assert "projected" not in err and "ServiceAccount" not in err, err
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    credentials = next(line for line in out.splitlines() if line.startswith("FAIL  credentials"))
    assert _STOPPED in credentials and again in credentials, out
    reachability = next(line for line in out.splitlines() if "reachability" in line)
    assert _STOPPED in reachability and again in reachability, out
    assert "Check the broker URL" not in out and "Mount a projected" not in out, out


def test_a_refused_connection_to_a_stopped_devs_url_says_it_stopped(
    nothing_configured: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The token may outlive ``dev`` (``--token-file``, or ``dev`` killed): the connection
    refused at its URL said "Check AGENT_SANDBOX_BROKER_URL and that the broker runs"; now
    that the broker from ``dev`` no longer runs, and how to start it again."""
    state = tmp_path / "state"
    with _dev("--state-dir", str(state), "--token-file", str(tmp_path / "tok" / "t")) as dev:
        url = dev.exports["AGENT_SANDBOX_BROKER_URL"]
    assert Path(dev.exports["AGENT_SANDBOX_TOKEN_FILE"]).is_file()  # the user's: kept
    _use(monkeypatch, dev.exports)
    assert main(["run", "--", "true"]) == 1
    err = capsys.readouterr().err
    assert f"Cannot connect to the broker at {url}" in err, err
    assert _STOPPED in err and f"--port {url.rsplit(':', 1)[1]}" in err, err
    assert "Check AGENT_SANDBOX_BROKER_URL" not in err, err
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "PASS  credentials" in out and _STOPPED in out, out
    assert "Start `agent-sandbox-awx dev` again" in out and "Check the broker URL" not in out


def test_the_token_of_a_dev_whose_temporary_directory_is_gone_says_it_stopped(
    nothing_configured: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The exports of a ``dev`` whose token lived in a temporary directory (removed when it
    stopped): no projected ServiceAccount advice, but start it again and export its lines."""
    gone = tmp_path / "agent-sandbox-dev-h5uof7gv" / "agent-sandbox-token"
    monkeypatch.setenv("AGENT_SANDBOX_BROKER_URL", "https://127.0.0.1:9")
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN_FILE", str(gone))
    assert main(["run", "--", "true"]) == 1
    err = capsys.readouterr().err
    assert _STOPPED in err and "(`agent-sandbox-awx dev`) and export the lines it prints" in err
    assert "projected" not in err, err
    other = tmp_path / "elsewhere" / "token"  # any other missing token file: as before
    monkeypatch.setenv("AGENT_SANDBOX_TOKEN_FILE", str(other))
    assert main(["run", "--", "true"]) == 1
    assert "Mount a projected ServiceAccount token" in capsys.readouterr().err


def test_a_second_dev_on_the_same_state_directory_is_refused(tmp_path: Path) -> None:
    """Two ``dev`` on one state directory would overwrite each other's certificate, token and
    record: the second is refused, naming the first's pid and URL, and the fix."""
    state = tmp_path / "state"
    with _dev("--state-dir", str(state)) as first:
        second = _spawn("--state-dir", str(state))
        _, err = second.communicate(timeout=60)
        assert second.returncode == 1, err
        assert f"(pid {first.proc.pid}, at {first.exports['AGENT_SANDBOX_BROKER_URL']})" in err
        assert f"holds the state directory {state}" in err and "--state-dir DIR" in err, err
        assert f"kill -INT {first.proc.pid}" in err and "Traceback" not in err, err
        assert _whoami(first.exports)  # the first one is untouched


def test_dev_on_a_port_in_use_names_port_and_fix(tmp_path: Path) -> None:
    """``dev --port P`` with P taken: a clear error naming ``--port`` and the fix."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = _spawn("--state-dir", str(tmp_path / "state"), "--port", str(port))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert f"--port {port}: 127.0.0.1:{port} is in use" in err, err
    assert "choose another --port" in err and "Traceback" not in err, err


def test_dev_refuses_a_port_out_of_range(tmp_path: Path, capsys: Any) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["dev", "--state-dir", str(tmp_path), "--port", "70000"])
    assert exited.value.code == 2
    assert "--port 70000: give a port from 1 to 65535" in capsys.readouterr().err


def test_the_certificates_are_kept_while_they_fit_and_made_again_otherwise(
    tmp_path: Path,
) -> None:
    from k8s_agent_sandbox_awx.cli._dev_state import certificates

    ca, server = certificates(str(tmp_path), "127.0.0.1")
    first = Path(ca).read_bytes(), Path(server).read_bytes()
    assert stat.S_IMODE(os.stat(server).st_mode) == 0o600
    assert certificates(str(tmp_path), "127.0.0.1") == (ca, server)
    assert (Path(ca).read_bytes(), Path(server).read_bytes()) == first  # kept
    Path(server).write_bytes(first[1][: len(first[1]) // 2])  # a broken file: made again
    certificates(str(tmp_path), "127.0.0.1")
    assert Path(ca).read_bytes() != first[0]
    second = Path(ca).read_bytes()
    certificates(str(tmp_path), "127.0.0.2")  # another host name: made again
    assert Path(ca).read_bytes() != second
    assert stat.S_IMODE(os.stat(server).st_mode) == 0o600


def test_local_broker_listens_on_the_port_and_certificates_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LocalBroker(port=, tls=)``: what ``dev`` builds on; a taken port is a typed
    ``OSError`` naming it, and leaves no temporary directory behind."""
    import errno
    import glob
    import tempfile

    from k8s_agent_sandbox_awx.cli._dev_state import certificates
    from k8s_agent_sandbox_awx.testing import LocalBroker
    from k8s_agent_sandbox_awx.testing._broker_setup import PortInUseError

    tls = certificates(str(tmp_path), "127.0.0.1")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with LocalBroker(warn=False, port=port, tls=tls) as broker:
        assert broker.url == f"https://127.0.0.1:{port}" and broker.ca_bundle == tls[0]
        healthz = httpx.get(
            broker.url + "/v1/healthz", verify=ssl.create_default_context(cafile=tls[0])
        )
        assert healthz.status_code == 200
        (tmp_path / "temp").mkdir()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))  # this start's alone
        with pytest.raises(PortInUseError) as taken:
            LocalBroker(warn=False, port=port).start()
        assert taken.value.errno == errno.EADDRINUSE and f"port={port}" in str(taken.value)
        assert not glob.glob(str(tmp_path / "temp" / "agent-sandbox-broker-*"))
    for bad in ({"port": -1}, {"port": True}, {"tls": ("ca.pem",)}, {"tls": "ca.pem"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LocalBroker(**bad)  # type: ignore[arg-type]


@pytest.mark.skipif(os.getuid() != 0, reason="making a directory another user's takes root")
def test_dev_refuses_a_state_directory_of_another_user(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(SystemExit) as refused:
        main(["dev", "--state-dir", str(theirs)])
    assert f"the state directory {theirs} belongs to another user" in str(refused.value.code)
    assert not (theirs / "dev.lock").exists()


def test_dev_moves_off_the_last_port_when_another_program_took_it(tmp_path: Path) -> None:
    """Without ``--port``, the last start's port when free; when another program took it
    since, a free one, said on stderr (the exports changed)."""
    state = tmp_path / "state"
    with _dev("--state-dir", str(state)) as first:
        port = int(first.exports["AGENT_SANDBOX_BROKER_URL"].rsplit(":", 1)[1])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        with _dev("--state-dir", str(state)) as second:
            assert second.exports["AGENT_SANDBOX_BROKER_URL"] != f"https://127.0.0.1:{port}"
            assert second.exports["AGENT_SANDBOX_CA_BUNDLE"] == str(state / "ca.pem")
    assert f"the port of the last start here, {port}, is taken" in second.err, second.err
