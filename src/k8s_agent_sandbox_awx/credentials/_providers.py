"""The built-in credential providers: ordinary pluggy plugins under reserved names.

==========================  ==============================================  ===========
reserved name               looks at                                        file-backed
==========================  ==============================================  ===========
``agent-sandbox-token``     ``AGENT_SANDBOX_TOKEN`` (a token)               no (cached)
``agent-sandbox-token-file`` ``AGENT_SANDBOX_TOKEN_FILE`` (a path)          yes
``kubernetes-projected``    ``/var/run/secrets/tokens/agent-sandbox-token``  yes
==========================  ==============================================  ===========

The host (``_chain``) decides the order; the providers only answer. The file helpers here are
also used by :class:`~k8s_agent_sandbox_awx.KubernetesAuth`.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Mapping
from typing import ClassVar, Final

from .._local_dev import stopped_dev_token
from ._credential import Credential, CredentialRequest, ProviderInfo
from ._credential_errors import (
    EmptyCredentialError,
    ForbiddenTokenSourceError,
    MalformedTokenError,
    UnreadableCredentialError,
)
from ._hookspecs import hookimpl
from ._jwt import MAX_TOKEN_CHARS, check_token_text

__all__ = [
    "AUTOMOUNT_DIRS",
    "DEFAULT_TOKEN_PATH",
    "ENV_TOKEN_PROVIDER",
    "PROJECTED_PROVIDER",
    "RESERVED_NAMES",
    "TOKEN_ENV",
    "TOKEN_ENVS",
    "TOKEN_FILE_ENV",
    "TOKEN_FILE_ENVS",
    "TOKEN_FILE_PROVIDER",
    "EnvTokenProvider",
    "ProjectedTokenProvider",
    "TokenFileProvider",
    "check_not_automounted",
    "env_setting",
    "read_token_file",
]

TOKEN_ENV = "AGENT_SANDBOX_TOKEN"  # noqa: S105
TOKEN_FILE_ENV = "AGENT_SANDBOX_TOKEN_FILE"  # noqa: S105
TOKEN_ENVS = (TOKEN_ENV, "BROKER_TOKEN")
"""Where a token is read from, first set wins (the original package's name after ours)."""
TOKEN_FILE_ENVS = (
    TOKEN_FILE_ENV,
    "AGENT_SANDBOX_TOKEN_PATH",
    "BROKER_TOKEN_PATH",
    "KSA_TOKEN_PATH",
)
"""Where a token file's path is read from, first set wins (the original package's names, in
its order, after ours)."""
DEFAULT_TOKEN_PATH = "/var/run/secrets/tokens/agent-sandbox-token"  # noqa: S105

ENV_TOKEN_PROVIDER = "agent-sandbox-token"  # noqa: S105
TOKEN_FILE_PROVIDER = "agent-sandbox-token-file"  # noqa: S105
PROJECTED_PROVIDER = "kubernetes-projected"
RESERVED_NAMES = frozenset({ENV_TOKEN_PROVIDER, TOKEN_FILE_PROVIDER, PROJECTED_PROVIDER})

AUTOMOUNT_DIRS = (
    "/var/run/secrets/kubernetes.io/serviceaccount",
    "/run/secrets/kubernetes.io/serviceaccount",
)
"""Where Kubernetes automounts the API-server token. Nothing under these is ever read."""

_PROJECTED_HOWTO = (
    "Mount a projected ServiceAccount token whose audience is the broker URL instead: a "
    "'projected' volume with a 'serviceAccountToken' source (audience: <broker URL>, "
    f"path: agent-sandbox-token) mounted at {os.path.dirname(DEFAULT_TOKEN_PATH)}."
)


def env_setting(
    environ: Mapping[str, str], name: str, *, provider: str, source: str, fix: str
) -> str | None:
    """The value of the environment variable ``name``, or ``None`` when it is not set.

    Set but blank is a mistake, never "not set": :class:`EmptyCredentialError` saying
    ``"<name> is set but empty. <fix>"``.
    """
    value = environ.get(name)
    if value is not None and not value.strip():
        raise EmptyCredentialError(
            f"{name} is set but empty. {fix}", provider=provider, source=source
        )
    return value


def _first_set(environ: Mapping[str, str], names: tuple[str, ...]) -> str:
    """The first of ``names`` set in ``environ`` (else the first name)."""
    return next((name for name in names if name in environ), names[0])


def _provider_setting(
    request: CredentialRequest, names: tuple[str, ...], *, provider: str, fix: str
) -> tuple[str, str | None]:
    """:func:`env_setting` for a provider in the chain, from the first of ``names`` that is set:
    ``(name, value)``; unset is "not here" (recorded on the request, value ``None``); the fix
    for a blank value also offers unsetting it."""
    name = _first_set(request.environ, names)
    value = env_setting(
        request.environ,
        name,
        provider=provider,
        source=name,
        fix=f"{fix}, or unset it so that discovery continues with the other providers.",
    )
    if value is None:
        request.not_here(f"{names[0]} is not set")  # nor its aliases
    return name, value


@functools.lru_cache(maxsize=1)
def _forbidden_dirs() -> tuple[frozenset[str], tuple[str, ...]]:
    """The automount directories (as given and resolved), and the prefixes of what is in them."""
    dirs = set(AUTOMOUNT_DIRS)
    dirs.update(os.path.realpath(d) for d in AUTOMOUNT_DIRS)
    return frozenset(dirs), tuple(sorted(d + os.sep for d in dirs))


def _under_forbidden_dir(candidate: str) -> bool:
    dirs, inside = _forbidden_dirs()
    return candidate in dirs or candidate.startswith(inside)


def _is_automounted(path: str) -> bool:
    # Not memoised: a relative path depends on the current directory, and a symlink (or the
    # directories on the way) can be re-pointed between two reads of a file source.
    candidates = {os.path.normpath(os.path.abspath(path)), os.path.realpath(path)}
    return any(_under_forbidden_dir(c) for c in candidates)


def _opened_path(fd: int, path: str) -> str:
    """Where the file behind ``fd`` really is: what was opened, not what the path says now.

    On Linux one ``readlink`` of ``/proc/self/fd/N`` (about 1 µs, and free of the race between
    resolving a path and opening it); elsewhere ``realpath`` of the path (several µs).
    """
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return os.path.realpath(path)


_OUTSIDE: dict[tuple[int, int, int, int], object] = {}
"""Files found outside the automount directories by :func:`_opened_path`: their identity
(device, inode, change and modification times in ns) -> the :func:`_forbidden_dirs` they were
checked against. An open fd whose file has that identity is that very file (its inode cannot be
another file's while the times match), where it was when it was checked."""
_OUTSIDE_MAX: Final = 64


def _opened_outside(fd: int, path: str) -> bool:
    """Whether the file behind ``fd`` (opened from ``path``) is outside the automount
    directories: :func:`_opened_path` checked (a ``readlink`` of ``/proc/self/fd/N``, 10 µs
    or more between two requests' network I/O) unless ``fstat`` finds the file that check
    passed last (the kubelet's rotation writes a new file: checked once per rotation; the
    directories changed: checked again)."""
    forbidden = _forbidden_dirs()
    st = os.fstat(fd)
    identity = (st.st_dev, st.st_ino, st.st_ctime_ns, st.st_mtime_ns)
    if _OUTSIDE.get(identity) is forbidden:
        return True
    if _under_forbidden_dir(_opened_path(fd, path)):
        return False
    if len(_OUTSIDE) >= _OUTSIDE_MAX:
        _OUTSIDE.clear()
    _OUTSIDE[identity] = forbidden
    return True


def check_not_automounted(path: str, *, provider: str, source: str) -> None:
    """Refuse a path in (or resolving into) the automounted ServiceAccount token directory.

    The literal path and its ``realpath`` are both checked, afresh on every call: file
    sources call it before every read (:func:`read_token_file`).
    """
    if _is_automounted(path):
        raise _forbidden(path, provider=provider, source=source)


def _forbidden(path: str, *, provider: str, source: str) -> ForbiddenTokenSourceError:
    return ForbiddenTokenSourceError(
        f"{source or path} points into the automounted ServiceAccount directory "
        f"({AUTOMOUNT_DIRS[0]}). That token's audience is the Kubernetes API server: "
        "presenting it to the broker would hand a cluster credential to another service, "
        f"so it is never read. {_PROJECTED_HOWTO}",
        provider=provider,
        source=source or path,
    )


def read_token_file(path: str, *, provider: str, source: str, missing_ok: bool) -> str | None:
    """Read a token file afresh (one open/read/close); ``None`` if missing and ``missing_ok``.

    Opening the path on each call follows the kubelet's ``..data`` symlink to whichever
    timestamped directory is current, so a rotation is seen on the next read. The automount
    rule (:func:`check_not_automounted`) is checked before each read, where the path resolves
    now: the literal path before opening, and the file actually opened right after (so a symlink
    re-pointed into the automount directory is refused, without a ``realpath`` on every read;
    the file that passed that check last is known again by its ``fstat``: :func:`_opened_outside`).
    """
    if _under_forbidden_dir(os.path.abspath(path)):  # abspath normalises too
        raise _forbidden(path, provider=provider, source=source)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError) as exc:
        check_not_automounted(path, provider=provider, source=source)  # a dangling link into it
        if missing_ok:
            return None
        if isinstance(exc, NotADirectoryError):
            raise _unreadable(path, source, provider, exc) from None
        raise UnreadableCredentialError(
            stopped_dev_token(path)  # the token of `agent-sandbox-awx dev`, stopped since
            or f"The token file {path} ({source}) does not exist. Create it, point the setting "
            f"at the right file, or remove the setting. {_PROJECTED_HOWTO}",
            provider=provider,
            source=source,
        ) from None
    except OSError as exc:
        check_not_automounted(path, provider=provider, source=source)
        raise _unreadable(path, source, provider, exc) from None
    try:
        if not _opened_outside(fd, path):
            raise _forbidden(path, provider=provider, source=source)
        data = os.read(fd, MAX_TOKEN_CHARS + 2)
    except OSError as exc:
        raise _unreadable(path, source, provider, exc) from None
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_CHARS + 1:
        raise MalformedTokenError(
            f"The token file {path} ({source}) is larger than {MAX_TOKEN_CHARS} bytes; it must "
            "hold a single OIDC token.",
            provider=provider,
            source=source,
        )
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise MalformedTokenError(
            f"The token file {path} ({source}) contains non-ASCII bytes; it must hold a single "
            "OIDC token (a JWT) and nothing else.",
            provider=provider,
            source=source,
        ) from None


