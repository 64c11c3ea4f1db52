"""``agent-sandbox-awx explain``: which credential provider gives the token for the broker, and
why the others do not (issue 30). The broker URL is read as every command reads it
(``--broker-url``, else ``AGENT_SANDBOX_BROKER_URL``); in a CI job the claims that name a person
are not printed (:mod:`._ci`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ._ci import PERSONAL_CLAIMS, ci_name, ci_note, claim_text
from ._common import json_option, print_json

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="show which credential provider gives the token for the broker, and why the "
        "others do not (the token's claims decoded, never its signature)",
    )
    json_option(p)


def run(args: argparse.Namespace, settings_of: Callable[[argparse.Namespace], Any]) -> int:
    from ..client.http._config import BrokerConnectionConfig
    from ..credentials._chain import explain

    settings = {k: v for k, v in settings_of(args).items() if v is not None}
    explanation = explain(BrokerConnectionConfig.from_env(**settings).audience)
    found = explanation.selected is not None and explanation.error is None
    if args.json:
        data = explanation.to_dict()
        if data["claims"] and ci_name():
            payload = data["claims"].get("payload", {})
            for key in PERSONAL_CLAIMS & payload.keys():
                payload[key] = None
        print_json(data)
        return 0 if found else 1
    print(f"credentials for {explanation.audience}:")
    width = max((len(d.name) for d in explanation.decisions), default=0)
    for d in explanation.decisions:
        print(f"  {d.name:<{width}}  {d.status:<14}  {d.detail}")
    if explanation.selected is not None:
        print(f"selected: {explanation.selected}")
    if explanation.claims is not None:
        print("token claims (decoded, not verified; signature omitted):")
        for part in ("header", "payload"):
            for key, value in sorted(explanation.claims.get(part, {}).items()):
                print(f"  {claim_text(part, key, value)}")
        if note := ci_note(explanation.claims.get("payload", {})):
            print(note)
    if explanation.error is not None:
        print("error:")
        for line in str(explanation.error).splitlines():
            print(f"  {line}")
    return 0 if found else 1
