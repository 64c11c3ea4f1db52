"""The broker connection from the CLI's options: its settings (``--broker-url``,
``--ca-bundle``, ``--allow-insecure-http``, else the environment), checked so that the fixes
their errors name are the CLI's flags, and the client made from them.

Imports of the client are deferred to the command that needs them (``--help`` stays fast)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..client._client import BrokerSandboxClient

__all__ = ["INSECURE_FLAG", "client", "given", "settings"]

INSECURE_FLAG = "--allow-insecure-http"


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The connection settings from the options (``None``: from the environment). The broker
    URL is checked here first, so that the fixes its errors name are the CLI's (a flag, not a
    keyword argument)."""
    from .._fix import ENV, Setting
    from ..client.http._config import (
        ENV_ALIASES,
        ENV_CA_BUNDLE,
        NO_BROKER_URL_FIX,
        check_broker_url,
    )
    from ..errors import ConfigurationError

    names = ENV_ALIASES["broker_url"]  # ours, then the original package's BROKER_URL
    url = args.broker_url or next((os.environ[n] for n in names if os.environ.get(n)), None)
    if not url:
        raise ConfigurationError("No broker URL.", fix=NO_BROKER_URL_FIX)
    url = check_broker_url(
        url,
        allow_insecure_http=args.allow_insecure_http,
        insecure_option=INSECURE_FLAG,
        setting=Setting("broker_url", source=None if args.broker_url else ENV),
    )
    ca_from = "--ca-bundle" if args.ca_bundle else ENV_CA_BUNDLE
    if url.startswith("http://") and (args.ca_bundle or os.environ.get(ENV_CA_BUNDLE)):
        fix = "leave out --ca-bundle" if args.ca_bundle else f"unset {ENV_CA_BUNDLE}"
        raise ConfigurationError(
            f"A CA bundle is set ({ca_from}) but the broker URL {url!r} is plain http://, where "
            f"it would not be used: {fix}, or use the broker's https:// URL."
        )
    values: dict[str, Any] = {"broker_url": args.broker_url, "ca_cert": args.ca_bundle}
    if args.allow_insecure_http:
        values["allow_insecure_http"] = True
    return values


def client(args: argparse.Namespace) -> BrokerSandboxClient:
    """A client with the settings the options give (the rest from the environment)."""
    from ..client._client import BrokerSandboxClient

    return BrokerSandboxClient(**given(args))


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the options give (those from the environment left out)."""
    return {k: v for k, v in settings(args).items() if v is not None}
