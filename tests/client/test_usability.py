"""A newcomer's mistakes get errors that point at the fix (issue 10, "CI and usability").

Through the public API only: a typo'd keyword suggests the intended name, a list where a mapping
is expected is a TypeError naming the argument (and never echoing its values, which may be
secrets), and ``files.read_to`` creates files with the normal mode (the umask applies).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from k8s_agent_sandbox_awx import (
    AsyncSandbox,
    BrokerSandboxClient,
    Sandbox,
)

BROKER = "https://127.0.0.1:9"  # never contacted: every error below comes before any request


def _type_error(call: Callable[[], Any]) -> str:
    with pytest.raises(TypeError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize(
    ("call", "typo", "meant"),
    [
        (lambda c: c.create_sandbox(templte="python"), "templte", "template"),
        (lambda c: c.create_sandbox(sandbox_ready_timout=3), "sandbox_ready_timout", None),
        (lambda c: c.create_sandbox(anotations={}), "anotations", "annotations"),
        (lambda c: c.create_sandbox(lable={}), "lable", "labels"),
    ],
)
def test_create_sandbox_typo_suggests_the_name(
    call: Callable[[Any], Any], typo: str, meant: str | None, make_client: Any, fake: Any
) -> None:
    message = _type_error(lambda: call(make_client()))
    meant = meant or "sandbox_ready_timeout"
    assert repr(typo) in message and f"did you mean {meant!r}?" in message, message
    assert fake.requests == []


@pytest.mark.parametrize(
    ("kwargs", "meant"),
    [
        ({"templte": "python"}, "template"),
        ({"lifetime": 60}, "lifetime_seconds"),
        ({"brokr_url": BROKER}, "broker_url"),
        ({"ready_timout": 3}, "ready_timeout"),
    ],
)
def test_sandbox_create_typo_suggests_the_name(kwargs: dict[str, Any], meant: str) -> None:
    for create in (
        lambda: Sandbox.create(**kwargs),
        lambda: asyncio.run(AsyncSandbox.create(**kwargs)),
    ):
        message = _type_error(create)
        assert f"did you mean {meant!r}?" in message, message
        assert "template" in message.split("accepts", 1)[1]  # named parameters are listed too


def test_connect_and_list_typo_suggests_the_name() -> None:
    message = _type_error(lambda: Sandbox.connect("sbx-1", brokr_url=BROKER))
    assert "did you mean 'broker_url'?" in message, message
    message = _type_error(lambda: Sandbox.list(ca_certs="ca.pem"))
    assert "did you mean 'ca_cert'?" in message, message


def test_commands_run_typo_suggests_timeout(make_client: Any, fake: Any) -> None:
    sandbox = make_client().create_sandbox()
    sent = len(fake.requests)
    message = _type_error(lambda: sandbox.commands.run("echo hi", timout=5))
    assert "'timout'" in message and "did you mean 'timeout'?" in message, message
    assert len(fake.requests) == sent  # the command was not sent


def test_no_suggestion_for_a_name_like_nothing(make_client: Any) -> None:
    message = _type_error(lambda: make_client().create_sandbox(zzzz=1))
    assert "'zzzz'" in message and "did you mean" not in message
    assert "template" in message  # still lists what is accepted


def test_client_settings_typo_is_refused_with_a_suggestion() -> None:
    """A misspelt setting used to be ignored without a word (the default applied)."""
    message = _type_error(lambda: BrokerSandboxClient(broker_url=BROKER, request_timout=3))
    assert "'request_timout'" in message and "did you mean 'request_timeout'?" in message


SECRET = "s3cr3t-value-never-echoed"


@pytest.mark.parametrize("argument", ["labels", "annotations", "env"])
@pytest.mark.parametrize("value", [["x"], [("KEY", SECRET)], "KEY=" + SECRET])
def test_a_mapping_argument_that_is_not_a_mapping(
    argument: str, value: Any, make_client: Any, fake: Any
) -> None:
    message = _type_error(lambda: make_client().create_sandbox(**{argument: value}))
    assert f"{argument}=" in message and "mapping" in message, message
    assert SECRET not in message
    assert fake.requests == []


@pytest.mark.parametrize("argument", ["labels", "annotations", "env"])
def test_a_mapping_with_a_non_str_key_or_value(argument: str, make_client: Any) -> None:
    message = _type_error(lambda: make_client().create_sandbox(**{argument: {"n": 1}}))
    assert f"{argument}=" in message and "'n'" in message and "int" in message, message
    message = _type_error(lambda: make_client().create_sandbox(**{argument: {1: "v"}}))
    assert f"{argument}=" in message and "int" in message, message


def test_sandbox_create_labels_list_is_a_type_error() -> None:
    message = _type_error(lambda: Sandbox.create(broker_url=BROKER, labels=["x"]))  # type: ignore[arg-type]
    assert "labels=" in message and "mapping" in message


def test_list_label_selector_must_be_a_str_or_mapping(make_client: Any, fake: Any) -> None:
    message = _type_error(lambda: make_client().list_sandboxes(["team=ml"]))
    assert "label_selector" in message and "mapping" in message, message
    assert fake.requests == []


def test_environ_must_be_a_mapping() -> None:
    message = _type_error(lambda: BrokerSandboxClient(environ=["X=1"]))  # type: ignore[arg-type]
    assert "environ=" in message and "mapping" in message, message


# ------------------------------------------------------------------------------ read_to mode


@pytest.fixture
def umask() -> Iterator[Callable[[int], None]]:
    old = os.umask(0o022)

    def set_umask(mask: int) -> None:
        os.umask(mask)

    yield set_umask
    os.umask(old)


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_read_to_creates_the_file_with_the_normal_mode(
    mask: int, mode: int, umask: Any, make_client: Any, fake: Any, tmp_path: Path
) -> None:
    """As ``open(path, "wb")`` would: 0o666 minus the umask (it used to be 0o600 always)."""
    fake.route("GET", "/download/out.bin")(lambda r: httpx.Response(200, content=b"data"))
    sandbox = make_client().create_sandbox()
    umask(mask)
    assert sandbox.files.read_to("out.bin", tmp_path / "out.bin") == 4
    assert (tmp_path / "out.bin").stat().st_mode & 0o777 == mode


def test_read_to_keeps_the_mode_of_an_existing_file(
    umask: Any, make_client: Any, fake: Any, tmp_path: Path
) -> None:
    """Replacing an existing file keeps its permissions, as ``open(path, "wb")`` would."""
    fake.route("GET", "/download/out.bin")(lambda r: httpx.Response(200, content=b"new"))
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    target.chmod(0o640)
    umask(0o022)
    assert make_client().create_sandbox().files.read_to("out.bin", target) == 3
    assert target.read_bytes() == b"new" and target.stat().st_mode & 0o777 == 0o640


def test_read_to_a_directory_fails_before_downloading(
    make_client: Any, fake: Any, tmp_path: Path
) -> None:
    """A directory as the destination: an error naming it, before the download (it came after
    the whole file was fetched, as 'Is a directory: '.../.out.1a2b3c4d.part' -> ...')."""
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        return httpx.Response(200, content=b"data")

    fake.route("GET", "/download/out.bin")(answer)
    folder = tmp_path / "folder"
    folder.mkdir()
    sandbox = make_client().create_sandbox()
    with pytest.raises(IsADirectoryError, match="is a directory") as info:
        sandbox.files.read_to("out.bin", folder)
    assert repr(str(folder)) in str(info.value) and ".part" not in str(info.value)
    assert asked == [] and list(folder.iterdir()) == [] and sorted(tmp_path.iterdir()) == [folder]
