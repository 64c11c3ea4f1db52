"""``dev --issuer gitlab --claims project_path=group/project,ref=main``: the local broker's
token file holds a GitLab CI ``id_tokens`` token instead of a Kubernetes one (issue 30), to
try a CI job's identity (its policy, its ``project_path`` and ``ref``) on this machine. The
token is rewritten at 80 % of its lifetime, as the Kubernetes one is."""

from __future__ import annotations

import argparse
import logging
import threading
from collections.abc import Callable
from typing import Any

from ._common import write_private

__all__ = ["ISSUERS", "add_options", "claims_of", "identity_line", "keep_token_rotated"]

ISSUERS = ("kubernetes", "gitlab")
_GITLAB_DEFAULTS = {"project_path": "group/project", "ref": "main", "ref_type": "branch"}
log = logging.getLogger(__name__)


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--issuer",
        choices=ISSUERS,
        default="kubernetes",
        help="whose token the token file holds: a Kubernetes service account's (default; "
        "--namespace, --service-account) or a GitLab CI job's (--claims)",
    )
    parser.add_argument(
        "--claims",
        default="",
        metavar="K=V,...",
        help="with --issuer gitlab: the job's claims, e.g. project_path=group/project,ref=main "
        "(defaults: project_path=group/project, ref=main, ref_type=branch; any other claim "
        "of GitLab's too)",
    )


def claims_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """``--claims`` as a mapping over the GitLab defaults (a usage error when malformed)."""
    claims = dict(_GITLAB_DEFAULTS)
    if args.claims and args.issuer != "gitlab":
        parser.error("--claims is for --issuer gitlab (a Kubernetes token takes --namespace "
                     "and --service-account)")  # fmt: skip
    for item in filter(None, (part.strip() for part in args.claims.split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            parser.error(f"--claims: {item!r} is not KEY=VALUE (e.g. project_path=group/project)")
        claims[key.strip()] = value.strip()
    if "/" not in claims["project_path"]:
        parser.error(f"--claims: project_path {claims['project_path']!r} must be GROUP/PROJECT")
    return claims


def _gitlab_token(broker: Any, claims: dict[str, str], ttl: int) -> str:
    rest = {k: v for k, v in claims.items() if k not in _GITLAB_DEFAULTS}
    token: str = broker.issue_gitlab_token(
        claims["project_path"], claims["ref"], ttl=ttl, ref_type=claims["ref_type"], claims=rest
    )
    return token


def keep_token_rotated(
    broker: Any, args: argparse.Namespace, claims: dict[str, str], token_file: str
) -> Callable[[], None]:
    """Write the token file now and at 80 % of the token's lifetime; what stops that (a
    Kubernetes token's rotation stops with the broker)."""
    if args.issuer == "kubernetes":
        broker.keep_projected_token_rotated(
            token_file, args.namespace, args.service_account, args.ttl
        )
        return lambda: None

    def write() -> None:
        token = _gitlab_token(broker, claims, args.ttl)
        write_private(token_file, token.encode(), prefix=".token-")

    write()
    stop = threading.Event()

    def rotate() -> None:
        while not stop.wait(args.ttl * 0.8):
            try:
                write()
            except Exception:
                log.exception("dev: rotating the GitLab token failed")

    threading.Thread(target=rotate, name="gitlab-token-rotator", daemon=True).start()
    return stop.set


def identity_line(args: argparse.Namespace, claims: dict[str, str]) -> str:
    """Who the token file's token is, as the ``up`` line says it."""
    if args.issuer == "gitlab":
        return (
            f"GitLab CI job project_path:{claims['project_path']}:ref_type:"
            f"{claims['ref_type']}:ref:{claims['ref']}"
        )
    return f"system:serviceaccount:{args.namespace}:{args.service_account}"
