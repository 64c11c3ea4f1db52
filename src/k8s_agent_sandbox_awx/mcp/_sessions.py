"""The sandboxes the MCP server works with and the MCP sessions that own a default one.

- :class:`Sandboxes`: one ``AsyncSandbox`` handle per sandbox name for the whole server (all
  sessions act with its one identity): created here (kept alive while used), or attached to
  by name on first use.
- :class:`Session`: one MCP session's default sandbox, created on the first call that names no
  sandbox (one create, however many calls race for it) and deleted by :meth:`Session.close`
  when the session ends; a create still running then is cancelled, which deletes its claim.
- :class:`Sessions`: the sessions of HTTP mode by their ``Mcp-Session-Id``; over stdio the
  process is the one session.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from ..client._async_client import AsyncSandbox
from ..client.http._config import ENV_KEEPALIVE, BrokerConnectionConfig

__all__ = ["DEFAULT_KEEPALIVE", "NoSession", "Sandboxes", "Session", "SessionEnded", "Sessions"]

logger = logging.getLogger("k8s_agent_sandbox_awx.mcp")

DEFAULT_KEEPALIVE = 900
"""Seconds of the activity keepalive of the sandboxes the server creates, unless
``AGENT_SANDBOX_KEEPALIVE_TTL_SECONDS`` sets another (``0``: off): while tools use a sandbox
its deadline moves to 15 minutes from now, within the policy's cap, so an agent's session does
not lose its sandbox after the default 300 s; an idle one still expires."""
KILL_TIMEOUT = 10.0
"""Seconds the deletion of a session's default sandbox may take when the session ends."""
_ENDED_REMEMBERED = 1000


class SessionEnded(Exception):
    """The MCP session ended (its default sandbox deleted) while a call still wanted it."""


class Sandboxes:
    """Handles by sandbox name, for every session of the server (see the module)."""

    def __init__(self, config: BrokerConnectionConfig) -> None:
        self.config = config
        self.keepalive = (
            config.sandbox_keepalive if os.environ.get(ENV_KEEPALIVE) else DEFAULT_KEEPALIVE
        )
        self._handles: dict[str, AsyncSandbox] = {}
        self._contexts: dict[tuple[str, str], str] = {}
        self._contexts_lock = asyncio.Lock()

    async def code_context(
        self, sandbox: AsyncSandbox, name: str | None, language: str
    ) -> str | None:
        """The id of the code context an agent calls ``name`` in ``sandbox`` (created there on
        first use); ``None`` (and ``"default"``): the sandbox's default context."""
        if name is None or name == "default":
            return None
        async with self._contexts_lock:  # one create per name, however many calls race
            key = (sandbox.name, name)
            if key not in self._contexts:
                context = await sandbox.create_code_context(language=language)
                self._contexts[key] = context.id
            return self._contexts[key]

    async def create(
        self,
        template: str | None = None,
        lifetime: int | None = None,
        envs: Mapping[str, str] | None = None,
    ) -> AsyncSandbox:
        """A new sandbox (``lifetime``: its ``timeout=``, seconds)."""
        options: dict[str, Any] = {"config": self.config, "keepalive": self.keepalive}
        if lifetime is not None:
            options["timeout"] = lifetime
        if envs:
            options["envs"] = dict(envs)
        sandbox = await AsyncSandbox.create(template, **options)
        self._handles[sandbox.name] = sandbox
        return sandbox

    async def get(self, name: str) -> AsyncSandbox:
        """The handle of sandbox ``name`` (attached now if this server has none: it must be
        one of this identity's sandboxes, Ready within 30 s)."""
        handle = self._handles.get(name)
        if handle is not None and handle.is_active:
            return handle
        attached = await AsyncSandbox.connect(name, config=self.config)
        handle = self._handles.get(name)
        if handle is not None and handle.is_active:  # another call attached meanwhile
            await attached.close_connection()
            return handle
        self._handles[name] = attached
        return attached

    async def kill(self, name: str) -> bool:
        """Delete sandbox ``name``; ``False`` if it was already gone."""
        handle = self._handles.get(name)
        self.forget(name)
        if handle is not None and handle.is_active:
            return await handle.kill()
        return await AsyncSandbox.kill(name, config=self.config)

    def forget(self, name: str) -> None:
        """Drop the handle of a sandbox found gone (or killed), and its code contexts."""
        self._handles.pop(name, None)
        for key in [key for key in self._contexts if key[0] == name]:
            del self._contexts[key]

    async def close(self) -> None:
        """Stop using every handle (the sandboxes keep running: only a session's default one
        is deleted, by its session)."""
        handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            try:
                await handle.close_connection()
            except Exception as exc:  # closing connections only: nothing is left behind
                logger.debug("closing the handle of sandbox %s: %s", handle.name, exc)


