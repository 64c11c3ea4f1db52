"""``load_config``: read the TOML file, check every rule, report every problem at once."""

from __future__ import annotations

import difflib
import os
import tomllib
from pathlib import Path
from typing import Any

from ._backend import backend as _backend
from ._errors import BrokerConfigError, Problem
from ._issuers import issuer as _issuer
from ._observability import audit as _audit
from ._observability import logging as _logging
from ._observability import metrics as _metrics
from ._policies import policy as _policy
from ._reader import Context, Table, show
from ._schema import (
    CALLER_NAMESPACE,
    BackendConfig,
    BrokerConfig,
    IssuerConfig,
    PolicyConfig,
)
from ._server import server as _server

__all__ = ["load_config"]


def load_config(path: str | os.PathLike[str], *, check_files: bool = True) -> BrokerConfig:
    """Read and check the broker configuration file at ``path``.

    Raises :class:`BrokerConfigError` listing every problem found (each with the file, the
    dotted key, the rule and the fix). ``check_files=False`` skips the checks that the files
    the configuration names exist and are readable (to check a file meant for another machine).
    """
    file = Path(os.path.abspath(os.path.expanduser(os.fspath(path))))
    ctx = Context(file, check_files=check_files)
    root = Table(ctx, _read(file), "", "the file")
    server_table = _required_table(root, "server", "[server] with public_url, tls_cert_file, ...")
    server = _server(server_table) if server_table else None
    public_url = server.public_url if server else ""
    issuers = [_issuer(t, public_url) for t in root.tables("issuers")]
    policies = [_policy(t) for t in root.tables("policies")]
    backend_table = _required_table(root, "backend", '[backend] with kind = "kubernetes"')
    backend = _backend(backend_table) if backend_table else None
    logging = _logging(root.table("logging", title="[logging]"), root)
    audit = _audit(root.table("audit", title="[audit]"), root)
    metrics = _metrics(root.table("metrics", title="[metrics]"), server.port if server else None)
    root.finish()
    _cross_rules(root, issuers, policies, backend)
    if ctx.problems or server is None or backend is None:
        raise BrokerConfigError(file, ctx.problems)
    return BrokerConfig(
        path=file,
        server=server,
        issuers=tuple(issuers),
        policies=tuple(policies),
        backend=backend,
        logging=logging,
        audit=audit,
        metrics=metrics,
        defaulted=frozenset(ctx.defaulted),
    )


def _read(path: Path) -> dict[str, Any]:
    def fail(rule: str, fix: str) -> BrokerConfigError:
        return BrokerConfigError(path, [Problem("", rule, fix)])

    fix = "give --config the path of the broker's TOML configuration file"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise fail("does not exist", fix) from None
    except IsADirectoryError:
        raise fail("is a directory, not a file", fix) from None
    except PermissionError:
        raise fail(f"is not readable by this process (uid {os.getuid()})", fix) from None
    except OSError as exc:
        raise fail(f"cannot be read ({exc.strerror or exc})", fix) from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise fail("is not UTF-8 text", "save it as UTF-8 (TOML files are UTF-8)") from None
    except tomllib.TOMLDecodeError as exc:
        raise fail(f"is not valid TOML: {exc}", "correct the syntax there (toml.io)") from None


def _required_table(root: Table, name: str, fix: str) -> Table | None:
    table = root.table(name, title=f"[{name}]")
    if table is None and root.ok(name):
        root.problem(name, f"the file has no [{name}] table, which is required", f"add {fix}")
    return table


