"""``run_code`` on the local runtime, through the broker (real HTTPS, real tokens, httpx): the
``/code`` API of docs/broker-api.md ("Code").

State kept between executions, results (the display protocol, the last expression, display()),
errors as results, live output, contexts (independent, cwd, envs, list, restart, remove, the
bound), a busy context, time limits (SIGINT, then a restart), an interpreter killed from
outside (during an execution and between two), cleanup with the sandbox, the broker's scope,
owner check and execution count, the commands' environment and user, the event cursor and
request-id deduplication, and the output limit.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
import uuid
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx.testing import LocalBroker, Policy


class Code:
    """``/code`` requests through the broker for one sandbox, with the documented headers."""

    def __init__(self, api: Any, sandbox: dict[str, Any]) -> None:
        self.api = api
        self.sandbox = sandbox
        self.http: httpx.Client = api.http
        self.headers: dict[str, str] = api.data_headers(sandbox)

    def start(self, code: str, *, stream: bool = True, **body: Any) -> httpx.Response:
        headers = dict(self.headers)
        if stream:
            headers["Accept"] = "application/x-ndjson, application/json;q=0.5"
        body.setdefault("request_id", str(uuid.uuid4()))
        return self.http.post("/code/execute", json={"code": code, **body}, headers=headers)

    def run(self, code: str, **body: Any) -> dict[str, Any]:
        """Run ``code`` to its end: ``{"events", "stdout", "stderr", "results", "error",
        "end"}`` (following the events past the streamed start's 20 s)."""
        resp = self.start(code, **body)
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith("application/x-ndjson"), resp.text
        first, *events = [json.loads(line) for line in resp.text.splitlines()]
        events = [e for e in events if e["type"] != "heartbeat"]
        while not events or events[-1]["type"] != "end":
            events += self.events(first["execution_id"], len(events))
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1)), events
        return summary(first, events)

    def events(self, execution_id: str, after: int = 0, duration: float = 20) -> list[Any]:
        resp = self.http.get(
            f"/code/executions/{execution_id}/events",
            params={"after": after, "duration": duration},
            headers=self.headers,
        )
        assert resp.status_code == 200, resp.text
        return [e for e in map(json.loads, resp.text.splitlines()) if e["type"] != "heartbeat"]

    def get(self, path: str, **params: Any) -> httpx.Response:
        return self.http.get(f"/code/{path}", params=params, headers=self.headers)

    def post(self, path: str, **body: Any) -> httpx.Response:
        return self.http.post(f"/code/{path}", json=body, headers=self.headers)

    def context(self, **body: Any) -> dict[str, Any]:
        resp = self.post("contexts", **body)
        assert resp.status_code == 200, resp.text
        out: dict[str, Any] = resp.json()
        return out

    def command(self, command: str) -> dict[str, Any]:
        """``command`` run through bash in the sandbox (``/execute``): its result."""
        resp = self.api.run(self.sandbox, shlex.join(["/bin/bash", "-c", command]))
        assert resp.status_code == 200, resp.text
        out: dict[str, Any] = resp.json()
        return out


