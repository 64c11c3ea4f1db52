"""``BrokerConnectionConfig``: where the broker is and how to talk to it."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from typing import Any, Self
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, model_validator

from ..._fix import ENV, Fix, Setting, sourced
from ..._upstream import SandboxDirectConnectionConfig
from ...credentials._jwt import normalise_url
from ...errors import ConfigurationError, InvalidSettingError
from ..wire._protocol import redact_url

__all__ = [
    "ENV_ALIASES",
    "ENV_BROKER_PROTOCOL",
    "ENV_BROKER_URL",
    "ENV_CA_BUNDLE",
    "ENV_KEEPALIVE",
    "ENV_SECONDS_ALIASES",
    "ENV_TEMPLATE",
    "ENV_TRUST_ENV_PROXIES",
    "ENV_TTL",
    "BrokerConnectionConfig",
    "SandboxBrokerConnectionConfig",
    "check_broker_url",
]

ENV_BROKER_URL = "AGENT_SANDBOX_BROKER_URL"
ENV_CA_BUNDLE = "AGENT_SANDBOX_CA_BUNDLE"
ENV_TEMPLATE = "AGENT_SANDBOX_TEMPLATE"
ENV_TRUST_ENV_PROXIES = "AGENT_SANDBOX_TRUST_ENV_PROXIES"
ENV_TTL = "AGENT_SANDBOX_TTL_SECONDS"
NO_BROKER_URL_FIX = Fix(
    "Set ",
    Setting("broker_url", or_env=True),
    " to the broker's https:// URL; for a broker on this machine, `agent-sandbox-awx dev` "
    "starts one and prints the lines to export.",
)
"""What to do without a broker URL, in the user's surface (``broker_url=``, ``--broker-url``)."""
ENV_KEEPALIVE = "AGENT_SANDBOX_KEEPALIVE_TTL_SECONDS"
ENV_BROKER_PROTOCOL = "AGENT_SANDBOX_BROKER_PROTOCOL"
ENV_WARMPOOL = "AGENT_SANDBOX_WARMPOOL"
ENV_NAMESPACE = "AGENT_SANDBOX_NAMESPACE"
ENV_ALIASES: dict[str, tuple[str, ...]] = {
    "broker_url": (ENV_BROKER_URL, "BROKER_URL"),
    "template": (ENV_TEMPLATE, ENV_WARMPOOL, "SANDBOX_WARMPOOL"),
    "namespace": (ENV_NAMESPACE, "SANDBOX_NAMESPACE"),
    "broker_protocol": (ENV_BROKER_PROTOCOL,),
}
ENV_SECONDS_ALIASES: dict[str, tuple[str, ...]] = {
    "sandbox_timeout": (ENV_TTL, "SANDBOX_TTL_SECONDS"),
    "sandbox_keepalive": (ENV_KEEPALIVE,),
}
"""The variables each setting is read from, first set wins: the SDK's, then the original
package's (``BROKER_URL``, ``AGENT_SANDBOX_WARMPOOL``/``SANDBOX_WARMPOOL``,
``AGENT_SANDBOX_NAMESPACE``/``SANDBOX_NAMESPACE``, ``SANDBOX_TTL_SECONDS``), in its order.
:data:`ENV_SECONDS_ALIASES` holds the settings whose value is a whole number of seconds."""
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