def _cross_rules(
    root: Table,
    issuers: list[IssuerConfig],
    policies: list[PolicyConfig],
    backend: BackendConfig | None,
) -> None:
    """The rules between tables: unique names and URLs, policies naming issuers, issuers that
    need the Kubernetes backend, policies that can never match, local templates."""
    _unique(root, "issuers", [i.name for i in issuers], "name")
    _unique(root, "issuers", [i.url for i in issuers], "url")
    _unique(root, "policies", [p.name for p in policies], "name")
    by_name = {i.name: i for i in issuers if i.name}
    for index, policy in enumerate(policies):
        _policy_issuer(root, index, policy, by_name)
    _shadowed(root, policies)
    kind = backend.kind if backend else None
    for index, issuer in enumerate(issuers):
        if issuer.verification == "tokenreview" and kind == "local":
            root.problem(
                f"issuers[{index}].verification",
                '"tokenreview" needs the Kubernetes API server: backend kind = "kubernetes"',
                'set verification = "jwks" for this issuer, or use the kubernetes backend',
                context=_named("issuer", issuer.name),
            )
    if backend is not None and backend.local is not None and _templates_ok(root):
        templates = set(backend.local.templates)
        for index, policy in enumerate(policies):
            for pool in policy.warm_pools:
                if pool not in templates:
                    root.problem(
                        f"policies[{index}].warm_pools",
                        f"{pool!r} is not a template of [backend.local] "
                        f"({', '.join(sorted(templates)) or 'none'})",
                        f"add {pool} to [backend.local] templates, or remove it here",
                        context=_named("policy", policy.name),
                    )


def _named(kind: str, name: str) -> str:
    return f'{kind} "{name}"' if name else ""


def _templates_ok(root: Table) -> bool:
    """Whether ``[backend.local] templates`` had no problem (else its pools are not known)."""
    return not any(key.startswith("backend.local.templates") for key in root.ctx.bad)


def _unique(root: Table, tables: str, values: list[str], key: str) -> None:
    seen: dict[str, int] = {}
    for index, value in enumerate(values):
        if not value:
            continue
        if value in seen:
            root.problem(
                f"{tables}[{index}].{key}",
                f"{show(value)} is also the {key} of {tables}[{seen[value]}]",
                f"give each [[{tables}]] table its own {key}",
            )
        seen.setdefault(value, index)


def _policy_issuer(
    root: Table, index: int, policy: PolicyConfig, issuers: dict[str, IssuerConfig]
) -> None:
    if not policy.issuer:
        return
    found = issuers.get(policy.issuer)
    if found is None:
        near = difflib.get_close_matches(policy.issuer, list(issuers), n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        root.problem(
            f"policies[{index}].issuer",
            f"{policy.issuer!r} is not the name of an [[issuers]] table "
            f"({', '.join(map(repr, issuers)) or 'none is valid'})",
            f"{hint}name one of the issuers",
            context=_named("policy", policy.name),
        )
    elif policy.namespace == CALLER_NAMESPACE and not _has_namespace(found):
        root.problem(
            f"policies[{index}].namespace",
            f"{CALLER_NAMESPACE} needs callers with a namespace, and issuer {found.name!r} "
            f"(provider {found.provider!r}) gives its callers none",
            'name a fixed namespace, or add "namespace" to that issuer\'s attributes',
            context=_named("policy", policy.name),
        )


def _has_namespace(issuer: IssuerConfig) -> bool:
    if issuer.attributes is None:
        return issuer.provider == "kubernetes"
    return "namespace" in issuer.attributes


def _shadowed(root: Table, policies: list[PolicyConfig]) -> None:
    """A policy after one that admits every caller of the same issuer can never match."""
    catch_all: dict[str, int] = {}
    for index, policy in enumerate(policies):
        first = catch_all.get(policy.issuer)
        if first is not None and policy.issuer:
            root.problem(
                f"policies[{index}]",
                f"can never match: policies[{first}] ({policies[first].name!r}) admits every "
                f"caller of issuer {policy.issuer!r} first (first match wins)",
                f"move this policy before policies[{first}], or narrow policies[{first}] with "
                "subject or claims",
                context=_named("policy", policy.name),
            )
        elif policy.subject == "*" and not policy.claims:
            catch_all.setdefault(policy.issuer, index)
