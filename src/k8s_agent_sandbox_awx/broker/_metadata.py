"""The checks of what a create names, as Kubernetes checks them (both dialects): sandbox names,
labels and annotations (the reserved prefix is the broker's alone), environment variables."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ._errors import ApiError
from .identity._policy import RESERVED_PREFIX

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
        raise ApiError(
            400,
            "invalid_path",
            f"sandbox name {name!r} is not a DNS-1123 label (lowercase alphanumerics "
            "and '-', at most 63 characters)",
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
            if key.startswith(RESERVED_PREFIX):
                raise ApiError(
                    403,
                    "reserved_metadata",
                    f"{kind} {key!r} is under the reserved prefix {RESERVED_PREFIX!r}, which "
                    "only the broker sets; use another key",
                )
    for key, value in labels.items():
        check_qualified_key(key, label_kind)
        if len(value) > 63 or (value and not _QUALIFIED_NAME.match(value)):
            raise ApiError(
                400,
                "invalid_request",
                f"{label_kind} {key!r} has an invalid value: at most 63 characters, "
                "alphanumerics, '-', '_' or '.', beginning and ending with an alphanumeric",
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
        raise ApiError(
            400,
            "invalid_request",
            f"{kind} key {key!r} is invalid: [prefix/]name, name at most 63 characters of "
            "alphanumerics, '-', '_', '.', prefix a DNS subdomain",
        )


def check_env(value: Any) -> dict[str, str]:
    """A create's ``env``: an object of string values whose names are variable names."""
    env = string_map(value, "env")
    for name in env:
        if not _ENV_NAME.match(name):
            raise ApiError(
                400,
                "invalid_request",
                f"env name {name!r} is invalid: letters, digits and '_', not starting with a digit",
            )
    return env