# Headers the client sets itself; an extra header must not replace them.
_RESERVED_EXTRA_HEADERS = frozenset(
    {"authorization", "host", "idempotency-key", "content-length", "transfer-encoding", "cookie"}
)
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""An HTTP header name (an RFC 9110 token)."""

SETTING_SOURCES: dict[str, str] = {
    "broker_url": f"broker_url=, {ENV_BROKER_URL} or --broker-url",
    "api_url": "api_url=",
    "ca_cert": f"ca_cert=, {ENV_CA_BUNDLE} or --ca-bundle",
    "template": f"template= or {ENV_TEMPLATE}",
    "namespace": f"namespace= or {ENV_NAMESPACE}",
    "broker_protocol": f"broker_protocol= or {ENV_BROKER_PROTOCOL}",
    "trust_env_proxies": f"trust_env_proxies= or {ENV_TRUST_ENV_PROXIES}",
    "sandbox_timeout": f"sandbox_timeout= or {ENV_TTL}",
    "sandbox_keepalive": f"sandbox_keepalive= or {ENV_KEEPALIVE}",
}
"""Where each setting can be given (the keyword, the variable, the CLI option), for errors."""


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def check_broker_url(
    url: str,
    *,
    allow_insecure_http: bool = False,
    insecure_option: str = "allow_insecure_http=True",
    setting: Setting | None = None,
) -> str:
    """Check a broker URL and return its normal form (``_jwt.normalise_url``, the one URL rule:
    scheme and host lower-cased, default port and trailing slash dropped).

    The result is the only origin the client sends a token to, and the credential audience.
    ``insecure_option``: how the caller allows http:// where it is (the CLI: its flag);
    ``setting``: where the URL was set, as a refusal's fix names it (default: both ways).
    """
    named = setting or Setting("broker_url", or_env=True)
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError("The broker URL is empty.", fix=_set_url(named))
    raw = url.strip()
    shown = redact_url(raw, typed=True)  # the only form of the URL that messages show
    _refuse_odd_characters(raw, shown)
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        # urlsplit quotes what it took for the port: with user info, maybe part of a password
        why = "its host or port does not parse" if "@" in raw else str(exc)
        raise ConfigurationError(
            f"The broker URL {shown!r} is not a valid URL: {why}.", fix=_set_url(named)
        ) from None
    scheme = parts.scheme.lower()
    host = parts.hostname or ""
    if scheme not in ("https", "http") or not host:
        raise ConfigurationError(
            f"The broker URL {shown!r} must be an absolute https:// URL with a host.",
            fix=_set_url(named),
        )
    _refuse_bad_labels(host, shown)
    if parts.username is not None or parts.password is not None:
        raise ConfigurationError(
            "The broker URL must not contain a user name or password; credentials come from the "
            "credential chain (see `agent-sandbox-awx doctor`)."
        )
    if parts.query or parts.fragment:
        raise ConfigurationError(
            f"The broker URL {shown!r} must not have a query or fragment; use the plain base URL."
        )
    if scheme == "http":
        if not _is_loopback(host):
            raise ConfigurationError(
                f"The broker URL {shown!r} uses http://, which would send tokens in clear text. "
                "Use https://; plain http:// is only allowed for a loopback host "
                f"(127.0.0.1, ::1, localhost) with {insecure_option}."
            )
        if not allow_insecure_http:
            raise ConfigurationError(
                f"The broker URL {shown!r} uses http://. Use https://, or, for a broker on this "
                f"machine only, pass {insecure_option}."
            )
    del port  # parsed above only to refuse a bad one
    return normalise_url(raw)  # the one URL rule (also for token audiences)


def unreadable_ca_bundle(ca: str, *, from_env: bool) -> ConfigurationError:
    """A CA bundle that is not a file: its path named, where it was set (``from_env``: the
    variable, else ``ca_cert=``/``--ca-bundle``); PEM text set instead of a path (a CI
    variable of the wrong type) is said so, never shown."""
    setting = Setting("ca_bundle", source=ENV if from_env else None)
    if _of_a_stopped_local_broker(ca):
        return ConfigurationError(
            f"The local broker from `agent-sandbox-awx dev` is no longer running: its CA "
            f"bundle {ca!r} went with it.",
            fix=Fix(
                "Start it again (`agent-sandbox-awx dev`) and export the lines it prints: its "
                "URL and CA bundle are new each time (or unset ",
                setting,
                " and AGENT_SANDBOX_BROKER_URL to use another broker).",
            ),
        )
    if "-----BEGIN" in ca:
        return ConfigurationError(
            f"The CA bundle holds PEM text ({len(ca)} characters), not the path of a file.",
            fix=Fix(
                "Set ",
                setting,
                " to the path of a PEM file: in GitLab CI make the variable of type File (its "
                "value is then a path); in GitHub Actions write the secret to a file "
                "(printf '%s' \"$CA_PEM\" > ca.pem) and set the variable to that path.",
            ),
        )
    return ConfigurationError(
        f"The CA bundle {ca!r} is not a readable file.",
        fix=Fix(
            "Point ",
            setting,
            " at the PEM file of the CA that signed the broker's certificate, or unset it to "
            "use the system trust store.",
        ),
    )


LOCAL_BROKER_DIR_PREFIX = "agent-sandbox-broker-"
"""The name a local broker's (``agent-sandbox-awx dev``'s) temporary directory starts with;
its CA bundle is ``ca.pem`` in it, removed when the broker stops."""


def _of_a_stopped_local_broker(ca: str) -> bool:
    directory, name = os.path.split(ca)
    return (
        name == "ca.pem"
        and os.path.basename(directory).startswith(LOCAL_BROKER_DIR_PREFIX)
        and not os.path.exists(directory)
    )


def _set_url(setting: Setting) -> Fix:
    return Fix(
        "Set ", setting, " to the broker's https:// URL, e.g. https://sandbox-broker.example."
    )


def _refuse_odd_characters(raw: str, shown: str) -> None:
    """No space or control character anywhere (``urlsplit`` would drop a tab or a line break
    silently; the HTTP client refuses a ``DEL`` only when it sends)."""
    if any(c.isspace() or not c.isprintable() for c in raw):
        raise ConfigurationError(
            f"The broker URL {shown!r} contains a space or a control character; set "
            f"{ENV_BROKER_URL} (or broker_url=) to the broker's plain https:// URL."
        )


def _refuse_bad_labels(host: str, shown: str) -> None:
    """A host name's labels: none empty (``a..b``), none over 63 characters, no ``%``."""
    if ":" in host:  # an IPv6 literal
        return
    if any(not label or len(label) > 63 or "%" in label for label in host.rstrip(".").split(".")):
        raise ConfigurationError(
            f"The broker URL {shown!r} has an invalid host name (an empty part, a part longer "
            f"than 63 characters, or a '%'); set {ENV_BROKER_URL} (or broker_url=) to the "
            "broker's https:// URL."
        )


