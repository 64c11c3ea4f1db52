"""Whether the router answers: the router data plane's part of ``/readyz`` (docs/broker/
operate.md, "When an upstream is down").

Every :data:`PROBE_SECONDS` (every :data:`RETRY_SECONDS` while it fails) the broker sends the
router ``GET /`` with its own router credential, as on every request, and no ``X-Sandbox-*``
header, with a :data:`PROBE_TIMEOUT`: upstream's Python router checks the token first (``401``
when it is not its ``ROUTER_AUTH_TOKEN``), then refuses the request for its missing
``X-Sandbox-ID`` (``400``), so the probe reaches no sandbox and proves both the address and
the credential (its ``/healthz`` would answer ``200`` to any token). Any HTTP answer is a
router that answers, but ``401`` and ``403``: a router that refuses the broker's credential
serves no request. Until the router has answered once since start the replica is not ready (a wrong
``router_url`` or credential stops a rollout with the old pods serving); after that an outage
is ``degraded``, not unready: the router is one Service for every replica, so taking them all
out of the broker's Service would not bring it back and would refuse the control plane too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

import httpx

from .._interface import BackendUnavailable
from ._routes import RouterToken, RouteSettings

__all__ = ["PROBE_SECONDS", "RouterProbe"]

log = logging.getLogger("k8s_agent_sandbox_awx.broker.kubernetes")

PROBE_SECONDS: Final = 10.0
"""How often the router is asked while it answers."""
RETRY_SECONDS: Final = 2.0
"""How often while it does not."""
PROBE_TIMEOUT: Final = 5.0
"""Seconds the router has to answer a probe."""


class RouterProbe:
    """The router of ``settings`` (``data_plane = "router"``), asked over ``http`` (the data
    plane's client: its TLS trust is ``router_ca_file``'s)."""

    def __init__(self, settings: RouteSettings, http: httpx.AsyncClient) -> None:
        self.url = (settings.router_url or "").rstrip("/")
        self._http = http
        self._token = (
            None if settings.router_token_file is None else RouterToken(settings.router_token_file)
        )
        self.answered_once = False
        """Whether the router answered once since start."""
        self.problem: str | None = f"the router at {self.url} has not been asked yet"
        """Why the router does not serve now (``None``: it answered the last probe)."""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            problem = await self.check()
            self._note(problem)
            await asyncio.sleep(RETRY_SECONDS if problem else PROBE_SECONDS)

    def _note(self, problem: str | None) -> None:
        was, self.problem = self.problem, problem
        if problem is None:
            if was is not None and self.answered_once:
                log.info("the router at %s answers again", self.url)
            self.answered_once = True
        elif was is None:
            log.warning(
                "the router at %s does not answer: %s; the data plane fails until it does "
                "(/readyz names it under degraded)",
                self.url,
                problem,
            )
        elif not self.answered_once and was != problem:
            log.warning("not ready: %s", problem)

    async def check(self) -> str | None:
        """Ask the router once: ``None`` when it answers, else why not (never a token)."""
        where = f"the router at {self.url} (backend.kubernetes.router_url)"
        try:
            token = None if self._token is None else self._token.read()
            headers = {} if token is None else {"Authorization": f"Bearer {token}"}
            answer = await self._http.get(self.url + "/", headers=headers, timeout=PROBE_TIMEOUT)
        except BackendUnavailable as exc:  # the credential file
            return exc.detail
        except httpx.TimeoutException:
            return f"{where} did not answer within {PROBE_TIMEOUT:g} s"
        except httpx.HTTPError as exc:
            text = str(exc) or type(exc).__name__
            if "CERTIFICATE_VERIFY_FAILED" in text or "SSL" in text:
                return (
                    f"TLS with {where} failed ({text}): set backend.kubernetes.router_ca_file "
                    "to the CA that signed its certificate"
                )
            return f"nothing answers at {where}: {type(exc).__name__}: {text}"
        if answer.status_code in (401, 403):
            return (
                f"{where} refuses the broker's router credential ({answer.status_code}): "
                "backend.kubernetes.router_token_file must hold the router's ROUTER_AUTH_TOKEN"
            )
        return None
