"""The package's public surface: version and lazy exports."""

from __future__ import annotations

import subprocess
import sys

import pytest

import k8s_agent_sandbox_awx

pytestmark = pytest.mark.upstream  # errors built on upstream's, the import cost


def test_version_is_defined_once() -> None:
    from k8s_agent_sandbox_awx._version import __version__

    assert k8s_agent_sandbox_awx.__version__ == __version__


def test_import_does_not_load_upstream_or_httpx() -> None:
    code = (
        "import sys, k8s_agent_sandbox_awx; "
        "mods = ('k8s_agent_sandbox', 'httpx', 'kubernetes'); "
        "print(','.join(m for m in mods if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_all_lists_exactly_the_lazy_exports() -> None:
    from k8s_agent_sandbox_awx import testing

    assert sorted(k8s_agent_sandbox_awx.__all__) == sorted(
        ["__version__", *k8s_agent_sandbox_awx._EXPORTS]
    )
    assert sorted(testing.__all__) == sorted(
        ["EXTRA_HINT", "NO_ISOLATION_WARNING", *testing._EXPORTS]
    )


def test_every_public_name_resolves() -> None:
    for name in k8s_agent_sandbox_awx.__all__:
        assert getattr(k8s_agent_sandbox_awx, name) is not None, name


def test_sandbox_error_is_exported_and_catches_every_error() -> None:
    """docs/client.md: ``except SandboxError`` catches every error the SDK raises."""
    import inspect

    from k8s_agent_sandbox_awx import SandboxError
    from k8s_agent_sandbox_awx._upstream import SandboxError as UpstreamSandboxError

    assert SandboxError is UpstreamSandboxError
    assert "SandboxError" in k8s_agent_sandbox_awx.__all__
    from k8s_agent_sandbox_awx import errors as module

    errors = [
        value
        for name in module.__all__
        if inspect.isclass(value := getattr(module, name))
        and issubclass(value, Exception)
        and not issubclass(value, Warning)
    ]
    assert len(errors) > 20
    assert all(issubclass(e, SandboxError) for e in errors), errors


def test_errors_live_in_one_public_module_and_keep_their_old_names() -> None:
    """Every error is in ``k8s_agent_sandbox_awx.errors``; the top level lists where users start
    (SandboxError among them) and still resolves the old top-level error names."""
    from k8s_agent_sandbox_awx import errors

    assert "BrokerError" not in k8s_agent_sandbox_awx.__all__
    for name in errors.__all__:
        assert getattr(k8s_agent_sandbox_awx, name) is getattr(errors, name), name
    assert k8s_agent_sandbox_awx.SandboxError is errors.SandboxError


def test_every_error_survives_pickling_with_its_attributes_and_notes() -> None:
    """Errors cross processes pickled (``concurrent.futures.ProcessPoolExecutor``,
    ``multiprocessing``, pytest-xdist): each one comes back as the same class with the same
    message, attributes and notes, also those whose ``__init__`` requires keywords."""
    import copy
    import inspect
    import pickle

    from k8s_agent_sandbox_awx import errors

    classes = [
        obj
        for name in errors.__all__
        if isinstance(obj := getattr(errors, name), type) and issubclass(obj, BaseException)
    ]
    assert len(classes) > 20
    for cls in classes:
        required = {
            p.name: f"{p.name}-value"
            for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.default is p.empty
        }
        error = cls("what failed and what to do", **required)
        error.add_note("a note")
        for again in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
            assert type(again) is cls, cls
            assert str(again) == str(error) and again.args == error.args, cls
            assert vars(again) == vars(error), cls  # attributes and __notes__