def _unreadable(path: str, source: str, provider: str, exc: OSError) -> UnreadableCredentialError:
    code = errno.errorcode.get(exc.errno or 0, "error")
    reason = exc.strerror or type(exc).__name__
    return UnreadableCredentialError(
        f"The token file {path} ({source}) exists but cannot be read: {reason} ({code}). "
        "Check that it is a regular file readable by this process (user, group, fsGroup "
        "and defaultMode of the volume).",
        provider=provider,
        source=source,
    )


class _EnvSettingProvider:
    """The shape of a provider found by an environment setting (the first of :attr:`envs`
    set): its info, the check of the setting, its presence test; :meth:`_credential` makes
    the credential of the value set."""

    name: ClassVar[str]
    file_backed: ClassVar[bool]
    envs: ClassVar[tuple[str, ...]]
    """The variables it reads, the first set wins."""
    fix: ClassVar[str]
    """What the error of a variable set but blank says to do."""
    hint: ClassVar[str]
    description: ClassVar[str]

    @hookimpl
    def agent_sandbox_provider_info(self) -> ProviderInfo:
        return ProviderInfo(priority=0, hint=self.hint, description=self.description)

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential | None:
        name, value = _provider_setting(request, self.envs, provider=self.name, fix=self.fix)
        if value is None:
            return None
        return self._credential(name, value)

    def _credential(self, name: str, value: str) -> Credential:
        """The credential of ``value``, the setting of the variable ``name``."""
        raise NotImplementedError

    def present(self, environ: Mapping[str, str]) -> str | None:
        """A cheap presence test (no read) used to log shadowed sources."""
        name = _first_set(environ, self.envs)
        return f"{name} is set" if name in environ else None


