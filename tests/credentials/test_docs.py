"""The documentation covers the hooks (exact signatures), the variables and the reserved names."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from k8s_agent_sandbox_awx import hookspecs
from k8s_agent_sandbox_awx.credentials._plugins import DISABLE_AUTOLOAD_ENV, LOAD_PLUGINS_ENV
from k8s_agent_sandbox_awx.credentials._providers import (
    DEFAULT_TOKEN_PATH,
    RESERVED_NAMES,
    TOKEN_ENV,
    TOKEN_FILE_ENV,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"
SPEC_ATTR = f"{hookspecs.PROJECT_NAME}_spec"


def _hooks() -> list[str]:
    return sorted(
        name
        for name, value in vars(hookspecs).items()
        if callable(value) and hasattr(value, SPEC_ATTR)
    )


def _signature(name: str) -> str:
    function = getattr(hookspecs, name)
    sig = inspect.signature(function)
    params = ", ".join(
        f"{p.name}: {p.annotation}" if p.annotation is not p.empty else p.name
        for p in sig.parameters.values()
    )
    return f"def {name}({params}) -> {sig.return_annotation}"


def test_there_are_hooks() -> None:
    assert _hooks() == [
        "agent_sandbox_get_credential",
        "agent_sandbox_get_credential_async",
        "agent_sandbox_provider_info",
    ]


@pytest.mark.parametrize("hook", _hooks())
def test_every_hook_is_documented_with_its_signature(hook: str) -> None:
    text = (DOCS / "writing-plugins.md").read_text()
    assert f"### {hook}" in text, f"writing-plugins.md has no section for {hook}"
    assert _signature(hook) in text, f"writing-plugins.md lacks: {_signature(hook)}"


def test_entry_point_group_is_documented() -> None:
    for doc in ("writing-plugins.md", "credentials.md"):
        assert hookspecs.ENTRY_POINT_GROUP in (DOCS / doc).read_text()


@pytest.mark.parametrize(
    "needle",
    [
        TOKEN_ENV,
        TOKEN_FILE_ENV,
        DEFAULT_TOKEN_PATH,
        DISABLE_AUTOLOAD_ENV,
        LOAD_PLUGINS_ENV,
        *sorted(RESERVED_NAMES),
    ],
)
def test_variables_paths_and_reserved_names_are_documented(needle: str) -> None:
    assert needle in (DOCS / "credentials.md").read_text()
