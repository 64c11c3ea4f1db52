"""Where the Kubernetes API is and how to authenticate to it: ``KubeConfig``.

Three ways to get one, all through the one checking constructor ``connection()``:

- ``in_cluster()``: a pod's own ServiceAccount, from ``KUBERNETES_SERVICE_HOST`` /
  ``KUBERNETES_SERVICE_PORT`` and the files the kubelet mounts (``token``, ``ca.crt``,
  ``namespace``; the directory is a parameter). The token is projected and rotated by the
  kubelet: it is read again for every request.
- ``from_kubeconfig(path, context=None)``: the current (or the named) context of a kubeconfig
  file: the cluster's ``server``, ``certificate-authority(-data)``,
  ``insecure-skip-tls-verify`` (refused unless ``allow_insecure``), the user's ``token``,
  ``tokenFile`` (read again for every request; it wins over ``token``, as in client-go),
  ``client-certificate(-data)`` + ``client-key(-data)``, an ``exec`` credential plugin
  (``client.authentication.k8s.io/v1`` or ``v1beta1``: ``_api_exec``, what EKS, GKE and AKS
  kubeconfigs use). A user with ``auth-provider`` (removed from kubectl in 1.26) is refused
  naming the exec plugin that replaces it; basic auth and impersonation are refused too, naming
  the file, the user and what to do instead. A kubeconfig in JSON needs nothing more; YAML
  (what kubectl writes) needs PyYAML, which the ``[broker]`` extra installs.
- ``connection(server, ...)`` directly.

Every problem is a ``KubeConfigError`` naming the file (or variable) and key, the rule and the
fix; no message and no ``repr`` ever contains a token or a key.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import json
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from ...._urls import masked_url
from ._api_errors import KubeConfigError
from ._api_exec import ExecCredential, cluster_info, exec_plugin

__all__ = [
    "DEFAULT_SERVICE_ACCOUNT_DIR",
    "ExecCredential",
    "KubeConfig",
    "StaticToken",
    "TokenFile",
    "connection",
    "from_kubeconfig",
    "in_cluster",
]

DEFAULT_SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
BROKER_EXTRA: Final = (
    'the [broker] extra installs it: python3 -m pip install -e ".[broker]" in a clone of the '
    "k8s-agent-sandbox-awx repository"
)

AUTH_PROVIDER_FIX: Final = (
    "auth-provider plugins were removed from kubectl and client-go (1.26): use the exec "
    "credential plugin that replaces it (GKE: gke-gcloud-auth-plugin, then `gcloud container "
    "clusters get-credentials` writes an exec user; Azure: `kubelogin convert-kubeconfig`; "
    "OIDC: an exec plugin such as kubelogin's oidc-login)"
)
_REFUSED_USER_KEYS: Final[Mapping[str, str]] = {
    "username": "basic authentication (`username`/`password`)",
    "password": "basic authentication (`username`/`password`)",
    "as": "impersonation (`as`)",
    "as-groups": "impersonation (`as-groups`)",
    "as-uid": "impersonation (`as-uid`)",
    "as-user-extra": "impersonation (`as-user-extra`)",
}
_REFUSED_CLUSTER_KEYS: Final[Mapping[str, str]] = {
    "proxy-url": "a proxy (`proxy-url`), which this client does not use",
    "tls-server-name": "a TLS server name other than the server's host (`tls-server-name`)",
}


# ------------------------------------------------------------------------------ tokens


def _checked(token: str, what: str, source: str) -> str:
    """``token`` if it can be sent in a header; else a ``KubeConfigError`` (which says
    nothing of the value: httpx's own error would quote it)."""
    if any(not ("!" <= c <= "~") for c in token):
        raise KubeConfigError(
            f"{what} has characters a token cannot have (whitespace, control "
            "or non-ASCII characters): write the token alone",
            source=source,
        )
    return token


class StaticToken:
    """A bearer token given as a value (a kubeconfig's ``token``)."""

    def __init__(self, token: str, *, source: str) -> None:
        if not token.strip():
            raise KubeConfigError(
                f"{source} is empty: give the token, or a token file", source=source
            )
        self._token = _checked(token.strip(), f"the token of {source}", source)
        self.source = source

    def read(self) -> str:
        return self._token

    def __repr__(self) -> str:
        return f"StaticToken(source={self.source!r})"


class TokenFile:
    """A bearer token in a file, read again for every request (a projected ServiceAccount
    token rotates: the kubelet swaps the file; a kubeconfig's ``tokenFile``)."""

    def __init__(self, path: str | os.PathLike[str], *, source: str) -> None:
        self.path = Path(path)
        self.source = source

    def read(self) -> str:
        """The token now in the file; ``KubeConfigError`` if it is missing or empty."""
        try:
            token = self.path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise KubeConfigError(
                f"the token file {self.path} ({self.source}) cannot be read "
                f"({type(exc).__name__}: {getattr(exc, 'strerror', None) or 'not UTF-8'}): "
                "check that it exists and is readable by this process",
                source=str(self.path),
            ) from None
        if not token:
            raise KubeConfigError(
                f"the token file {self.path} ({self.source}) is empty: write a token into it",
                source=str(self.path),
            )
        return _checked(token, f"the token in {self.path}", str(self.path))

    def __repr__(self) -> str:
        return f"TokenFile({str(self.path)!r})"


TokenSource = StaticToken | TokenFile | ExecCredential


# ------------------------------------------------------------------------------ the settings


@dataclass(frozen=True, repr=False)
class KubeConfig:
    """A checked connection to one API server: ``server`` (``https://host:port``), the TLS
    settings (``ssl_context``: the CA and any client certificate), the bearer ``token`` (or
    None), the default ``namespace`` (the pod's, or the context's), and ``source`` (where these
    came from, for messages)."""

    server: str
    ssl_context: ssl.SSLContext
    token: TokenSource | None
    namespace: str | None
    source: str
    client_certificate: bool = False
    insecure: bool = False

    def __repr__(self) -> str:
        auth = [repr(self.token)] if self.token is not None else []
        auth += ["client certificate"] if self.client_certificate else []
        return (
            f"KubeConfig(server={self.server!r}, source={self.source!r}, "
            f"namespace={self.namespace!r}, auth={', '.join(auth) or 'anonymous'}"
            f"{', INSECURE' if self.insecure else ''})"
        )


@dataclass(frozen=True)
class ClientCertificate:
    """A client certificate and its key: files, or PEM bytes (``-data``)."""

    cert_file: Path | None = None
    key_file: Path | None = None
    cert_data: bytes | None = None
    key_data: bytes | None = None

    def __repr__(self) -> str:
        return "ClientCertificate(...)"


def connection(
    server: str,
    *,
    ca_file: str | os.PathLike[str] | None = None,
    ca_data: bytes | None = None,
    token: TokenSource | None = None,
    client_certificate: ClientCertificate | None = None,
    insecure: bool = False,
    allow_insecure: bool = False,
    namespace: str | None = None,
    source: str = "the connection settings",
) -> KubeConfig:
    """A ``KubeConfig`` for ``server``, checked: an ``https`` URL; the CA from ``ca_file`` or
    ``ca_data`` (PEM), else the system's trust store; ``insecure`` (no certificate check) and
    plain ``http`` only with ``allow_insecure``."""
    server = _check_server(server, source=source, allow_insecure=allow_insecure)
    if insecure and not allow_insecure:
        raise KubeConfigError(
            f"{source} turns off the API server's certificate check "
            "(insecure-skip-tls-verify): a bearer token sent that way can be stolen; give "
            "the cluster's CA (certificate-authority or certificate-authority-data) instead, "
            "or allow it explicitly (allow_insecure=True) for a throwaway test cluster",
            source=source,
            key="insecure-skip-tls-verify",
        )
    context = _ssl_context(ca_file, ca_data, insecure=insecure, source=source)
    if client_certificate is not None:
        _load_client_certificate(context, client_certificate, source=source)
    return KubeConfig(
        server=server,
        ssl_context=context,
        token=token,
        namespace=namespace,
        source=source,
        client_certificate=client_certificate is not None,
        insecure=insecure,
    )


def _shown(server: object) -> str:
    """The server address for a message: its user info, query and fragment masked."""
    return repr(masked_url(server) if isinstance(server, str) else server)


def _check_server(server: str, *, source: str, allow_insecure: bool) -> str:
    parts = urlsplit(server.strip()) if isinstance(server, str) else None
    if parts is None or parts.scheme not in ("https", "http") or not parts.hostname:
        raise KubeConfigError(
            f"{source}: the API server address {_shown(server)} is not an https:// URL with a "
            "host: "
            "give it as https://HOST[:PORT]",
            source=source,
            key="server",
        )
    if parts.scheme == "http" and not allow_insecure:
        raise KubeConfigError(
            f"{source}: the API server address {_shown(server)} is plain http: tokens would "
            "cross "
            "the network in the clear; use the server's https:// address (or allow it "
            "explicitly, allow_insecure=True, for a throwaway test cluster)",
            source=source,
            key="server",
        )
    if parts.query or parts.fragment or parts.username or parts.password:
        raise KubeConfigError(
            f"{source}: the API server address must have no user, query or fragment: "
            "give it as https://HOST[:PORT][/PATH]",
            source=source,
            key="server",
        )
    return server.strip().rstrip("/")


def _ssl_context(
    ca_file: str | os.PathLike[str] | None, ca_data: bytes | None, *, insecure: bool, source: str
) -> ssl.SSLContext:
    if insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    try:
        if ca_data is not None:
            return ssl.create_default_context(cadata=ca_data.decode("ascii", "replace"))
        if ca_file is not None:
            return ssl.create_default_context(cafile=os.fspath(ca_file))
    except (OSError, ssl.SSLError, ValueError) as exc:
        file = os.fspath(ca_file) if ca_file is not None and ca_data is None else ""
        what = f"the CA file {file}" if file else "the CA data"
        raise KubeConfigError(
            f"{source}: {what} is not usable ({_reason(exc)}): give the cluster's CA "
            "certificate in PEM form",
            source=file or source,
            key="certificate-authority" if ca_data is None else "certificate-authority-data",
        ) from None
    return ssl.create_default_context()


def _load_client_certificate(
    context: ssl.SSLContext, cert: ClientCertificate, *, source: str
) -> None:
    """Load the certificate and key; PEM data goes through files in a private temporary
    folder (the ``ssl`` module loads only files), removed at once."""
    with tempfile.TemporaryDirectory(prefix="kube-client-cert-") as folder:
        cert_path, key_path = cert.cert_file, cert.key_file
        if cert.cert_data is not None:
            cert_path = Path(folder) / "cert.pem"
            cert_path.write_bytes(cert.cert_data)
        if cert.key_data is not None:
            key_path = Path(folder) / "key.pem"
            key_path.touch(mode=0o600)
            key_path.write_bytes(cert.key_data)
        if cert_path is None or key_path is None:
            raise KubeConfigError(
                f"{source}: a client certificate needs both the certificate and its key "
                "(client-certificate[-data] and client-key[-data]): give the missing one",
                source=source,
                key="client-key" if key_path is None else "client-certificate",
            )
        try:
            context.load_cert_chain(str(cert_path), str(key_path))
        except (OSError, ssl.SSLError) as exc:
            raise KubeConfigError(
                f"{source}: the client certificate or key cannot be loaded ({_reason(exc)}): "
                "give a PEM certificate and its unencrypted PEM key",
                source=source,
                key="client-certificate",
            ) from None


def _reason(exc: BaseException) -> str:
    """An exception's short reason, without file contents."""
    if isinstance(exc, ssl.SSLError):
        return f"SSLError: {exc.reason or exc.strerror or 'invalid'}"
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    return type(exc).__name__


# ------------------------------------------------------------------------------ in-cluster


def in_cluster(
    directory: str | os.PathLike[str] = DEFAULT_SERVICE_ACCOUNT_DIR,
    *,
    environ: Mapping[str, str] | None = None,
) -> KubeConfig:
    """The pod's own ServiceAccount: the API server at ``KUBERNETES_SERVICE_HOST`` /
    ``KUBERNETES_SERVICE_PORT``, the CA in ``directory/ca.crt``, the token in
    ``directory/token`` (read again for every request), the namespace in
    ``directory/namespace`` (None when absent)."""
    env = os.environ if environ is None else environ
    folder = Path(directory)
    source = f"the in-cluster configuration ({folder})"
    host = env.get("KUBERNETES_SERVICE_HOST", "").strip()
    port = env.get("KUBERNETES_SERVICE_PORT", "").strip()
    for variable, value in (("KUBERNETES_SERVICE_HOST", host), ("KUBERNETES_SERVICE_PORT", port)):
        if not value:
            raise KubeConfigError(
                f"{variable} is not set: this is not a pod in a cluster; run there, or "
                "configure a kubeconfig file instead",
                source=variable,
            )
    if not port.isdigit():
        raise KubeConfigError(
            f"KUBERNETES_SERVICE_PORT is {port!r}, not a port number",
            source="KUBERNETES_SERVICE_PORT",
        )
    token = TokenFile(folder / "token", source="the pod's ServiceAccount token")
    token.read()  # missing or empty: say so now, not at the first request
    ca_file = folder / "ca.crt"
    if not ca_file.is_file():
        raise KubeConfigError(
            f"{ca_file} is missing: a pod's ServiceAccount volume holds the cluster's CA there; "
            "check that the pod mounts its ServiceAccount token (automountServiceAccountToken)",
            source=str(ca_file),
        )
    namespace = _pod_namespace(folder / "namespace")
    server = f"https://{f'[{host}]' if ':' in host else host}:{port}"
    return connection(
        server, ca_file=ca_file, token=token, namespace=namespace or None, source=source
    )


def _pod_namespace(file: Path) -> str | None:
    try:
        return file.read_text().strip() if file.is_file() else None
    except (OSError, UnicodeDecodeError) as exc:
        raise KubeConfigError(
            f"{file} cannot be read ({_reason(exc)}): check the pod's ServiceAccount volume",
            source=str(file),
        ) from None


# ------------------------------------------------------------------------------ kubeconfig


def from_kubeconfig(
    path: str | os.PathLike[str], *, context: str | None = None, allow_insecure: bool = False
) -> KubeConfig:
    """The ``context`` (default: ``current-context``) of the kubeconfig file at ``path``.
    Relative file paths inside it are relative to the file's folder, as kubectl reads them."""
    file = Path(path)
    document = _load_document(file)
    name, ctx = _context(document, file, context)
    source = f"kubeconfig {file} (context {name!r})"
    cluster_name, user_name = ctx.get("cluster"), ctx.get("user")
    if not isinstance(cluster_name, str) or not cluster_name:
        raise _bad(file, f"contexts[{name}].context.cluster", "must name a cluster")
    cluster = _named(document, file, "clusters", "cluster", cluster_name)
    user = (
        _named(document, file, "users", "user", user_name)
        if isinstance(user_name, str) and user_name
        else {}
    )
    namespace = ctx.get("namespace")
    server = _string(cluster, "server", file, f"clusters[{cluster_name}].cluster", required=True)
    tls = _cluster_tls(cluster, file, cluster_name)
    info = cluster_info(cluster, server, _ca_bytes(tls), bool(tls["insecure"]))
    return connection(
        server,
        **tls,
        token=_user_token(user, file, str(user_name), source, info),
        client_certificate=_user_certificate(user, file, str(user_name)),
        allow_insecure=allow_insecure,
        namespace=namespace if isinstance(namespace, str) and namespace else "default",
        source=source,
    )


def _bad(file: Path, key: str, rule: str, fix: str = "") -> KubeConfigError:
    text = f"kubeconfig {file}: {key} {rule}"
    return KubeConfigError(text + (f": {fix}" if fix else ""), source=str(file), key=key)


def _load_document(file: Path) -> dict[str, Any]:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KubeConfigError(
            f"kubeconfig {file} cannot be read ({_reason(exc)}): give the path of a readable "
            "kubeconfig file",
            source=str(file),
        ) from None
    document = _parse_json(text, file) if text.lstrip().startswith("{") else _parse_yaml(text, file)
    if not isinstance(document, dict):
        raise KubeConfigError(
            f"kubeconfig {file} is not a mapping of clusters, contexts and users: give a "
            "kubeconfig file (kubectl config view --raw writes one)",
            source=str(file),
        )
    return document


def _parse_json(text: str, file: Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise KubeConfigError(
            f"kubeconfig {file} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg}): fix the file",
            source=str(file),
        ) from None


def _parse_yaml(text: str, file: Path) -> Any:
    try:
        yaml = importlib.import_module("yaml")
    except ImportError:
        raise KubeConfigError(
            f"kubeconfig {file} is YAML, and reading YAML needs PyYAML: {BROKER_EXTRA}, or "
            "convert the file to JSON (kubectl config view --raw -o json)",
            source=str(file),
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:  # its str() quotes the offending line: a token, maybe
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise KubeConfigError(
            f"kubeconfig {file} is not valid YAML ({where}{problem}): fix the file",
            source=str(file),
        ) from None


def _context(
    document: Mapping[str, Any], file: Path, wanted: str | None
) -> tuple[str, Mapping[str, Any]]:
    name = wanted or document.get("current-context")
    names = [
        str(item.get("name"))
        for item in document.get("contexts") or []
        if isinstance(item, Mapping)
    ]
    if not isinstance(name, str) or not name:
        raise _bad(
            file,
            "current-context",
            "is not set",
            f"name the context to use (its contexts: {', '.join(names) or 'none'})",
        )
    if name not in names:
        raise _bad(
            file,
            f"contexts[{name}]",
            "does not exist",
            f"name one of its contexts: {', '.join(names) or 'it has none'}",
        )
    return name, _named(document, file, "contexts", "context", name)


def _named(
    document: Mapping[str, Any], file: Path, section: str, kind: str, name: str
) -> Mapping[str, Any]:
    items = document.get(section)
    if not isinstance(items, list):
        raise _bad(file, section, "is not a list", f"list the {section} as kubectl writes them")
    for item in items:
        if isinstance(item, Mapping) and item.get("name") == name:
            value = item.get(kind)
            if not isinstance(value, Mapping):
                raise _bad(file, f"{section}[{name}].{kind}", "is not a mapping")
            return value
    raise _bad(file, f"{section}[{name}]", "does not exist", f"add it, or name another {kind}")


def _string(
    mapping: Mapping[str, Any], key: str, file: Path, where: str, *, required: bool = False
) -> str:
    value = mapping.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or not value.strip():
        raise _bad(file, f"{where}.{key}", "must be a non-empty string")  # the value unsaid
    return value.strip()


def _path(mapping: Mapping[str, Any], key: str, file: Path, where: str) -> Path | None:
    value = _string(mapping, key, file, where)
    if not value:
        return None
    resolved = (file.parent / value) if not os.path.isabs(value) else Path(value)
    if not resolved.is_file():
        raise _bad(
            file,
            f"{where}.{key}",
            f"names {resolved}, which is not a file",
            "give the path of an existing file (relative to the kubeconfig's folder)",
        )
    return resolved


def _data(mapping: Mapping[str, Any], key: str, file: Path, where: str) -> bytes | None:
    value = _string(mapping, key, file, where)
    if not value:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(
            file, f"{where}.{key}", "is not base64", "give the PEM, base64-encoded"
        ) from None


def _refuse(
    mapping: Mapping[str, Any], refused: Mapping[str, str], file: Path, where: str, fix: str
) -> None:
    for key, what in refused.items():
        if mapping.get(key) not in (None, "", [], {}):
            raise _bad(
                file,
                f"{where}.{key}",
                f"configures {what}, which this client does not support",
                fix,
            )


def _cluster_tls(cluster: Mapping[str, Any], file: Path, name: str) -> dict[str, Any]:
    where = f"clusters[{name}].cluster"
    _refuse(
        cluster,
        _REFUSED_CLUSTER_KEYS,
        file,
        where,
        "remove it (the client connects "
        "directly to `server`, checking its certificate against the CA)",
    )
    insecure = cluster.get("insecure-skip-tls-verify", False)
    if not isinstance(insecure, bool):
        raise _bad(file, f"{where}.insecure-skip-tls-verify", "must be true or false")
    return {
        "ca_file": _path(cluster, "certificate-authority", file, where),
        "ca_data": _data(cluster, "certificate-authority-data", file, where),
        "insecure": insecure,
    }


def _ca_bytes(tls: Mapping[str, Any]) -> bytes | None:
    """The cluster's CA in PEM (for an exec plugin's ``provideClusterInfo``)."""
    if tls["ca_data"] is not None:
        return bytes(tls["ca_data"])
    try:
        return Path(tls["ca_file"]).read_bytes() if tls["ca_file"] is not None else None
    except OSError:
        return None  # said when the CA is loaded


def _user_token(
    user: Mapping[str, Any], file: Path, name: str, source: str, cluster: Mapping[str, Any]
) -> TokenSource | None:
    where = f"users[{name}].user"
    if user.get("auth-provider") not in (None, "", {}):
        raise _bad(file, f"{where}.auth-provider", "is not supported", AUTH_PROVIDER_FIX)
    _refuse(
        user,
        _REFUSED_USER_KEYS,
        file,
        where,
        (
            f"give user {name!r} a token file instead (tokenFile: a file holding a ServiceAccount "
            "token, e.g. from `kubectl create token SERVICEACCOUNT`), or run the broker in the "
            "cluster with its own ServiceAccount (in-cluster configuration)"
        ),
    )
    if user.get("exec") not in (None, {}):
        return _exec_user(user, file, where, source, cluster)
    token_file = _path(user, "tokenFile", file, where)
    if token_file is not None:
        return TokenFile(token_file, source=f"{where}.tokenFile of {source}")
    token = _string(user, "token", file, where)
    return StaticToken(token, source=f"{where}.token of {source}") if token else None


def _exec_user(
    user: Mapping[str, Any], file: Path, where: str, source: str, cluster: Mapping[str, Any]
) -> ExecCredential:
    spec = user["exec"]
    if not isinstance(spec, Mapping):
        raise _bad(file, f"{where}.exec", "is not a mapping", "write it as kubectl does")
    for key in ("token", "tokenFile"):
        if user.get(key) not in (None, ""):
            raise _bad(file, f"{where}.{key}", "is given with exec", "keep one of the two")
    plugin = exec_plugin(
        spec,
        where=f"kubeconfig {file}: {where}.exec",
        folder=file.parent,
        cluster=cluster,
        source=str(file),
    )
    return ExecCredential(plugin, source=f"{where}.exec of {source}")


def _user_certificate(user: Mapping[str, Any], file: Path, name: str) -> ClientCertificate | None:
    where = f"users[{name}].user"
    cert = ClientCertificate(
        cert_file=_path(user, "client-certificate", file, where),
        key_file=_path(user, "client-key", file, where),
        cert_data=_data(user, "client-certificate-data", file, where),
        key_data=_data(user, "client-key-data", file, where),
    )
    has_cert = cert.cert_file is not None or cert.cert_data is not None
    has_key = cert.key_file is not None or cert.key_data is not None
    if has_cert != has_key:
        missing = "client-key" if has_cert else "client-certificate"
        raise _bad(
            file,
            f"{where}.{missing}[-data]",
            "is missing",
            "a client certificate needs both the certificate and its key",
        )
    return cert if has_cert else None