class BrokerConnectionConfig(SandboxDirectConnectionConfig):
    """How to reach the identity broker.

    ``broker_url`` is the broker's https:// base URL (normalised without a trailing slash); it is
    also the audience every token must carry. ``api_url`` (inherited from upstream's
    ``SandboxDirectConnectionConfig``) defaults to it and must equal it: the data plane goes
    through the broker too. ``ca_cert`` and ``client_cert`` are used for TLS to the broker.
    """

    broker_url: str = ""
    api_url: str = ""
    allow_insecure_http: bool = False
    """Allow ``http://`` for a loopback broker (local development only)."""
    trust_env_proxies: bool = True
    """Use the proxy environment variables (``HTTPS_PROXY``, ``ALL_PROXY``, ``NO_PROXY``) for
    a broker that is not on this machine; ``False`` (or ``AGENT_SANDBOX_TRUST_ENV_PROXIES=0``):
    always connect directly. See :attr:`use_env_proxies`."""
    template: str | None = None
    """Template used when ``create`` gets none; ``None``: the broker policy's default."""
    broker_protocol: str | None = None
    """The broker dialect to speak: ``v1`` or ``rpc`` (``AGENT_SANDBOX_BROKER_PROTOCOL``);
    ``None``: found out from the broker on first use (one request per broker and process)."""
    poll_interval: float = Field(default=2.0, gt=0)
    """The longest pause between two status polls while waiting for Ready (a dialect without a
    long-poll, ``rpc``); the pauses start at 0.1 s and double up to it."""
    namespace: str | None = None
    """The namespace you expect (``AGENT_SANDBOX_NAMESPACE``): informational only, the broker's
    policy pins the namespace and the SDK uses the one the broker returns."""
    request_timeout: float = Field(default=30.0, gt=0)
    """Seconds for one HTTP request (connect, and each read/write)."""
    ready_timeout: float = Field(default=180.0, ge=0)
    """Seconds ``create`` waits for the sandbox to become Ready."""
    sandbox_timeout: int = Field(default=300, ge=0)
    """A new sandbox's lifetime in seconds when ``create`` gets no ``timeout=``
    (``AGENT_SANDBOX_TTL_SECONDS``); ``0``: the broker policy's maximum. Left at its default
    (300), it is sent as the SDK's default, which the broker cuts at a lower policy cap."""
    sandbox_keepalive: int = Field(default=0, ge=0)
    """The activity keepalive of the handles this client makes, in seconds
    (``AGENT_SANDBOX_KEEPALIVE_TTL_SECONDS``; ``0``: off): see ``Sandbox.create(keepalive=)``."""
    max_connections: int | None = Field(default=100, ge=1)
    """Connections one client object opens to the broker at once (``None``: no limit); more
    concurrent requests wait for a free one (up to ``request_timeout``). A long-poll wait for
    Ready holds one, so many concurrent creates through one client may want more."""
    max_keepalive_connections: int | None = Field(default=20, ge=0)
    """Idle connections kept open for reuse (the defaults are httpx's)."""
    max_attempts: int = Field(default=4, ge=1, le=10)
    """Attempts for a retryable request (the first one included)."""
    backoff_base: float = Field(default=0.2, ge=0)
    backoff_max: float = Field(default=10.0, ge=0)
    """Exponential backoff with full jitter: ``uniform(0, min(max, base * 2**n))``; a
    ``Retry-After`` is honoured up to ``backoff_max``."""

    @model_validator(mode="before")
    @classmethod
    def _fill_api_url(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        broker = data.get("broker_url") or data.get("api_url")
        if not broker:
            raise ConfigurationError("No broker URL.", fix=NO_BROKER_URL_FIX)
        insecure = bool(data.get("allow_insecure_http", False))
        normalized = check_broker_url(str(broker), allow_insecure_http=insecure)
        api_url = data.get("api_url")
        if api_url:
            api_normalized = check_broker_url(str(api_url), allow_insecure_http=insecure)
            if api_normalized != normalized:
                raise ConfigurationError(
                    f"api_url {redact_url(str(api_url), typed=True)!r} differs from the broker URL "
                    f"{normalized!r}. With the "
                    "broker, api_url must be the broker URL (or be left out): any other URL would "
                    "bypass the broker and talk to a sandbox router directly, without the "
                    "broker's authentication and authorization."
                )
        data["broker_url"] = normalized
        data["api_url"] = normalized
        _check_tls_needs_https(data, normalized)
        headers = data.get("extra_headers") or {}
        for name in headers if isinstance(headers, Mapping) else ():
            if str(name).lower() in _RESERVED_EXTRA_HEADERS:
                raise ConfigurationError(
                    f"extra_headers must not set {name!r}: the client sets it itself "
                    "(the token comes from the credential chain; pass auth= to choose it)."
                )
            _check_header(name, headers[name])
        return data

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:  # pydantic's: a setting's value or type
            raise invalid_setting(type(self), exc) from None

    @classmethod
    def model_validate(cls, *args: Any, **kwargs: Any) -> Self:
        try:
            return super().model_validate(*args, **kwargs)
        except ValidationError as exc:
            raise invalid_setting(cls, exc) from None

    @classmethod
    def model_validate_json(cls, *args: Any, **kwargs: Any) -> Self:
        try:
            return super().model_validate_json(*args, **kwargs)
        except ValidationError as exc:
            raise invalid_setting(cls, exc) from None

    @property
    def use_env_proxies(self) -> bool:
        """Whether requests to the broker may go through a proxy named by the environment.

        Never for a loopback broker (``127.0.0.0/8``, ``::1``, ``localhost``): it is on this
        machine. Never for an ``http://`` broker (loopback only anyway): a proxy would see the
        token in clear. For any other broker only with :attr:`trust_env_proxies`, and then as
        the ecosystem does: ``HTTPS_PROXY`` (or ``ALL_PROXY``) names the proxy, which gets a
        ``CONNECT`` tunnel (the token travels inside TLS to the broker), and ``NO_PROXY`` lists
        the hosts reached directly. ``HTTP_PROXY`` is never used (it is for ``http://`` URLs).
        """
        parts = urlsplit(self.broker_url)
        return (
            self.trust_env_proxies
            and parts.scheme == "https"
            and not _is_loopback(parts.hostname or "")
        )

    @property
    def audience(self) -> str:
        """The audience a token for this broker must carry: the broker URL."""
        return self.broker_url

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> BrokerConnectionConfig:
        """Build from ``AGENT_SANDBOX_BROKER_URL``, ``AGENT_SANDBOX_CA_BUNDLE``,
        ``AGENT_SANDBOX_TEMPLATE``, ``AGENT_SANDBOX_TRUST_ENV_PROXIES``,
        ``AGENT_SANDBOX_TTL_SECONDS``, ``AGENT_SANDBOX_KEEPALIVE_TTL_SECONDS``,
        ``AGENT_SANDBOX_BROKER_PROTOCOL`` and the original package's variables
        (:data:`ENV_ALIASES`, :data:`ENV_SECONDS_ALIASES`); keyword arguments that are not
        ``None`` win."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for setting, names in ENV_ALIASES.items():
            name = next((n for n in names if env.get(n)), None)
            if name is not None:
                values[setting] = env[name]
        if env.get(ENV_CA_BUNDLE):
            values["ca_cert"] = env[ENV_CA_BUNDLE]
        if env.get(ENV_TRUST_ENV_PROXIES):
            values["trust_env_proxies"] = _env_flag(env, ENV_TRUST_ENV_PROXIES)
        for setting, names in ENV_SECONDS_ALIASES.items():
            name = next((n for n in names if env.get(n)), None)
            if name is not None:
                values[setting] = _env_seconds(env, name)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if not values.get("broker_url") and not values.get("api_url"):
            raise ConfigurationError("No broker URL.", fix=NO_BROKER_URL_FIX)
        ca = values.get("ca_cert")
        if ca and not os.path.isfile(ca):
            raise unreadable_ca_bundle(str(ca), from_env=overrides.get("ca_cert") is None)
        try:
            return cls(**values)
        except ConfigurationError as exc:
            if overrides.get("broker_url") is None:  # the URL the user set is a variable
                raise sourced(exc, "broker_url", ENV) from exc.__cause__
            raise


class SandboxBrokerConnectionConfig(BrokerConnectionConfig):
    """The original package's name for :class:`BrokerConnectionConfig`, with its extra fields:
    ``token`` / ``token_path`` (the credential: the client uses ``OIDCTokenAuth(token)`` or
    ``KubernetesAuth(token_path)`` when no ``auth=`` is given), ``keepalive_ttl_seconds``
    (the original's name of :attr:`sandbox_keepalive`: the activity keepalive of the handles
    the client makes, ``0``: off) and ``backend`` (only ``"kubernetes"``)."""

    token: SecretStr | None = Field(default=None, repr=False)
    token_path: str | None = None
    keepalive_ttl_seconds: int | None = None
    backend: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _keepalive_spelling(cls, data: Any) -> Any:
        """``keepalive_ttl_seconds`` is ``sandbox_keepalive`` (both given: the same value)."""
        if not isinstance(data, dict) or data.get("keepalive_ttl_seconds") is None:
            return data
        original, ours = data["keepalive_ttl_seconds"], data.get("sandbox_keepalive")
        if ours is not None and ours != original:
            raise ConfigurationError(
                f"keepalive_ttl_seconds={original!r} and sandbox_keepalive={ours!r} differ; "
                "pass only sandbox_keepalive= (keepalive_ttl_seconds= is the original "
                "package's name for it)."
            )
        return {**data, "sandbox_keepalive": original}

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> BrokerConnectionConfig:
        """:meth:`BrokerConnectionConfig.from_env`; ``keepalive_ttl_seconds=`` wins over
        ``AGENT_SANDBOX_KEEPALIVE_TTL_SECONDS`` as ``sandbox_keepalive=`` does."""
        original = overrides.get("keepalive_ttl_seconds")
        if original is not None and overrides.get("sandbox_keepalive") is None:
            overrides["sandbox_keepalive"] = original
        return super().from_env(environ, **overrides)


def _check_tls_needs_https(data: Mapping[str, Any], url: str) -> None:
    """A CA bundle or a client certificate with an ``http://`` broker: TLS settings would do
    nothing there (upstream's model refuses it with a bare validation error)."""
    if not url.startswith("http://"):
        return
    if data.get("ca_cert"):
        raise ConfigurationError(
            f"A CA bundle is set ({SETTING_SOURCES['ca_cert']}) but the broker URL {url!r} is "
            f"plain http://, where it would not be used. Unset {ENV_CA_BUNDLE} (or leave out "
            "ca_cert= / --ca-bundle), or use the broker's https:// URL."
        )
    if data.get("client_cert"):
        raise ConfigurationError(
            f"client_cert= is set but the broker URL {url!r} is plain http://, where a client "
            "certificate would not be used. Leave out client_cert=, or use the broker's "
            "https:// URL."
        )


def _check_header(name: Any, value: Any) -> None:
    """An extra header the HTTP client can send: a token name and a printable ASCII value
    (never shown: it may be a secret). Wrong types are the model's to report."""
    if not isinstance(name, str) or not isinstance(value, str):
        return
    if not _HEADER_NAME.fullmatch(name):
        raise ConfigurationError(
            f"extra_headers has the header name {name!r}, which is not a valid HTTP header name "
            "(letters, digits and !#$%&'*+-.^_`|~ only); fix or remove it."
        )
    if not all(" " <= c <= "~" or c == "\t" for c in value):
        raise ConfigurationError(
            f"The value of extra_headers[{name!r}] has a character an HTTP header cannot carry "
            "(a line break, a control character or a non-ASCII character; the value is not "
            "shown); use printable ASCII only, e.g. percent- or base64-encode it."
        )


def invalid_setting(cls: type[Any], exc: ValidationError) -> InvalidSettingError:
    """pydantic's validation error as ours: each wrong setting with where it is given and
    what is wrong (never the value given: it may be a secret), and the fix. (Through
    ``model_validate`` the validation runs our ``__init__``, whose error pydantic wraps: it is
    taken out again.)"""
    problems, names = [], []
    for error in exc.errors(include_url=False, include_input=False):
        ours = (error.get("ctx") or {}).get("error")
        if isinstance(ours, InvalidSettingError):
            return ours
        loc = error.get("loc") or ()
        name = str(loc[0]) if loc else None
        names.append(name)
        where = ".".join(str(part) for part in loc) or "the settings"
        if name in SETTING_SOURCES:
            where += f" ({SETTING_SOURCES[name]})"
        elif len(loc) == 1:
            where += "="
        default = cls.model_fields[name].default if name in cls.model_fields else None
        usual = f", or leave it out (default: {default!r})" if _shown(default) else ""
        reason = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        problems.append(f"{where} is invalid: {reason[:1].lower()}{reason[1:]}; fix it{usual}")
    return InvalidSettingError(
        f"{cls.__name__}: " + "; ".join(problems) + ".",
        setting=names[0] if names else None,
    )


def _shown(default: Any) -> bool:
    return isinstance(default, bool | int | float | str) and default != ""


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    value = env[name].strip().lower()
    if value in _TRUE | _FALSE:
        return value in _TRUE
    raise ConfigurationError(
        f"The environment variable {name}={env[name]!r} is not a yes/no value; set it to 1 or "
        "0 (also true/false, yes/no, on/off), or unset it."
    )


def _env_seconds(env: Mapping[str, str], name: str) -> int:
    value = env[name].strip()
    if not (value.isascii() and value.isdigit()):
        raise ConfigurationError(
            f"The environment variable {name}={env[name]!r} is not a whole number of seconds; "
            "set it to, e.g., 300 (0: the default), or unset it."
        )
    return int(value)
