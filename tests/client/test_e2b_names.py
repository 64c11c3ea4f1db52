"""The names E2B users reach for (issue 23), end to end against the local broker, sync and
async, per dialect where the control plane matters: ``envs=`` (and ``env=``) at both places,
``metadata=``, ``Sandbox.kill(name)`` on the class, ``commands.kill/send_stdin/connect`` by
command id, ``files.rename``, background output callbacks delivered while the command runs and
a ``cwd`` relative to the sandbox's working directory (docs/client.md, "Coming from E2B")."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import pytest

from k8s_agent_sandbox_awx import AsyncSandbox, Sandbox
from k8s_agent_sandbox_awx.client.wire._dialect import LIST, SANDBOX_ENV
from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect
from k8s_agent_sandbox_awx.errors import (
    BrokerError,
    ConfigurationError,
    UnsupportedOperationError,
)

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("dialect")]  # once per dialect
T = TypeVar("T")
SECRET = "s3cr3t-env-value-never-shown"
NOWHERE = {"broker_url": "https://127.0.0.1:9"}  # never reached: the checks are local


def arun(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


# ------------------------------------------------------------------------ envs=, env=, metadata=


def test_create_takes_envs_and_env_and_commands_run_takes_both(
    broker: Any, dialect: str, live: Any
) -> None:
    """``Sandbox.create(envs=)`` (E2B's, the main spelling) and ``env=`` (upstream's) set the
    sandbox's environment; ``commands.run`` takes ``env=`` as well as ``envs=``. Under ``/rpc``
    (no sandbox environment) ``envs=`` is refused before anything is sent, naming both."""
    environ = broker.environ("kubernetes")
    if SANDBOX_ENV not in get_dialect(dialect).features:
        for keyword in ("envs", "env"):
            with pytest.raises(UnsupportedOperationError, match=r"envs= \(env=\)"):
                Sandbox.create(environ=environ, **{keyword: {"A": "1"}})
        assert live(broker) == []
        environ_only: dict[str, Any] = {}
    else:
        environ_only = {"envs": {"BASE": "b1"}}
    with Sandbox.create(environ=environ, **environ_only) as sandbox:
        expected = "b1" if environ_only else ""
        result = sandbox.commands.run('echo "$BASE $MINE"', env={"MINE": "m"})
        assert result.stdout == f"{expected} m\n"
        same = sandbox.commands.run('echo "$MINE"', env={"MINE": "x"}, envs={"MINE": "x"})
        assert same.stdout == "x\n"
    if environ_only:
        with Sandbox.create(environ=environ, env={"BASE": "b2"}) as sandbox:
            assert sandbox.commands.run('echo "$BASE"').stdout == "b2\n"
    assert live(broker) == []


def test_two_spellings_with_different_values_are_refused_without_the_values(
    broker: Any,
) -> None:
    with pytest.raises(ConfigurationError) as info:
        Sandbox.create(**NOWHERE, envs={"A": SECRET}, env={"A": "other"})
    message = str(info.value)
    assert "env=" in message and "envs=" in message and "pass only envs=" in message, message
    assert SECRET not in message
    with pytest.raises(ConfigurationError, match="pass only annotations="):
        Sandbox.create(**NOWHERE, metadata={"a": "1"}, annotations={"a": "2"})
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        with pytest.raises(TypeError) as run_info:
            sandbox.commands.run("true", envs={"A": SECRET}, env={"A": "x"})
        assert "pass only envs=" in str(run_info.value) and SECRET not in str(run_info.value)
        assert broker.execution_count(sandbox.name) == 0


def test_metadata_is_stored_as_annotations(broker: Any, dialect: str, live: Any) -> None:
    """E2B's ``metadata=`` (a string map shown in listings) is the sandbox's annotations: free
    text values, returned by ``Sandbox.list()`` and ``get_info()`` as ``annotations`` (and
    ``metadata``)."""
    environ = broker.environ("kubernetes")
    metadata = {"purpose": "an agent's run, with spaces & symbols: ok", "user-id": "42"}
    with Sandbox.create(environ=environ, metadata=metadata) as sandbox:
        [claim] = broker.claims()
        annotations = claim["metadata"]["annotations"]
        assert {k: annotations[k] for k in metadata} == metadata
        if dialect == "v1":  # an /rpc status answer carries no annotations
            # issue 30: metadata is the user's alone; the broker's stamps are the owner's
            got = sandbox.get_info()
            assert dict(got.metadata) == metadata, got.metadata
            assert any(k.startswith("broker.agent-sandbox-awx.io/") for k in got.annotations)
            assert got.owner
        if LIST in get_dialect(dialect).features:
            [info] = Sandbox.list(environ=environ)
            assert {k: info.annotations[k] for k in metadata} == metadata
            assert dict(info.metadata) == metadata
    assert live(broker) == []


def test_the_async_create_takes_envs_and_metadata(broker: Any, dialect: str, live: Any) -> None:
    has_env = SANDBOX_ENV in get_dialect(dialect).features

    async def main() -> None:
        environ = broker.environ("kubernetes")
        envs = {"envs": {"BASE": "async"}} if has_env else {}
        async with await AsyncSandbox.create(environ=environ, metadata={"k": "v"}, **envs) as sb:
            result = await sb.commands.run('echo "$BASE $MINE"', env={"MINE": "m"})
            assert result.stdout == f"{'async' if has_env else ''} m\n"
            [claim] = broker.claims()
            assert claim["metadata"]["annotations"]["k"] == "v"

    arun(main())
    assert live(broker) == []


# ------------------------------------------------------------------------- Sandbox.kill(name)


def test_kill_on_the_class_deletes_by_name(broker: Any, dialect: str, live: Any) -> None:
    """``Sandbox.kill(name)`` (E2B's class call) deletes a sandbox without a handle; it used to
    be ``AttributeError: 'str' object has no attribute '_killed'``. ``True`` if it deleted it;
    a name that does not exist is ``False`` under v1 (``/rpc``'s delete cannot tell)."""
    environ = broker.environ("kubernetes")
    sandbox = Sandbox.create(environ=environ)
    try:
        assert Sandbox.kill(sandbox.name, environ=environ) is True
        assert live(broker) == []
        assert Sandbox.kill("sbx-never-made", environ=environ) is (dialect != "v1")
        sandbox.kill()  # the handle's own kill of a sandbox deleted meanwhile: fine
        assert sandbox.kill() is False  # this handle killed it: nothing sent
    finally:
        sandbox.close_connection()
    other = Sandbox.create(environ=environ)
    assert Sandbox.kill(other) is True  # the unbound call with a handle
    assert not other.is_active and live(broker) == []
    with pytest.raises(TypeError, match=r"sandbox's name .*Sandbox.kill\(sandbox.name\)"):
        Sandbox.kill(42, environ=environ)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="did you mean"):
        Sandbox.kill("x", environs=environ)  # type: ignore[call-arg]


def test_the_async_kill_on_the_class_deletes_by_name(broker: Any, dialect: str, live: Any) -> None:
    async def main() -> None:
        environ = broker.environ("kubernetes")
        sandbox = await AsyncSandbox.create(environ=environ)
        try:
            assert await AsyncSandbox.kill(sandbox.name, environ=environ) is True
            assert live(broker) == []
            gone = await AsyncSandbox.kill("sbx-never-made", environ=environ)
            assert gone is (dialect != "v1")
        finally:
            await sandbox.close_connection()
        other = await AsyncSandbox.create(environ=environ)
        assert await other.kill() is True and await other.kill() is False
        with pytest.raises(TypeError, match="sandbox's name"):
            await AsyncSandbox.kill(None, environ=environ)  # type: ignore[arg-type]

    arun(main())
    assert live(broker) == []


# ------------------------------------------- commands by id, background callbacks, connect


def _output_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("agent-sandbox-output-")]


