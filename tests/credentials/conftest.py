"""Shared fixtures for the credential framework tests: test JWTs, a fake clock, isolation."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import importlib
import json
import os
import secrets
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from k8s_agent_sandbox_awx import ENTRY_POINT_GROUP, clear_credential_cache
from k8s_agent_sandbox_awx.credentials import _cache, _plugins

BROKER = "https://sandbox-broker.example"
T0 = 1_900_000_000.0  # the fake clock's starting point (2030-03-17)


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def make_jwt(
    aud: str | list[str] | None = BROKER,
    *,
    now: float | None = None,
    ttl: float | None = 3600,
    header: dict[str, Any] | None = None,
    **claims: Any,
) -> str:
    """A correctly formatted HS256 JWT (signed with a throw-away key; the client never verifies)."""
    issued = T0 if now is None else now
    payload: dict[str, Any] = {
        "iss": "https://issuer.example",
        "sub": "system:serviceaccount:team:agent",
        "iat": int(issued),
        "nbf": int(issued),
        "jti": secrets.token_hex(8),
    }
    if aud is not None:
        payload["aud"] = aud
    if ttl is not None:
        payload["exp"] = int(issued + ttl)
    payload.update(claims)
    head = {"alg": "HS256", "typ": "JWT", **(header or {})}
    signing_input = f"{b64url(json.dumps(head).encode())}.{b64url(json.dumps(payload).encode())}"
    key = secrets.token_bytes(32)
    signature = hmac.new(key, signing_input.encode("ascii"), hashlib.sha256).digest()
    return f"{signing_input}.{b64url(signature)}"


def assert_no_secret(token: str, *texts: str) -> None:
    """Neither the token nor its signature part appears in any of ``texts``."""
    parts = [token]
    if token.count(".") == 2 and len(token.rsplit(".", 1)[1]) >= 8:
        parts.append(token.rsplit(".", 1)[1])
    for text in texts:
        for part in parts:
            assert part not in text


class FakeClock:
    def __init__(self, start: float = T0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def _isolated_cache() -> Iterator[None]:
    clear_credential_cache()
    _plugins.reset_default_registry()
    yield
    clear_credential_cache()
    _plugins.reset_default_registry()


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """Every test runs on a fake wall clock starting at ``T0`` (tokens are minted against it)."""
    fake = FakeClock()
    monkeypatch.setattr(_cache, "_clock", fake)
    return fake


@pytest.fixture
def missing_path(tmp_path: Path) -> str:
    """A default projected token path that does not exist."""
    return str(tmp_path / "no-such-dir" / "agent-sandbox-token")


@pytest.fixture
def base_env() -> dict[str, str]:
    """An environment with entry-point plugins switched off (installed plugins stay out)."""
    return {"AGENT_SANDBOX_LOAD_PLUGINS": ""}


def write_projected(directory: Path, token: str, generation: int) -> Path:
    """Lay out (or rotate) a token like the kubelet does: ``..<ts>/token``, ``..data`` swapped
    atomically by rename, ``token -> ..data/token``. Returns the stable path."""
    data_dir = directory / f"..2030_03_17_00_00_0{generation}.{generation:06d}"
    data_dir.mkdir()
    (data_dir / "token").write_text(token)
    tmp_link = directory / "..data_tmp"
    os.symlink(data_dir.name, tmp_link)
    previous = os.readlink(directory / "..data") if (directory / "..data").is_symlink() else None
    os.rename(tmp_link, directory / "..data")  # atomic swap
    stable = directory / "token"
    if not stable.is_symlink():
        os.symlink("..data/token", stable)
    if previous is not None:
        for child in (directory / previous).iterdir():
            child.unlink()
        (directory / previous).rmdir()
    return stable


Minter = Callable[..., str]


@pytest.fixture
def mint() -> Minter:
    """``mint(aud=BROKER, now=T0, ttl=3600, header=None, **claims) -> str``: a test JWT."""
    return make_jwt


@pytest.fixture
def projected() -> Callable[[Path, str, int], Path]:
    """``projected(directory, token, generation) -> stable path``: kubelet-style layout/rotation."""
    return write_projected


@pytest.fixture
def no_secret() -> Callable[..., None]:
    """``no_secret(token, *texts)``: asserts the token (and its signature) appear in none."""
    return assert_no_secret


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


@pytest.fixture(scope="session")
def install_distributions() -> Callable[..., contextlib.AbstractContextManager[Path]]:
    """``with install_distributions(base, Distribution(...), ...) as site:`` (see
    :func:`installed_distributions`)."""
    return installed_distributions
