"""A kubeconfig user's ``exec`` credential plugin: ``ExecCredential`` (a token source).

What a laptop's kubeconfig for EKS (``aws eks get-token``), GKE (``gke-gcloud-auth-plugin``) or
AKS (``kubelogin``) holds: a command that prints a ``client.authentication.k8s.io`` ExecCredential
with a bearer token. The rules are client-go's (``pkg/client/auth/exec``, the KEP-541 protocol),
where they make sense for a server:

- API versions ``client.authentication.k8s.io/v1`` and ``v1beta1`` (same shape; ``v1alpha1``
  is refused). ``interactiveMode`` is required with ``v1`` (``Never``, ``IfAvailable`` or
  ``Always``; ``v1beta1`` defaults to ``IfAvailable``): the broker has no terminal, so the plugin
  always runs with ``spec.interactive: false`` and standard input closed, and ``Always`` is
  refused when the kubeconfig is read.
- The plugin gets the broker's environment plus its ``env`` entries, and ``KUBERNETES_EXEC_INFO``
  (the ExecCredential request: ``apiVersion``, ``kind``, ``spec.interactive``, and with
  ``provideClusterInfo: true`` ``spec.cluster``: the ``server``, the CA as
  ``certificate-authority-data``, ``insecure-skip-tls-verify`` and the cluster's
  ``client.authentication.k8s.io/exec`` extension as ``config``). A ``command`` with a ``/`` is
  relative to the kubeconfig's folder; a bare name is looked up on ``PATH``.
- The answer must be an ExecCredential of the same ``apiVersion`` with ``status.token``
  (a client certificate, ``status.clientCertificateData``, is refused: this client's TLS
  settings are made once). The token is **cached** until ``status.expirationTimestamp`` (none:
  until the API server refuses it), and the plugin is **run again** when the API server answers
  ``401`` to the token it gave (the request is then sent once more with the new token).
- Bounded: the plugin must answer within :data:`PLUGIN_TIMEOUT_SECONDS` (else its process is
  killed) and print at most :data:`MAX_OUTPUT` bytes. One run at a time: concurrent requests
  wait for the same run.
- Secrets: the token is never in a message, a ``repr`` or a log record; the plugin's standard
  error is **never shown** (plugins print tokens and account details there) and its arguments
  are not named in messages (only the command): a failure says the exit code and how to run
  the plugin by hand to see why.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from ._api_errors import KubeConfigError

__all__ = ["API_VERSIONS", "MAX_OUTPUT", "PLUGIN_TIMEOUT_SECONDS", "ExecCredential", "ExecPlugin"]

API_VERSIONS: Final = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
INTERACTIVE_MODES: Final = ("Never", "IfAvailable", "Always")
PLUGIN_TIMEOUT_SECONDS: Final = 30.0
"""How long an exec plugin may take to print its credential (client-go waits forever; a
plugin that asks for a browser login would hold the broker's requests that long)."""
MAX_OUTPUT: Final = 1024 * 1024
EXTENSION: Final = "client.authentication.k8s.io/exec"
"""The cluster extension handed to the plugin as ``spec.cluster.config``."""


@dataclass(frozen=True, repr=False)
class ExecPlugin:
    """A kubeconfig user's ``exec`` settings, checked (see the module)."""

    command: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    api_version: str
    where: str
    """Where it was configured, for messages (``kubeconfig F: users[U].user.exec``)."""
    install_hint: str = ""
    cluster: Mapping[str, Any] | None = None
    """``spec.cluster`` of the request (``provideClusterInfo: true``), or ``None``."""
    timeout: float = PLUGIN_TIMEOUT_SECONDS
    folder: Path = field(default_factory=Path)

    def __repr__(self) -> str:
        return f"ExecPlugin({self.command!r}, {self.api_version!r})"

    def request(self) -> str:
        """``KUBERNETES_EXEC_INFO``: the ExecCredential the plugin is asked for."""
        spec: dict[str, Any] = {"interactive": False}
        if self.cluster is not None:
            spec["cluster"] = dict(self.cluster)
        return json.dumps({"apiVersion": self.api_version, "kind": "ExecCredential", "spec": spec})

    def argv(self) -> list[str]:
        command = self.command
        if os.sep in command and not os.path.isabs(command):
            command = str(self.folder / command)
        return [command, *self.args]


def cluster_info(
    cluster: Mapping[str, Any], server: str, ca_data: bytes | None, insecure: bool
) -> dict[str, Any]:
    """``spec.cluster`` for ``provideClusterInfo`` (client-go's ``Cluster`` of the request)."""
    info: dict[str, Any] = {"server": server}
    if ca_data:
        info["certificate-authority-data"] = base64.b64encode(ca_data).decode("ascii")
    if insecure:
        info["insecure-skip-tls-verify"] = True
    for item in cluster.get("extensions") or []:
        if isinstance(item, Mapping) and item.get("name") == EXTENSION:
            info["config"] = item.get("extension")
    return info


class ExecCredential:
    """The token an :class:`ExecPlugin` prints, cached until it expires or is refused."""

    def __init__(self, plugin: ExecPlugin, *, source: str) -> None:
        self.plugin = plugin
        self.source = source
        self._token: str | None = None
        self._expires: float | None = None
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self.runs = 0
        """How many times the plugin ran (for tests and messages)."""

    def __repr__(self) -> str:
        return f"ExecCredential({self.plugin.command!r}, source={self.source!r})"

    def read(self) -> str:
        """The cached token (the synchronous path has no plugin run: ``KubeConfigError``)."""
        if self._token is None or self._expired():
            raise KubeConfigError(
                f"{self.plugin.where}: the exec plugin's token is needed outside the event "
                "loop; use the asynchronous client",
                source=self.source,
            )
        return self._token

    def _expired(self) -> bool:
        return self._expires is not None and time.time() >= self._expires

    def _guard(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    async def token(self, *, refused: str | None = None) -> str:
        """The token to send: the cached one, or (none, expired, or ``refused``: the one the
        API server answered 401 to, still cached) a new one from the plugin."""
        async with self._guard():
            stale = self._token is None or self._expired() or self._token == refused
            if stale:
                self._token, self._expires = await self._run()
            assert self._token is not None
            return self._token

    async def _run(self) -> tuple[str, float | None]:
        self.runs += 1
        plugin = self.plugin
        env = {**os.environ, **dict(plugin.env), "KUBERNETES_EXEC_INFO": plugin.request()}
        try:
            process = await asyncio.create_subprocess_exec(
                *plugin.argv(),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            hint = f" ({plugin.install_hint.strip()})" if plugin.install_hint.strip() else ""
            raise self._error(
                f"cannot be started ({exc.strerror or type(exc).__name__}){hint}: install it, "
                "or give its full path in the kubeconfig"
            ) from None
        output = await self._output(process)
        return self._parse(output)

    async def _output(self, process: asyncio.subprocess.Process) -> bytes:
        assert process.stdout is not None
        try:
            async with asyncio.timeout(self.plugin.timeout):
                output = b""
                while len(output) <= MAX_OUTPUT and (chunk := await process.stdout.read(65536)):
                    output += chunk
                if len(output) <= MAX_OUTPUT:
                    await process.wait()
        except TimeoutError:
            _kill(process)
            await process.wait()
            raise self._error(
                f"did not print a credential within {self.plugin.timeout:g} s and was stopped: "
                "run it by hand to see whether it waits for a login"
            ) from None
        if len(output) > MAX_OUTPUT:
            _kill(process)
            await process.wait()
            raise self._error(f"printed more than {MAX_OUTPUT} bytes: it is not a credential")
        if process.returncode != 0:
            raise self._error(
                f"exited with code {process.returncode} (its standard error is not shown: it "
                "may hold secrets); run the command by hand to see why"
            )
        return output

    def _parse(self, output: bytes) -> tuple[str, float | None]:
        try:
            answer = json.loads(output)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or answer.get("kind") != "ExecCredential":
            raise self._error("did not print an ExecCredential (JSON) on its standard output")
        if answer.get("apiVersion") != self.plugin.api_version:
            raise self._error(
                f"answered apiVersion {str(answer.get('apiVersion'))[:80]!r}, not the "
                f"{self.plugin.api_version!r} the kubeconfig asks for"
            )
        found: Any = answer.get("status")
        status: dict[str, Any] = found if isinstance(found, dict) else {}
        token = status.get("token")
        if status.get("clientCertificateData") and not token:
            raise self._error(
                "gave a client certificate, which this client does not take from a plugin: "
                "use a plugin or an option of it that prints a token"
            )
        if not isinstance(token, str) or not token.strip():
            raise self._error("printed an ExecCredential without status.token")
        if any(not ("!" <= c <= "~") for c in token.strip()):
            raise self._error("printed a token with characters a token cannot have")
        return token.strip(), _expiry(status.get("expirationTimestamp"), self._error)

    def _error(self, what: str) -> KubeConfigError:
        return KubeConfigError(
            f"{self.plugin.where}: the exec credential plugin {self.plugin.command!r} {what}",
            source=self.source,
            key="exec",
        )


def _kill(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _expiry(value: Any, error: Any) -> float | None:
    if value is None or value == "":
        return None
    try:
        moment = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise error(f"printed expirationTimestamp {str(value)[:40]!r}, which is not RFC 3339")
    return moment.timestamp()


def exec_plugin(
    spec: Mapping[str, Any],
    *,
    where: str,
    folder: Path,
    cluster: Mapping[str, Any] | None,
    source: str,
) -> ExecPlugin:
    """The checked :class:`ExecPlugin` of a kubeconfig user's ``exec`` mapping (``cluster``:
    ``spec.cluster`` when it asks for ``provideClusterInfo``, else ignored)."""

    def bad(key: str, rule: str) -> KubeConfigError:
        return KubeConfigError(f"{where}.{key} {rule}", source=source, key=f"exec.{key}")

    version = spec.get("apiVersion")
    if version not in API_VERSIONS:
        raise bad("apiVersion", f"must be one of {', '.join(API_VERSIONS)} (v1alpha1 is gone)")
    command = spec.get("command")
    if not isinstance(command, str) or not command.strip():
        raise bad("command", "must name the plugin's command (e.g. aws, gke-gcloud-auth-plugin)")
    mode = spec.get("interactiveMode", None if version.endswith("/v1") else "IfAvailable")
    if mode not in INTERACTIVE_MODES:
        modes = ", ".join(INTERACTIVE_MODES)
        raise bad("interactiveMode", f"must be one of {modes} with {version}")
    if mode == "Always":
        raise bad(
            "interactiveMode",
            "is Always: the plugin needs a terminal, and the broker has none; use a plugin "
            "setting that logs in without one (a service account, a cached login)",
        )
    return ExecPlugin(
        command=command.strip(),
        args=_strings(spec.get("args"), bad),
        env=_env(spec.get("env"), bad),
        api_version=version,
        where=where,
        install_hint=str(spec.get("installHint") or ""),
        cluster=cluster if spec.get("provideClusterInfo") is True else None,
        folder=folder,
    )


def _strings(value: Any, bad: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad("args", "must be a list of strings")
    return tuple(value)


def _env(value: Any, bad: Any) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    entries: Sequence[Any] = value if isinstance(value, list) else [None]
    out = []
    for entry in entries:
        if not (
            isinstance(entry, Mapping)
            and isinstance(entry.get("name"), str)
            and entry["name"]
            and isinstance(entry.get("value"), str)
        ):
            raise bad("env", "must be a list of {name, value} strings")
        out.append((entry["name"], entry["value"]))
    return tuple(out)
