"""The checks of what a create names, as Kubernetes checks them (both dialects): sandbox names,
labels and annotations (the reserved prefixes: the broker's own, and upstream's
``agents.x-k8s.io/`` that its controller reads), environment variables."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..identity._policy import RESERVED_PREFIX
from ..runtime._env import MAX_ENV_BYTES, json_size
from ._errors import ApiError

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
UPSTREAM_DOMAIN = "agents.x-k8s.io"
"""Upstream's metadata keys: its controller reads them (on a claim, ``sandbox-name`` names a
Sandbox to adopt) and writes them; a caller sets none, but :data:`UPSTREAM_CLIENT_LABELS`."""
UPSTREAM_CLIENT_LABELS = frozenset({UPSTREAM_DOMAIN + "/created-by"})
"""The claim label upstream's own client marks its claims with (``/rpc`` clients send it)."""
_WHOSE = {
    RESERVED_PREFIX: "which only the broker sets",
    UPSTREAM_DOMAIN + "/": "which upstream's agent-sandbox controller reads (on a claim, "
    f"{UPSTREAM_DOMAIN}/sandbox-name names a Sandbox to adopt)",
}


def reserved_prefix(key: str, *, claim_label: bool = False) -> str | None:
    """The reserved prefix (the broker's, upstream's: :data:`_WHOSE`) whose domain, or a
    subdomain of it, is ``key``'s (``None``: the caller's key)."""
    domain, slash, _ = key.partition("/")
    if not slash or (claim_label and key in UPSTREAM_CLIENT_LABELS):
        return None
    domain = domain.lower()
    for prefix in _WHOSE:
        if domain == prefix[:-1] or domain.endswith("." + prefix[:-1]):
            return prefix
    return None


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def string_map(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ApiError(400, "invalid_request", f"'{what}' must be an object of string values")
    return dict(value)


def check_name(name: str) -> None:
    if len(name) > 63 or not DNS_LABEL.match(name):
        rule = "is not a DNS-1123 label (lowercase alphanumerics and '-', at most 63 characters)"
        raise ApiError(
            400,
            "invalid_path",
            f"sandbox name {name!r} {rule}",
            logged=f"the sandbox name in the path {rule}",
        )


def check_metadata(
    body: Mapping[str, Any], labels_field: str = "labels", annotations_field: str = "annotations"
) -> tuple[dict[str, str], dict[str, str]]:
    """The labels and annotations of a create body, checked as Kubernetes checks them (both
    dialects; ``/rpc`` also for ``pod_labels`` / ``pod_annotations``)."""
    labels = string_map(body.get(labels_field), labels_field)
    annotations = string_map(body.get(annotations_field), annotations_field)
    label_kind = labels_field.removesuffix("s").replace("_", " ")
    annotation_kind = annotations_field.removesuffix("s").replace("_", " ")
    for kind, mapping in ((label_kind, labels), (annotation_kind, annotations)):
        for key in mapping:
            prefix = reserved_prefix(key, claim_label=kind == "label")
            if prefix is not None:
                rule = f"under the reserved prefix {prefix!r} (or a subdomain), {_WHOSE[prefix]}"
                raise ApiError(
                    403,
                    "reserved_metadata",
                    f"{kind} {key!r} is {rule}; use another key",
                    logged=f"{_a(kind)} key is {rule}",
                )
    for key, value in labels.items():
        check_qualified_key(key, label_kind)
        if len(value) > 63 or (value and not _QUALIFIED_NAME.match(value)):
            rule = (
                "at most 63 characters, alphanumerics, '-', '_' or '.', beginning and ending "
                "with an alphanumeric"
            )
            raise ApiError(
                400,
                "invalid_request",
                f"{label_kind} {key!r} has an invalid value: {rule}",
                logged=f"{_a(label_kind)} has an invalid value: {rule}",
            )
    for key in annotations:
        check_qualified_key(key, annotation_kind)
    if sum(len(k) + len(v) for k, v in annotations.items()) > 256 * 1024:
        raise ApiError(400, "invalid_request", f"{annotations_field} are over 256 KiB in total")
    return labels, annotations


def check_qualified_key(key: str, kind: str) -> None:
    prefix, sep, name = key.rpartition("/")
    ok = bool(name) and len(name) <= 63 and bool(_QUALIFIED_NAME.match(name))
    if sep:
        ok = ok and 0 < len(prefix) <= 253 and bool(_DNS_SUBDOMAIN.match(prefix))
    if not ok:
        rule = (
            "[prefix/]name, name at most 63 characters of alphanumerics, '-', '_', '.', prefix "
            "a DNS subdomain"
        )
        raise ApiError(
            400,
            "invalid_request",
            f"{kind} key {key!r} is invalid: {rule}",
            logged=f"{_a(kind)} key is invalid: {rule}",
        )


def check_env(value: Any) -> dict[str, str]:
    """A create's ``env``: an object of string values whose names are variable names, at most
    ``MAX_ENV_BYTES`` as JSON (it travels to the runtime in one header: :mod:`.runtime._env`)."""
    env = string_map(value, "env")
    for name in env:
        if not _ENV_NAME.match(name):
            rule = "letters, digits and '_', not starting with a digit"
            raise ApiError(
                400,
                "invalid_request",
                f"env name {name!r} is invalid: {rule}",
                logged=f"an env name is invalid: {rule}",
            )
    for name, item in env.items():
        if "\0" in item or not _utf8(item):
            raise ApiError(
                400,
                "invalid_request",
                f"the value of env {name!r} holds a NUL character or text that is not UTF-8 "
                "(a lone surrogate), which no environment can carry: remove it",
            )
    size = json_size(env)
    if size > MAX_ENV_BYTES:
        raise ApiError(
            400,
            "invalid_request",
            f"env is {size} bytes as JSON, more than the {MAX_ENV_BYTES} a sandbox's environment "
            "may hold (the commands' environment, sent to the runtime with each command): give "
            "large values to the sandbox as files",
        )
    return env


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