def summary(first: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [e for e in events if e["type"] == "error"]
    return {
        "execution_id": first["execution_id"],
        "context_id": first["context_id"],
        "events": events,
        "stdout": "".join(e["data"] for e in events if e["type"] == "stdout"),
        "stderr": "".join(e["data"] for e in events if e["type"] == "stderr"),
        "results": [e for e in events if e["type"] == "result"],
        "error": errors[0] if errors else None,
        "end": events[-1],
    }


def main_text(execution: dict[str, Any]) -> str | None:
    for result in execution["results"]:
        if result["is_main_result"]:
            text: str | None = result.get("text")
            return text
    return None


@pytest.fixture
def code(alice: Any, sandbox: dict[str, Any]) -> Code:
    return Code(alice, sandbox)


def configured(alice: Any, **env: str) -> Code:
    """A Code client for a new sandbox whose runtime has these ``SANDBOX_*`` settings."""
    return Code(alice, alice.ready(env=env))


def _interpreters(code: Code, context_id: str) -> list[int]:
    """The host's pids of ``code``'s sandbox's interpreters of ``context_id``: the processes
    below its runtime whose command line names it (an interpreter's does:
    ``agent-sandbox-code-context ID``), in whatever PID namespace they run."""
    runtime = code.api.broker.runtime_pid(code.sandbox["name"])
    assert runtime is not None
    parents: dict[int, int] = {}
    named: list[int] = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[-1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        marked = b"agent-sandbox-code-context" in argv and context_id.encode() in argv
        if marked and fields[0] != b"Z":
            named.append(int(entry))

    def below_runtime(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == runtime:
                return True
        return False

    return [pid for pid in named if below_runtime(pid)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


def _settled(check: Any, within: float = 15.0) -> Any:
    """``check()`` once it is truthy, polled (a wait, not a speed test)."""
    end = time.monotonic() + within
    while not (value := check()) and time.monotonic() < end:
        time.sleep(0.05)
    return value or check()


# -- state, results, errors --------------------------------------------------------------------


def test_state_persists_between_executions(code: Code) -> None:
    first = code.run("x = 41")
    assert first["error"] is None and first["results"] == [], first
    assert first["end"]["state"] == "done" and first["end"]["execution_count"] == 1
    second = code.run("x + 1")
    assert main_text(second) == "42"
    assert second["end"]["execution_count"] == 2
    assert second["context_id"] == "default"


def test_an_exception_in_the_code_is_a_result(code: Code) -> None:
    code.run("def f():\n    return {}['missing']")
    out = code.run("print('before')\nf()")
    assert out["stdout"] == "before\n"
    error = out["error"]
    assert error["name"] == "KeyError" and error["value"] == "'missing'"
    assert 'File "<cell 2>", line 2' in error["traceback"]
    assert "in f" in error["traceback"] and "<string>" not in error["traceback"]
    assert out["end"]["state"] == "done"
    syntax = code.run("def g(:")
    assert syntax["error"]["name"] == "SyntaxError"
    assert syntax["error"]["traceback"].startswith('  File "<cell 3>", line 1')
    assert main_text(code.run("1 + 1")) == "2"  # the context goes on


def test_results_follow_the_display_protocol(code: Code) -> None:
    out = code.run(
        "class Rich:\n"
        "    def _repr_html_(self): return '<b>rich</b>'\n"
        "    def _repr_png_(self): return b'\\x89PNG-bytes'\n"
        "    def _repr_json_(self): return {'a': [1, 2]}\n"
        "    def __repr__(self): return 'Rich()'\n"
        "display(Rich(), 'shown')\n"
        "Rich()"
    )
    assert out["error"] is None, out
    shown, text, main = out["results"]
    assert not shown["is_main_result"] and not text["is_main_result"] and main["is_main_result"]
    assert main["html"] == "<b>rich</b>" and main["json"] == {"a": [1, 2]}
    assert main["text"] == "Rich()"
    assert main["png"] == "iVBORy1ieXRlcw=="  # base64 of the bytes _repr_png_ returned
    assert text["text"] == "'shown'"
    assert code.run("None")["results"] == []
    assert code.run("5;")["results"] == []  # a trailing semicolon shows nothing, as in IPython
    assert main_text(code.run("_")) == "Rich()"  # the last result, as in IPython


def test_output_goes_to_stdout_and_stderr_subprocesses_included(code: Code) -> None:
    out = code.run(
        "import os, sys, subprocess\n"
        "print('out'); print('err', file=sys.stderr)\n"
        "os.system('echo from-a-shell')\n"
        "subprocess.run(['sh', '-c', 'echo to-stderr >&2'])\n"
        "None"
    )
    assert out["stdout"] == "out\nfrom-a-shell\n"
    assert out["stderr"] == "err\nto-stderr\n"
    stamps = [e["timestamp"] for e in out["events"] if e["type"] in ("stdout", "stderr")]
    assert all(isinstance(t, int) and t > 1.6e18 for t in stamps)  # ns since the epoch


def test_output_is_streamed_while_the_code_runs(code: Code, alice: Any) -> None:
    """The code prints, then waits for a file the test writes only once it has received that
    output through the broker: without live output it would never finish (its time limit is
    short, the test's reading of the stream is the only thing that lets it go on)."""
    headers = {**code.headers, "Accept": "application/x-ndjson"}
    body = {
        "code": (
            "import os, time\n"
            "print('waiting', flush=True)\n"
            "while not os.path.exists('go'):\n"
            "    time.sleep(0.02)\n"
            "print('released')"
        ),
        "timeout": 60,
    }
    seen: list[dict[str, Any]] = []
    printed = ""
    with code.http.stream("POST", "/code/execute", json=body, headers=headers) as resp:
        for line in resp.iter_lines():
            event = json.loads(line)
            seen.append(event)
            if event.get("type") == "stdout":
                printed += event["data"]
                if printed == "waiting\n":
                    wrote = alice.http.post(
                        "/fs/write", data={"path": "go"}, files={"file": b""}, headers=code.headers
                    )
                    assert wrote.status_code == 200, wrote.text
    assert printed == "waiting\nreleased\n", seen
    assert seen[-1]["type"] == "end" and seen[-1]["state"] == "done", seen


def test_envs_apply_to_one_execution(code: Code) -> None:
    out = code.run("import os; os.environ['S31_VAR']", envs={"S31_VAR": "set"})
    assert main_text(out) == "'set'"
    after = code.run("import os; os.environ.get('S31_VAR')")
    assert after["results"] == [], after  # restored after the execution


def test_the_interpreter_runs_as_commands_do(alice: Any) -> None:
    """Same user, working directory and environment as a managed command of the sandbox;
    never the runtime process itself."""
    code = Code(alice, alice.ready(env={"S31_FROM_CREATE": "yes"}))
    command = code.command("echo $(id -u) $(pwd) $S31_FROM_CREATE")["stdout"].split()
    out = code.run(
        "import os\n"
        "print(os.getuid(), os.getcwd(), os.environ['S31_FROM_CREATE'])\n"
        "print(os.getpid(), os.getppid())"
    )
    ident, pids = out["stdout"].splitlines()
    assert ident.split() == command
    runtime = alice.broker.runtime_pid(code.sandbox["name"])
    pid, _parent = map(int, pids.split())
    assert pid != runtime


# -- contexts ----------------------------------------------------------------------------------


def test_contexts_are_independent(code: Code) -> None:
    other = code.context(cwd="/workspace", envs={"S31_CONTEXT": "ctx"})
    assert other["language"] == "python" and other["cwd"] == "/workspace"
    assert other["state"] == "not_started"  # its interpreter starts with its first execution
    code.run("x = 'default'")
    code.run("x = 'other'", context_id=other["id"])
    assert main_text(code.run("x")) == "'default'"
    out = code.run(
        "import os; (x, os.getcwd().endswith('workspace'), os.environ['S31_CONTEXT'])",
        context_id=other["id"],
    )
    assert main_text(out) == "('other', True, 'ctx')"
    listed = code.get("contexts").json()["contexts"]
    assert [c["id"] for c in listed] == ["default", other["id"]]
    assert {c["state"] for c in listed} == {"idle"}
    assert code.get(f"contexts/{other['id']}").json()["execution_count"] == 2


def test_restart_and_remove(code: Code) -> None:
    ctx = code.context()
    code.run("y = 1", context_id=ctx["id"])
    restarted = code.post(f"contexts/{ctx['id']}/restart")
    assert restarted.status_code == 200 and restarted.json()["state"] == "not_started"
    error = code.run("y", context_id=ctx["id"])["error"]
    assert (error["name"], error["value"]) == ("NameError", "name 'y' is not defined")
    assert code.post(f"contexts/{ctx['id']}/remove").json() == {"id": ctx["id"], "removed": True}
    gone = code.start("1", context_id=ctx["id"])
    assert gone.status_code == 404 and gone.json()["code"] == "context_not_found", gone.text
    again = code.post(f"contexts/{ctx['id']}/remove")
    assert again.status_code == 404 and again.json()["code"] == "context_not_found"
    code.run("z = 1")
    assert code.post("contexts/default/remove").json()["id"] == "default"  # restarted
    assert code.run("z")["error"]["name"] == "NameError"
    assert [c["id"] for c in code.get("contexts").json()["contexts"]] == ["default"]


def test_the_number_of_contexts_is_bounded(alice: Any) -> None:
    code = configured(alice, SANDBOX_CODE_MAX_CONTEXTS="2")
    code.context()
    refused = code.post("contexts")
    assert refused.status_code == 429, refused.text
    assert refused.json()["code"] == "too_many_contexts" and refused.json()["limit"] == 2
    assert "SANDBOX_CODE_MAX_CONTEXTS" in refused.json()["detail"]


def test_a_busy_context_refuses_another_execution(code: Code) -> None:
    started = code.start("import time; time.sleep(30)", stream=False, timeout=60)
    assert started.status_code == 200, started.text
    running = started.json()["execution_id"]
    refused = code.start("1")
    assert refused.status_code == 409, refused.text
    assert refused.json()["code"] == "context_busy"
    assert refused.json()["execution_id"] == running
    other = code.context()  # another context runs meanwhile
    assert main_text(code.run("2", context_id=other["id"])) == "2"
    interrupted = code.post(f"executions/{running}/interrupt")
    assert interrupted.status_code == 200 and interrupted.json()["state"] == "interrupted"
    events = code.events(running)
    assert events[-2]["name"] == "KeyboardInterrupt" and events[-1]["restarted"] is False
    assert main_text(code.run("3")) == "3"


@pytest.mark.parametrize("bad", [{"language": "r"}, {"context_id": "nope"}, {"timeout": 0}])
def test_bad_requests_are_refused(code: Code, bad: dict[str, Any]) -> None:
    resp = code.start("1", **bad)
    expected = {"language": (400, "unsupported_language"), "context_id": (404, "context_not_found")}
    status, error_code = expected.get(next(iter(bad)), (400, None))
    assert resp.status_code == status, resp.text
    assert resp.json().get("code") == error_code, resp.text


# -- time limits, interrupts, deaths -----------------------------------------------------------


def test_a_runaway_cell_is_interrupted_and_the_state_kept(code: Code) -> None:
    code.run("kept = 'yes'")
    out = code.run("while True:\n    pass", timeout=1)
    error, end = out["error"], out["end"]
    assert error["name"] == "TimeoutError", error
    assert "time limit of 1 s" in error["value"] and "keeps its state" in error["value"]
    assert "<cell 2>" in error["traceback"]  # where it was interrupted
    assert (end["state"], end["timed_out"], end["restarted"]) == ("timed_out", True, False)
    assert main_text(code.run("kept")) == "'yes'"


def test_a_cell_that_ignores_sigint_gets_its_context_restarted(alice: Any) -> None:
    code = configured(alice, SANDBOX_CODE_INTERRUPT_GRACE_SECONDS="0.5")
    code.run("kept = 'yes'")
    out = code.run(
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)",
        timeout=1,
    )
    error, end = out["error"], out["end"]
    assert error["name"] == "TimeoutError" and "restarted" in error["value"], error
    assert (end["state"], end["timed_out"], end["restarted"]) == ("timed_out", True, True)
    assert code.run("kept")["error"]["name"] == "NameError"  # a new interpreter: state lost


def test_an_interpreter_killed_during_an_execution_is_reported_by_it(code: Code) -> None:
    out = code.run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    error = out["error"]
    assert error["name"] == "ContextDied" and "SIGKILL" in error["value"], error
    assert out["end"]["state"] == "context_died" and out["end"]["restarted"] is True
    assert main_text(code.run("1")) == "1"  # a new interpreter


def test_an_interpreter_killed_between_executions_is_reported_by_the_next(code: Code) -> None:
    code.run("kept = 1")
    pids = _interpreters(code, "default")
    assert len(pids) == 1, pids
    os.kill(pids[0], 9)  # from outside, as the OOM killer would
    assert _settled(lambda: code.get("contexts/default").json()["state"] == "not_started")
    reported = code.run("print('not run')")
    assert reported["stdout"] == "" and reported["error"]["name"] == "ContextDied"
    assert "after its last execution" in reported["error"]["value"]
    assert "was not run" in reported["error"]["value"]
    assert reported["end"]["state"] == "context_died"
    fresh = code.run("'kept' in globals()")
    assert main_text(fresh) == "False"


def test_the_interpreters_end_with_their_sandbox(alice: Any) -> None:
    code = Code(alice, alice.ready())
    other = code.context()
    code.run("1")
    code.run("import subprocess; subprocess.Popen(['sleep', '300'])", context_id=other["id"])
    pids = _interpreters(code, "default") + _interpreters(code, other["id"])
    assert len(pids) == 2, pids
    resp = alice.http.delete(f"/v1/sandboxes/{code.sandbox['name']}")
    assert resp.status_code == 202, resp.text
    assert _settled(lambda: not any(_alive(pid) for pid in pids)), "an interpreter outlived it"


def test_the_output_limit(alice: Any) -> None:
    """Beyond SANDBOX_CODE_OUTPUT_LIMIT_BYTES output is cut and a representation too large for
    the limit left out (its result says which); the end says the output was truncated."""
    code = configured(alice, SANDBOX_CODE_OUTPUT_LIMIT_BYTES="20000")
    out = code.run(
        "print('x' * 100000)\n"
        "class Big:\n"
        "    def _repr_html_(self): return 'y' * 50000\n"
        "    def __repr__(self): return 'Big()'\n"
        "Big()"
    )
    assert 0 < len(out["stdout"]) < 20000 and set(out["stdout"]) <= {"x", "\n"}
    assert out["end"]["output_truncated"] is True
    (main,) = out["results"]
    assert (main["text"], main["dropped"], "html" in main) == ("Big()", ["html"], False)
    assert code.run("print('fits')")["stdout"] == "fits\n"  # the limit is per execution


# -- the protocol: cursor, request ids, streams ------------------------------------------------


def test_events_resume_from_a_cursor_and_a_request_id_answers_the_same_execution(
    code: Code,
) -> None:
    request_id = str(uuid.uuid4())
    plain = code.start("print(1); print(2, flush=True); 3", stream=False, request_id=request_id)
    assert plain.headers["content-type"].startswith("application/json")
    execution_id = plain.json()["execution_id"]
    everything = code.events(execution_id)
    assert everything[-1]["type"] == "end"
    assert code.events(execution_id, after=1) == everything[1:]
    again = code.run("print(1); print(2, flush=True); 3", request_id=request_id)
    assert again["execution_id"] == execution_id and again["events"] == everything
    other = code.start("4", request_id=request_id)
    assert other.status_code == 409, other.text
    found = code.get("executions", request_id=request_id).json()["executions"]
    assert [e["execution_id"] for e in found] == [execution_id]
    status = code.get(f"executions/{execution_id}").json()
    assert status["state"] == "done" and status["last_seq"] == len(everything)
    beyond = code.get(f"executions/{execution_id}/events", after=len(everything) + 1)
    assert beyond.status_code == 400
    missing = code.get("executions/nope/events")
    assert missing.status_code == 404 and missing.json()["code"] == "execution_not_found"


# -- the broker: scope, owner, counted ----------------------------------------------------------


def test_the_broker_forwards_code_to_its_owner_with_the_commands_scope(
    code: Code, bob: Any, broker: LocalBroker
) -> None:
    before = broker.execution_count(code.sandbox["name"])
    code.run("1")
    assert broker.execution_count(code.sandbox["name"]) == before + 1
    code.get("contexts")
    assert broker.execution_count(code.sandbox["name"]) == before + 1  # only executions count
    stranger = Code(bob, code.sandbox).start("1")
    assert stranger.status_code == 403, stranger.text
    with LocalBroker(warn=False) as scoped:
        scoped.add_issuer("files-only", policy=Policy(namespace="files-only", scopes=("files",)))
        token = scoped.issuers["files-only"].issue_token("robot")
        api = type(code.api)(scoped, token)
        sandbox = api.ready()
        for resp in (
            Code(api, sandbox).start("1"),
            Code(api, sandbox).get("contexts"),
            Code(api, sandbox).post("contexts"),
        ):
            assert resp.status_code == 403, resp.text
            assert resp.json()["code"] == "scope_denied"
        api.http.close()


def test_the_interpreter_is_the_sandbox_python3(code: Code, sandbox: dict[str, Any]) -> None:
    """``python3`` on the context's PATH runs it: here one that starts Python without its site
    packages (so without IPython: the standard library's display formatter)."""
    code.command(
        f"mkdir -p bin && printf '#!/bin/sh\\nexec {sys.executable} -S \"$@\"\\n' > bin/python3"
        " && chmod +x bin/python3"
    )
    path = code.command("echo $PATH")["stdout"].strip()
    base = code.command("pwd")["stdout"].strip()
    ctx = code.context(envs={"PATH": f"{base}/bin:{path}"})
    out = code.run("import sys; sys.flags.no_site", context_id=ctx["id"])
    assert main_text(out) == "1", out
    info = code.get(f"contexts/{ctx['id']}").json()
    assert info["formatter"] == "standard"


def _write(code: Code, files: dict[str, str]) -> None:
    for path, text in files.items():
        resp = code.http.post(
            "/fs/write", data={"path": path}, files={"file": text.encode()}, headers=code.headers
        )
        assert resp.status_code == 200, resp.text


PYPLOT_STAND_IN = {
    "mpl/matplotlib/__init__.py": "",
    "mpl/matplotlib/figure.py": (
        "class Figure:\n"
        "    def __init__(self, num): self.num = num\n"
        "    def savefig(self, out, format, bbox_inches):\n"
        "        out.write(b'PNG of figure %d' % self.num)\n"
        "    def __repr__(self): return f'<Figure {self.num}>'\n"
    ),
    "mpl/matplotlib/pyplot.py": (
        "from matplotlib.figure import Figure\n"
        "_open = {}\n"
        "def figure(num):\n"
        "    return _open.setdefault(num, Figure(num))\n"
        "def get_fignums(): return sorted(_open)\n"
        "def close(which): _open.clear()\n"
        "def show(): raise AssertionError('pyplot.show is the kernel\\'s')\n"
    ),
}
"""A stand-in for the part of matplotlib's pyplot API the kernel uses (``figure``,
``get_fignums``, ``close``, ``show``, ``Figure.savefig``): this machine has no matplotlib."""


def test_matplotlib_figures_are_png_results(code: Code) -> None:
    _write(code, PYPLOT_STAND_IN)
    ctx = code.context(cwd="/app/mpl")
    out = code.run(
        "import matplotlib.pyplot as plt\n"
        "plt.figure(1)\n"
        "plt.show()\n"  # shown here: figure 1, once
        "plt.figure(2)\n"  # open at the end: shown then
        "None",
        context_id=ctx["id"],
    )
    assert out["error"] is None, out
    assert [(r["text"], r["png"], r["is_main_result"]) for r in out["results"]] == [
        ("<Figure 1>", "UE5HIG9mIGZpZ3VyZSAx", False),
        ("<Figure 2>", "UE5HIG9mIGZpZ3VyZSAy", False),
    ]
    last = code.run("fig = plt.figure(3)\nfig", context_id=ctx["id"])
    assert [(r["text"], r["is_main_result"]) for r in last["results"]] == [("<Figure 3>", True)]


IPYTHON_STAND_IN = {
    "ipy/IPython/__init__.py": "",
    "ipy/IPython/core/__init__.py": "",
    "ipy/IPython/core/formatters.py": (
        "class DisplayFormatter:\n"
        "    def format(self, obj):\n"
        "        return {'text/plain': 'formatted by IPython: ' + repr(obj)}, {}\n"
    ),
    "ipy/IPython/display.py": "def display(*objs):\n    print('IPython has no shell here')\n",
}
"""A stand-in for IPython's ``DisplayFormatter`` and ``IPython.display.display``."""


def test_ipython_formats_where_the_sandbox_has_it(code: Code) -> None:
    _write(code, IPYTHON_STAND_IN)
    ctx = code.context(cwd="/app/ipy")
    assert main_text(code.run("6 * 7", context_id=ctx["id"])) == "formatted by IPython: 42"
    out = code.run("from IPython.display import display\ndisplay('x')", context_id=ctx["id"])
    assert [r["text"] for r in out["results"]] == ["formatted by IPython: 'x'"], out
    assert out["stdout"] == ""  # IPython's display was the kernel's
    assert code.get(f"contexts/{ctx['id']}").json()["formatter"] == "ipython"


def test_a_real_ipython_when_the_sandbox_python_has_it(code: Code) -> None:
    probe = code.command("python3 -c 'import IPython' 2>/dev/null && echo yes || echo no")
    if probe["stdout"].strip() != "yes":
        pytest.skip("the sandbox's python3 has no IPython here")
    out = code.run("from IPython.display import HTML, display\ndisplay(HTML('<b>x</b>'))\n[1, 2]")
    shown, main = out["results"]
    assert shown["html"] == "<b>x</b>" and main["text"] == "[1, 2]"
    assert code.get("contexts/default").json()["formatter"] == "ipython"


def test_an_interrupt_before_the_cell_runs_interrupts_it_when_it_starts(alice: Any) -> None:
    """The interpreter takes longer to start than the interrupt's grace (a ``python3`` that
    sleeps 1.5 s first, a grace of 0.5 s): the interrupt of its first execution comes before the
    kernel has the cell. It is delivered once the kernel says it started, and the grace starts
    then: the cell ends interrupted, the interpreter lives on (before, the SIGINT hit the
    starting interpreter; later, on a loaded CI machine, the grace ran out while the interpreter
    started: the context was restarted, its new state lost)."""
    code = configured(alice, SANDBOX_CODE_INTERRUPT_GRACE_SECONDS="0.5")
    code.command(
        f"mkdir -p slow && printf '#!/bin/sh\\nsleep 1.5\\nexec {sys.executable} \"$@\"\\n' "
        "> slow/python3 && chmod +x slow/python3"
    )
    path = code.command("echo $PATH")["stdout"].strip()
    base = code.command("pwd")["stdout"].strip()
    ctx = code.context(envs={"PATH": f"{base}/slow:{path}"})
    started = code.start("import time\ntime.sleep(60)", stream=False, context_id=ctx["id"])
    execution = started.json()["execution_id"]
    interrupted = code.post(f"executions/{execution}/interrupt")
    assert interrupted.json()["state"] == "interrupted", interrupted.text
    end = code.events(execution)[-1]
    assert end["restarted"] is False, end
    assert main_text(code.run("'alive'", context_id=ctx["id"])) == "'alive'"
    assert code.get(f"contexts/{ctx['id']}").json()["execution_count"] == 2