class Session:
    """One MCP session's default sandbox (see the module)."""

    def __init__(self, sandboxes: Sandboxes, label: str) -> None:
        self._sandboxes = sandboxes
        self.label = label
        self.closed = False
        self._sandbox: AsyncSandbox | None = None
        self._creating: asyncio.Task[AsyncSandbox] | None = None

    @property
    def default_name(self) -> str | None:
        """The name of the session's default sandbox (``None``: none yet, or it was killed)."""
        return self._sandbox.name if self._sandbox is not None else None

    async def default(self) -> AsyncSandbox:
        """The session's default sandbox, created on first use."""
        if self.closed:
            raise SessionEnded(f"the MCP session {self.label} ended; start a new one")
        if self._sandbox is not None:
            return self._sandbox
        if self._creating is None:
            self._creating = asyncio.get_running_loop().create_task(self._create())
        # shielded: a caller that gives up (a cancelled request) leaves the create to the others
        return await asyncio.shield(self._creating)

    async def _create(self) -> AsyncSandbox:
        try:
            sandbox = await self._sandboxes.create()
        finally:
            self._creating = None
        if self.closed:  # ended while it was being created: it must not outlive the session
            await self._sandboxes.kill(sandbox.name)
            raise SessionEnded(f"the MCP session {self.label} ended; start a new one")
        self._sandbox = sandbox
        logger.info("session %s: default sandbox %s created", self.label, sandbox.name)
        return sandbox

    def forget_default(self, name: str) -> bool:
        """Forget the default sandbox ``name`` (it was killed or found gone): the next call
        that names no sandbox creates a new one. Whether ``name`` was the default."""
        if self._sandbox is None or self._sandbox.name != name:
            return False
        self._sandbox = None
        self._sandboxes.forget(name)
        return True

    async def close(self) -> None:
        """The session ended: delete its default sandbox (a create still running is cancelled,
        which deletes its claim), within :data:`KILL_TIMEOUT`."""
        if self.closed:
            return
        self.closed = True
        creating, sandbox, self._sandbox = self._creating, self._sandbox, None
        if creating is not None:
            creating.cancel()
            await asyncio.wait({creating}, timeout=KILL_TIMEOUT)
        if sandbox is None:
            return
        try:
            async with asyncio.timeout(KILL_TIMEOUT):
                await self._sandboxes.kill(sandbox.name)
        except Exception as exc:
            logger.error(
                "session %s ended, but its default sandbox %s could not be deleted (it ends "
                "with its lifetime): %s",
                self.label,
                sandbox.name,
                exc,
            )
        else:
            logger.info(
                "session %s ended: its default sandbox %s deleted", self.label, sandbox.name
            )


class NoSession(Session):
    """A connection without an MCP session (the sessionless 2026-07-28 protocol over HTTP):
    no default sandbox, calls must name one."""

    async def default(self) -> AsyncSandbox:
        raise SessionEnded(
            "this connection has no MCP session (the 2026-07-28 protocol over HTTP is "
            "sessionless), so there is no default sandbox: create one with create_sandbox and "
            "pass its name as `sandbox` (kill_sandbox deletes it when you are done)"
        )


class Sessions:
    """HTTP mode's sessions by ``Mcp-Session-Id`` (see the module)."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self._sandboxes = sandboxes
        self._open: dict[str, Session] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self.closed = False

    def get(self, session_id: str) -> Session:
        session = self._open.get(session_id)
        if session is None:
            session = Session(self._sandboxes, session_id[:8])
            if self.closed or session_id in self._ended:
                session.closed = True  # its calls are refused: it ended
            else:
                self._open[session_id] = session
        return session

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._open

    async def end(self, session_id: str) -> None:
        session = self._open.pop(session_id, None)
        self._ended[session_id] = None
        while len(self._ended) > _ENDED_REMEMBERED:
            self._ended.popitem(last=False)
        if session is not None:
            await session.close()

    async def end_all(self) -> None:
        self.closed = True
        await asyncio.gather(*(self.end(sid) for sid in list(self._open)))
