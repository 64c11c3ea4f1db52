"""Fixtures of the identity tests: a scripted OIDC issuer on loopback HTTPS (a CA made at test
time, real keys, real signed tokens; tests/_support/oidc_issuer.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from tests._support.oidc_issuer import ScriptedIssuer


@pytest_asyncio.fixture
async def issuer(tmp_path: Path) -> AsyncIterator[ScriptedIssuer]:
    async with ScriptedIssuer(tmp_path) as scripted:
        yield scripted
