"""Plugin distributions built from source and pip-installed (offline) at test time, so that
importlib.metadata discovers their entry points exactly as in production."""

from __future__ import annotations

import contextlib
import importlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from k8s_agent_sandbox_awx import ENTRY_POINT_GROUP


class Distribution(NamedTuple):
    """A plugin distribution to build and install: ``modules`` maps a module name (in
    ``package``) to its source, ``entry_points`` an entry-point name to a module name."""

    name: str
    package: str
    modules: Mapping[str, str]
    entry_points: Mapping[str, str]


def _write_distribution(root: Path, dist: Distribution) -> None:
    root.mkdir(parents=True)
    (root / dist.package).mkdir()
    (root / dist.package / "__init__.py").write_text("")
    for module, source in dist.modules.items():
        (root / dist.package / f"{module}.py").write_text(source)
    entry_points = "\n".join(
        f'"{name}" = "{dist.package}.{target}"' for name, target in dist.entry_points.items()
    )
    (root / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""\
            [build-system]
            requires = ["hatchling"]
            build-backend = "hatchling.build"

            [project]
            name = "{dist.name}"
            version = "1.0"
            dependencies = []

            [project.entry-points."{ENTRY_POINT_GROUP}"]
            """
        )
        + entry_points
        + f'\n\n[tool.hatch.build.targets.wheel]\npackages = ["{dist.package}"]\n'
    )


@contextlib.contextmanager
def installed_distributions(
    base: Path, *specs: tuple[str, str, Mapping[str, str], Mapping[str, str]]
) -> Iterator[Path]:
    """Build the distributions ``specs`` (``(name, package, modules, entry_points)``, see
    :class:`Distribution`) from source and pip-install them (offline, no build isolation, hatchling
    from this environment) into ``base/site``, put on ``sys.path`` so that importlib.metadata
    discovers their entry points exactly as in production. Yields the target directory; on exit
    takes it off ``sys.path`` and forgets the imported modules."""
    dists = [Distribution(*spec) for spec in specs]
    for dist in dists:
        _write_distribution(base / f"src-{dist.name}", dist)
    target = base / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-index",
            "--no-build-isolation",
            "--no-deps",
            "--target",
            str(target),
            *(str(base / f"src-{dist.name}") for dist in dists),
        ],
        check=True,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PIP_NO_INDEX": "1", "HOME": str(base)},
    )
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        packages = tuple(dist.package for dist in dists)
        for name in list(sys.modules):
            if name.startswith(packages):
                del sys.modules[name]
        importlib.invalidate_caches()