def _until(condition: Callable[[], bool], within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


SLOW_TICKS = ["sh", "-c", "while :; do echo tick; sleep 0.2; done"]


def test_background_callbacks_are_delivered_while_the_command_runs(broker: Any) -> None:
    """``run(..., background=True, on_stdout=...)`` (E2B's call; it used to be a ValueError
    pointing at ``wait()``): a thread of the handle delivers the output while the command
    runs — before it ends, here before its stdin is written — and ``wait()`` returns the
    result; by id, ``commands.send_stdin`` writes to it."""
    got: list[tuple[str, str]] = []

    def out(text: str) -> None:
        got.append(("out", text))
        names.add(threading.current_thread().name)

    names: set[str] = set()
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        handle = sandbox.commands.run(
            ["sh", "-c", "echo first; echo warn >&2; read x; echo second $x"],
            background=True,
            stdin=True,
            on_stdout=out,
            on_stderr=lambda text: got.append(("err", text)),
        )
        assert _until(lambda: ("out", "first\n") in got and ("err", "warn\n") in got), got
        assert handle.status().state == "running"  # delivered while it runs
        sandbox.commands.send_stdin(handle.command_id, "x\n", eof=True)
        result = handle.wait(timeout=30)
        assert result.stdout == "first\nsecond x\n" and result.stderr == "warn\n"
        assert "".join(t for k, t in got if k == "out") == result.stdout
        assert names == {f"agent-sandbox-output-{handle.command_id}"}
        assert handle.wait() == result  # again: the same result
        assert _until(lambda: _output_threads() == [])


def test_a_delivering_handle_stops_with_kill_close_and_the_sandbox(broker: Any) -> None:
    """The thread never outlives what it follows: ``kill()`` (the last output delivered
    first), ``close()`` (the command goes on), and the sandbox's ``kill()``; its one reader
    refuses a second (``wait(on_stdout=)``, iteration) with the rule."""
    ticks: list[str] = []
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        killed = sandbox.commands.run(SLOW_TICKS, background=True, on_stdout=ticks.append)
        assert _until(lambda: len(ticks) >= 2)
        with pytest.raises(ValueError, match="on_stdout/on_stderr given when it started"):
            killed.wait(on_stdout=print)
        with pytest.raises(ValueError, match="close\\(\\) the handle"):
            next(iter(killed))
        final = killed.kill()
        assert final.state == "cancelled" and _output_threads() == []
        closed = sandbox.commands.run(SLOW_TICKS, background=True, on_stdout=ticks.append)
        assert _until(lambda: _output_threads() != [])
        closed.close()
        assert _output_threads() == []
        seen = len(ticks)
        time.sleep(0.5)
        assert len(ticks) == seen and closed.status().state == "running"  # it goes on
        assert any(e.type == "stdout" for e in _first(closed))  # readable again
        assert sandbox.commands.kill(closed.command_id).state == "cancelled"  # by id
        sandbox.commands.run(SLOW_TICKS, background=True, on_stderr=print)
        assert _until(lambda: _output_threads() != [])
    assert _output_threads() == []  # the sandbox's kill stopped it


def _first(handle: Any) -> list[Any]:
    events = []
    for event in handle:
        events.append(event)
        break
    return events


def test_a_raising_background_callback_is_raised_by_wait(broker: Any) -> None:
    def boom(text: str) -> None:
        raise RuntimeError("callback failed: " + text.strip())

    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        handle = sandbox.commands.run("echo one; sleep 0.3", background=True, on_stdout=boom)
        with pytest.raises(RuntimeError, match="callback failed: one"):
            handle.wait(timeout=30)
        assert handle.wait(timeout=30).exit_code == 0  # then read to the end by wait itself


def test_connect_kill_and_send_stdin_by_command_id(broker: Any) -> None:
    """E2B's ``commands.connect(id, on_stdout=)`` (the retained output first, then live),
    ``commands.send_stdin(id, data)`` and ``commands.kill(id)``, without a handle."""
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        started = sandbox.commands.run(["sh", "-c", "echo hello; cat"], background=True, stdin=True)
        got: list[str] = []
        handle = sandbox.commands.connect(started.command_id, on_stdout=got.append)
        assert _until(lambda: "hello\n" in got), got
        sandbox.commands.send_stdin(started.command_id, "echoed\n")
        assert _until(lambda: "".join(got) == "hello\nechoed\n"), got
        final = sandbox.commands.kill(started.command_id)
        assert final.state == "cancelled" and final.stdout == "hello\necho" + "ed\n"
        assert handle.wait(timeout=30).state == "cancelled"
        assert sandbox.commands.kill(started.command_id).state == "cancelled"  # safe to repeat
        with pytest.raises(TypeError, match="callable"):
            sandbox.commands.connect(started.command_id, on_stdout="print")  # type: ignore[arg-type]
        with pytest.raises(BrokerError, match="404"):
            sandbox.commands.connect("no-such-command")


def _output_tasks() -> list[str]:
    names = [t.get_name() for t in asyncio.all_tasks() if not t.done()]
    return [n for n in names if n.startswith("agent-sandbox-output-")]


async def _auntil(condition: Callable[[], bool], within: float = 20.0) -> bool:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_async_background_callbacks_by_id_and_their_task(broker: Any) -> None:
    """The async API: a task of the handle delivers the output (coroutine callbacks awaited)
    while the command runs; ``commands.connect/send_stdin/kill`` by id; the task ends with
    ``kill()``, ``close()`` and the sandbox's ``kill()``."""

    async def main() -> None:
        got: list[str] = []

        async def out(text: str) -> None:
            got.append(text)

        async with await AsyncSandbox.create(environ=broker.environ("kubernetes")) as sandbox:
            handle = await sandbox.commands.run(
                ["sh", "-c", "echo first; read x; echo second $x"],
                background=True,
                stdin=True,
                on_stdout=out,
            )
            assert await _auntil(lambda: got == ["first\n"]), got
            assert (await handle.status()).state == "running"
            await sandbox.commands.send_stdin(handle.command_id, "x\n", eof=True)
            result = await handle.wait(timeout=30)
            assert result.stdout == "first\nsecond x\n" == "".join(got)
            assert await _auntil(lambda: _output_tasks() == [])

            ticks: list[str] = []
            ticking = await sandbox.commands.run(SLOW_TICKS, background=True)
            connected = await sandbox.commands.connect(ticking.command_id, on_stdout=ticks.append)
            assert await _auntil(lambda: len(ticks) >= 2)
            with pytest.raises(ValueError, match="given when it started"):
                await connected.wait(on_stdout=print)
            await connected.close()
            assert _output_tasks() == [] and (await ticking.status()).state == "running"
            assert (await sandbox.commands.kill(ticking.command_id)).state == "cancelled"

            killed = await sandbox.commands.run(SLOW_TICKS, background=True, on_stdout=print)
            assert await _auntil(lambda: _output_tasks() != [])
            assert (await killed.kill()).state == "cancelled" and _output_tasks() == []
            await sandbox.commands.run(SLOW_TICKS, background=True, on_stderr=out)
            assert _output_tasks() != []
        assert _output_tasks() == []  # the sandbox's kill cancelled it

    arun(main())


# ------------------------------------------------------------- files.rename, a relative cwd


def test_files_rename_is_move_under_e2b_name(broker: Any) -> None:
    """``files.rename(old, new)`` (E2B's name; it used to be an AttributeError): the entry
    moved, its FileInfo returned, an existing destination kept unless ``overwrite=True``."""
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        sandbox.files.write("old.txt", b"one")
        sandbox.files.write("kept.txt", b"two")
        info = sandbox.files.rename("old.txt", "new.txt")
        assert info.path == "/app/new.txt" and info.size == 3
        assert not sandbox.files.exists("old.txt")
        assert sandbox.files.read("new.txt") == b"one"
        with pytest.raises(Exception, match="exists"):
            sandbox.files.rename("new.txt", "kept.txt")
        assert sandbox.files.read("kept.txt") == b"two"
        sandbox.files.rename("new.txt", "kept.txt", overwrite=True)
        assert sandbox.files.read("kept.txt") == b"one"


def test_a_relative_cwd_is_relative_to_the_sandbox_working_directory(broker: Any) -> None:
    """``cwd="project"`` is ``/app/project``, as the file path ``"project/x"`` is
    ``/app/project/x`` (it used to be a ValueError asking for an absolute path); a relative
    ``..`` is refused before anything is sent, naming the rule."""
    with Sandbox.create(environ=broker.environ("kubernetes")) as sandbox:
        sandbox.files.write("project/sub/marker.txt", b"here")
        for cwd in ("project", "project/sub", "./project/sub/", "workspace"):
            result = sandbox.commands.run("ls; echo $PWD", cwd=cwd)
            assert result.exit_code == 0, (cwd, result.stderr)
        assert sandbox.commands.run("cat marker.txt", cwd="project/sub").stdout == "here"
        handle = sandbox.commands.run("cat sub/marker.txt", cwd="project", background=True)
        assert handle.wait(timeout=30).stdout == "here"
        assert handle.status().cwd.endswith("/project")  # the local runtime: its host path
        before = broker.execution_count(sandbox.name)
        for bad in ("../etc", "project/../.."):
            with pytest.raises(ValueError, match=r"relative to /app and contains '\.\.'"):
                sandbox.commands.run("pwd", cwd=bad)
        with pytest.raises(ValueError, match=r"absolute .* or relative to /app"):
            sandbox.commands.run("pwd", cwd="")
        assert broker.execution_count(sandbox.name) == before


def test_async_rename_and_relative_cwd(broker: Any) -> None:
    async def main() -> None:
        async with await AsyncSandbox.create(environ=broker.environ("kubernetes")) as sandbox:
            await sandbox.files.write("a/one.txt", b"1")
            info = await sandbox.files.rename("a/one.txt", "a/two.txt")
            assert info.path == "/app/a/two.txt"
            result = await sandbox.commands.run("cat two.txt", cwd="a")
            assert result.stdout == "1"
            with pytest.raises(ValueError, match=r"contains '\.\.'"):
                await sandbox.commands.run("pwd", cwd="../a")

    arun(main())
