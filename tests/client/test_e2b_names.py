"""The names E2B users reach for (issue 23), end to end against the local broker, sync and
async, per dialect where the control plane matters: ``envs=`` (and ``env=``) at both places,
``metadata=``, ``Sandbox.kill(name)`` on the class, ``commands.kill/send_stdin/connect`` by
command id, ``files.rename``, background output callbacks delivered while the command runs and
a ``cwd`` relative to the sandbox's working directory (docs/client.md, "Coming from E2B")."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from k8s_agent_sandbox_awx import AsyncSandbox, Sandbox
from k8s_agent_sandbox_awx.client.wire._dialect import LIST, SANDBOX_ENV
from k8s_agent_sandbox_awx.client.wire._dialects import get_dialect
from k8s_agent_sandbox_awx.errors import ConfigurationError, UnsupportedOperationError

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
            assert {k: sandbox.get_info().metadata[k] for k in metadata} == metadata
        if LIST in get_dialect(dialect).features:
            [info] = Sandbox.list(environ=environ)
            assert {k: info.annotations[k] for k in metadata} == metadata
            assert info.metadata == info.annotations
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