class EnvTokenProvider(_EnvSettingProvider):
    """``AGENT_SANDBOX_TOKEN``: a token in the environment (GitLab CI ``id_tokens:``)."""

    name = ENV_TOKEN_PROVIDER
    file_backed = False
    envs = TOKEN_ENVS
    fix = "Set it to an OIDC token whose aud is the broker URL"
    hint = (
        f"set {TOKEN_ENV} to an OIDC token whose aud is the broker URL "
        "(GitLab CI: 'id_tokens: AGENT_SANDBOX_TOKEN: aud: <broker URL>')"
    )
    description = "a token in the environment variable AGENT_SANDBOX_TOKEN"

    def _credential(self, name: str, value: str) -> Credential:
        token = check_token_text(value, provider=self.name, source=name)
        return Credential(token, self.name, file_backed=False, source=name)


class TokenFileProvider(_EnvSettingProvider):
    """``AGENT_SANDBOX_TOKEN_FILE``: an explicit token path, re-read on every request."""

    name = TOKEN_FILE_PROVIDER
    file_backed = True
    envs = TOKEN_FILE_ENVS
    fix = "Set it to the path of a token file"
    hint = (
        f"set {TOKEN_FILE_ENV} to the path of a file holding an OIDC token whose aud "
        "is the broker URL"
    )
    description = "a token file named by AGENT_SANDBOX_TOKEN_FILE"

    def _credential(self, name: str, value: str) -> Credential:
        path = value
        source = f"{name}={path}"
        text = read_token_file(path, provider=self.name, source=source, missing_ok=False)
        assert text is not None
        token = check_token_text(text, provider=self.name, source=source)
        return Credential(token, self.name, file_backed=True, source=path)


class ProjectedTokenProvider:
    """The default projected ServiceAccount token path, consulted last; re-read every request."""

    name = PROJECTED_PROVIDER
    file_backed = True

    def __init__(self, path: str = DEFAULT_TOKEN_PATH) -> None:
        self.path = path
        check_not_automounted(path, provider=self.name, source=path)

    @hookimpl
    def agent_sandbox_provider_info(self) -> ProviderInfo:
        return ProviderInfo(
            priority=0,
            hint=f"mount a projected ServiceAccount token with audience = the broker URL at "
            f"{self.path}",
            description="the projected ServiceAccount token at the default path",
        )

    @hookimpl
    def agent_sandbox_get_credential(self, request: CredentialRequest) -> Credential | None:
        text = read_token_file(self.path, provider=self.name, source=self.path, missing_ok=True)
        if text is None:
            return request.not_here(f"{self.path} does not exist")
        token = check_token_text(text, provider=self.name, source=self.path)
        return Credential(token, self.name, file_backed=True, source=self.path)

    def present(self, environ: Mapping[str, str]) -> str | None:
        return f"{self.path} exists" if os.path.exists(self.path) else None
