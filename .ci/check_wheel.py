"""Check what a built wheel carries: what it must contain and what it must never contain."""

from __future__ import annotations

import sys
import zipfile

REQUIRED_CORE = (
    "k8s_agent_sandbox_awx/py.typed",
    "k8s_agent_sandbox_awx/broker/openapi.json",
)
TEST_DIRS = {"tests", "test", "testdata"}
CACHE_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
FORBIDDEN_SUFFIXES = (".pyc", ".pem", ".key", ".crt", ".p12")


def check(path: str) -> list[str]:
    problems: list[str] = []
    with zipfile.ZipFile(path) as wheel:
        names = wheel.namelist()
        for name in names:
            segments = set(name.split("/")[:-1])
            if segments & TEST_DIRS or name.split("/")[-1].startswith(("test_", "conftest")):
                problems.append(f"{name}: tests do not belong in a wheel")
            if segments & CACHE_DIRS:
                problems.append(f"{name}: caches do not belong in a wheel")
            if name.endswith(FORBIDDEN_SUFFIXES):
                problems.append(f"{name}: compiled files, keys and certificates do not belong here")
            if not name.endswith("/") and b"PRIVATE KEY-----" in wheel.read(name):
                problems.append(f"{name}: contains a private key")
        if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
            problems.append("the LICENSE file is missing from .dist-info/licenses/")
        is_core = path.rsplit("/", 1)[-1].startswith("k8s_agent_sandbox_awx-")
        required = REQUIRED_CORE if is_core else ()
        problems.extend(f"{r} is missing" for r in required if r not in names)
        if not any(n.endswith("/py.typed") for n in names):
            problems.append("py.typed is missing")
    return problems


def main() -> int:
    failed = False
    for path in sys.argv[1:]:
        problems = check(path)
        print(f"{path}: {'ok' if not problems else 'FAILED'}")
        for problem in problems:
            print(f"  - {problem}")
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
