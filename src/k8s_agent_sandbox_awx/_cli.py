"""``agent-sandbox-awx``: whoami, doctor, run, ls, kill (and dev/demo from the [local] extra).

Imports are deferred to the subcommand that needs them, so ``--help`` and ``--version`` are
fast and never fail for a missing optional dependency. Errors print ``agent-sandbox-awx: error:``
and the message (a list in it stays one item per line, indented) and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._client import BrokerSandboxClient

__all__ = ["main"]

PROG = "agent-sandbox-awx"
# from a clone: the index has an unrelated package of this name until a release exists
_LOCAL_EXTRA = (
    'python3 -m pip install -e ".[local]" in a clone of the k8s-agent-sandbox-awx repository'
)
_INSECURE_FLAG = "--allow-insecure-http"


class _CliError(Exception):
    """A failure already explained for the user (exit code attached)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _seconds(*, positive: bool) -> Callable[[str], float]:
    """An argparse type: a number of seconds, > 0 (``positive``) or >= 0."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or not (value > 0 if positive else value >= 0):
            rule = "a number of seconds greater than 0" if positive else "a number of seconds >= 0"
            raise argparse.ArgumentTypeError(f"{text!r} is not {rule}")
        return value

    parse.__name__ = "seconds"
    return parse


def _parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Kubernetes agent sandboxes through an OIDC identity broker.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--broker-url", help="the broker's https:// URL (default: $AGENT_SANDBOX_BROKER_URL)"
    )
    parser.add_argument(
        "--ca-bundle",
        help="CA bundle for the broker (default: "
        "$AGENT_SANDBOX_CA_BUNDLE, else the system trust store)",
    )
    parser.add_argument(
        _INSECURE_FLAG,
        action="store_true",
        help="allow a plain http:// broker URL on this machine (127.0.0.1, ::1, localhost): "
        "local development only, the token travels unencrypted",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("whoami", help="show the identity the broker verified for your token")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("doctor", help="check configuration, credentials, TLS and the broker")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("run", help="create a sandbox, run one command, print its output, kill it")
    p.add_argument(
        "--template",
        help="sandbox template (default: $AGENT_SANDBOX_TEMPLATE, "
        "else the broker policy's default)",
    )
    p.add_argument(
        "--timeout",
        type=_seconds(positive=True),
        default=300,
        help="command time limit in seconds",
    )
    p.add_argument(
        "--ready-timeout",
        type=_seconds(positive=False),
        default=None,
        help="seconds to wait for the sandbox to become ready",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARG...]")
    p = sub.add_parser("ls", help="list my sandboxes")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--selector", help="label selector k1=v1,k2=v2")
    p = sub.add_parser("kill", help="delete sandboxes by name (already gone is fine)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("names", nargs="+", metavar="NAME")
    for name, text in (
        ("dev", "run a local broker (needs the [local] extra)"),
        ("demo", "run a demo against a local broker (needs the [local] extra)"),
    ):
        p = sub.add_parser(name, help=text, add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The connection settings from the options (``None``: from the environment). The broker
    URL is checked here first, so that the fixes its errors name are the CLI's (a flag, not a
    keyword argument)."""
    from ._config import ENV_BROKER_URL, normalize_broker_url
    from ._exceptions import ConfigurationError

    url = args.broker_url or os.environ.get(ENV_BROKER_URL)
    if not url:
        raise ConfigurationError(
            f"No broker URL: set the environment variable {ENV_BROKER_URL} to the broker's "
            "https:// URL, or pass --broker-url URL."
        )
    normalize_broker_url(
        url, allow_insecure_http=args.allow_insecure_http, insecure_option=_INSECURE_FLAG
    )
    settings: dict[str, Any] = {"broker_url": args.broker_url, "ca_cert": args.ca_bundle}
    if args.allow_insecure_http:
        settings["allow_insecure_http"] = True
    return settings


def _client(args: argparse.Namespace) -> BrokerSandboxClient:
    from ._client import BrokerSandboxClient

    settings = {k: v for k, v in _settings(args).items() if v is not None}
    return BrokerSandboxClient(**settings)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


# ------------------------------------------------------------------------------ subcommands


def _cmd_whoami(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        who = client.whoami()
    finally:
        client.close()
    if args.json:
        _print_json(who)
        return 0
    print(f"provider:   {who.get('provider')}")
    print(f"issuer:     {who.get('issuer')}")
    print(f"subject:    {who.get('subject')}")
    print(f"audience:   {who.get('audience')}")
    print(f"expires_at: {who.get('expires_at')}")
    for key, value in sorted((who.get("attributes") or {}).items()):
        print(f"  {key}: {value}")
    policy = who.get("policy") or {}
    if policy:
        print("policy:")
        for key, value in sorted(policy.items()):
            print(f"  {key}: {value}")
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        items = client.list_sandboxes(args.selector)
    finally:
        client.close()
    if args.json:
        _print_json([item.to_dict() for item in items])
        return 0
    if not items:
        print("no sandboxes")
        return 0
    rows = [("NAME", "PHASE", "TEMPLATE", "NAMESPACE", "EXPIRES")]
    rows += [(i.name, i.phase, i.template or "-", i.namespace, i.expires_at or "-") for i in items]
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0


def _cmd_kill(args: argparse.Namespace) -> int:
    client = _client(args)
    done: list[dict[str, Any]] = []
    try:
        for name in args.names:
            existed = client._delete(name)
            done.append({"name": name, "deleted": existed})
            if not args.json:
                print(f"{name}: {'deleted' if existed else 'already gone'}")
    finally:
        client.close()
        if args.json:  # also after an error: the names handled so far
            _print_json(done)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    import shlex

    from ._exceptions import CommandTimeoutError

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise _CliError(f"run: no command given; use `{PROG} run -- COMMAND [ARG...]`.", 2)
    command = shlex.join(cmd)
    client = _client(args)
    try:
        with client.create_sandbox(
            template=args.template, sandbox_ready_timeout=args.ready_timeout
        ) as sandbox:
            try:
                result = sandbox.commands.run(command, timeout=args.timeout)
            except CommandTimeoutError as exc:
                if exc.result is not None:
                    _print_result(args, sandbox.name, exc.result)
                    if not args.json and exc.result.stderr[-1:] not in ("", "\n"):
                        sys.stderr.write("\n")
                raise _CliError(
                    f"the command ran longer than --timeout {args.timeout:g}s and was killed; "
                    "pass a larger --timeout.",
                    124,
                ) from exc
    finally:
        client.close()
    _print_result(args, sandbox.name, result)
    return result.exit_code


def _print_result(args: argparse.Namespace, sandbox: str, result: Any) -> None:
    """The command's output as it is (stdout, stderr), or with ``--json`` one JSON object."""
    if args.json:
        _print_json(
            {
                "sandbox": sandbox,
                "exit_code": result.exit_code,
                "stdout": result.stdout,
                "stderr": result.stderr,
                "timed_out": bool(result.timed_out),
            }
        )
        return
    sys.stdout.write(result.stdout)
    sys.stdout.flush()
    sys.stderr.write(result.stderr)


def _cmd_local(name: str, argv: list[str]) -> int:
    try:
        from .testing import _commands
    except ImportError as exc:
        raise _CliError(
            f"`{PROG} {name}` needs the local broker, which could not be imported "
            f"({exc.name or exc}): install the [local] extra: {_LOCAL_EXTRA}"
        ) from exc
    function = _commands.dev_main if name == "dev" else _commands.demo_main
    return int(function(argv))


class _Doctor:
    """Collects PASS/FAIL checks, each with a detail and (on failure) a hint."""

    def __init__(self) -> None:
        self.checks: list[dict[str, Any]] = []
        self.notes: list[str] = []

    def check(self, name: str, ok: bool, detail: str, hint: str = "") -> bool:
        self.checks.append({"check": name, "ok": ok, "detail": detail, "hint": "" if ok else hint})
        return ok

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)


_CREDENTIAL_HINTS = {
    "NoCredentialsError": "Set AGENT_SANDBOX_TOKEN or AGENT_SANDBOX_TOKEN_FILE, mount a projected "
    "service-account token with the broker URL as audience, or install a provider plugin.",
    "AudienceMismatchError": "Issue the token with the broker URL as its audience, or fix the "
    "broker URL if it is mistyped.",
    "TokenExpiredError": "Get a fresh token from its source (the kubelet renews projected "
    "tokens; CI tokens live as long as their job), and check this machine's clock.",
}

_NO_AUDIENCE = "audience check skipped: no broker URL (the token's audience must be the broker URL)"


def _explain_without_audience() -> Any:
    """Every provider's decision when no broker URL is configured: a token that was found is
    reported as selected, its audience unchecked (there is nothing to check it against)."""
    from dataclasses import replace

    from ._chain import explain
    from ._credential_errors import AudienceMismatchError

    explanation = explain("")
    if not isinstance(explanation.error, AudienceMismatchError):
        return explanation
    decisions = list(explanation.decisions)
    selected = None
    for i, d in enumerate(decisions):
        if d.status == "error" and d.detail.startswith("AudienceMismatchError:"):
            selected = d.name
            decisions[i] = replace(
                d, status="selected", detail=f"a token was found; {_NO_AUDIENCE}"
            )
    return replace(explanation, decisions=decisions, selected=selected, error=None)


def _doctor_credentials(doc: _Doctor, audience: str | None) -> dict[str, Any] | None:
    """The credential checks; ``audience`` ``None`` (no broker URL): the providers' decisions
    and the token's claims and expiry, the audience check skipped with a note."""
    import time

    from ._chain import explain

    explanation = _explain_without_audience() if audience is None else explain(audience)
    report = explanation.to_dict()
    if audience is None:
        report["audience"] = None
    for d in explanation.decisions:
        doc.notes.append(f"provider {d.name}: {d.status}: {d.detail}")
    hint = _CREDENTIAL_HINTS.get(
        type(explanation.error).__name__,
        "The error names the source and the fix; the details below list every provider.",
    )
    if not doc.check(
        "credentials",
        explanation.selected is not None and explanation.error is None,
        f"selected provider: {explanation.selected}"
        if explanation.selected
        else f"{type(explanation.error).__name__}: {explanation.error}",
        hint,
    ):
        return report
    claims = explanation.claims
    if claims is None:
        doc.check("token claims", True, "opaque token (not a JWT): no local checks possible")
        return report
    payload = claims.get("payload", {})
    for part in ("header", "payload"):
        for key, value in sorted(claims.get(part, {}).items()):
            doc.notes.append(f"{part}.{key} = {value!r}")
    doc.notes.append("signature = <redacted>")
    aud = payload.get("aud")
    auds = aud if isinstance(aud, list) else [aud]
    if audience is None:
        doc.notes.append(f"aud={aud!r}: {_NO_AUDIENCE}")
    else:
        from ._jwt import normalise_url

        wanted = normalise_url(audience)  # the rule the SDK applies before sending a token
        doc.check(
            "audience",
            any(isinstance(a, str) and normalise_url(a) == wanted for a in auds),
            f"aud={aud!r}, broker URL={audience!r}",
            "Request the token with the broker URL as its audience (for a projected token: "
            "serviceAccountToken.audience; for GitLab: id_tokens.<NAME>.aud).",
        )
    exp = payload.get("exp")
    if isinstance(exp, int | float):
        left = exp - time.time()
        doc.check(
            "expiry",
            left > 0,
            f"expires in {left:.0f}s" if left > 0 else f"expired {-left:.0f}s ago",
            "Refresh the token source; projected tokens are renewed by the kubelet, CI tokens "
            "by re-running the job.",
        )
    else:
        doc.check("expiry", False, "the token has no exp claim", "Use a token with an expiry.")
    return report


def _doctor_broker(doc: _Doctor, client: BrokerSandboxClient, credentials_ok: bool) -> None:
    import contextlib
    from datetime import UTC, datetime
    from email.utils import parsedate_to_datetime

    url = client.broker_url
    try:
        response = client.healthz()
    except Exception as exc:
        text = str(exc)
        if "CERTIFICATE_VERIFY_FAILED" in text or "SSL" in text:
            doc.check("reachability", True, f"{url} answered the TLS handshake")
            doc.check(
                "tls",
                False,
                " ".join(text.split()),
                "Set AGENT_SANDBOX_CA_BUNDLE (or --ca-bundle) to the CA that signed the broker's "
                "certificate.",
            )
        else:
            doc.check(
                "reachability",
                False,
                " ".join(text.split()),
                "Check the broker URL, DNS, proxies and that the broker is running.",
            )
        return
    doc.check("reachability", True, f"GET {url}/v1/healthz -> {response.status_code}")
    if url.startswith("https://"):
        ca = client.connection_config.ca_cert or "the system trust store"
        doc.check("tls", True, f"certificate verified against {ca}")
    else:
        doc.check("tls", False, "plain http:// (loopback only)", "Use https:// outside tests.")
    date = response.headers.get("date")
    broker_time = None
    if date:
        with contextlib.suppress(TypeError, ValueError):
            broker_time = parsedate_to_datetime(date)
    if broker_time is not None and broker_time.tzinfo is not None:
        skew = (datetime.now(UTC) - broker_time).total_seconds()
        doc.check(
            "clock skew",
            abs(skew) <= 60,
            f"{skew:+.1f}s against the broker's Date header",
            "Synchronise this machine's clock (NTP); tokens are rejected when clocks disagree.",
        )
    elif date:
        from ._protocol import redact_answer

        doc.check(
            "clock skew",
            False,
            f"the broker's Date header {redact_answer(date)!r} is not an HTTP date with a time "
            "zone",
            "Check that the broker URL points at an agent-sandbox broker, and compare the "
            "clocks by hand.",
        )
    else:
        doc.check("clock skew", False, "the broker sent no Date header", "Upgrade the broker.")
    if not credentials_ok:
        return
    try:
        who = client.whoami()
    except Exception as exc:
        doc.check(
            "authentication",
            False,
            " ".join(str(exc).split()),
            "See the hint above; `agent-sandbox-awx whoami` repeats this check.",
        )
        return
    doc.check(
        "authentication",
        True,
        f"the broker verified {who.get('subject')} (provider {who.get('provider')})",
    )


def _cmd_doctor(args: argparse.Namespace) -> int:
    from ._config import BrokerConnectionConfig

    doc = _Doctor()
    explanation: dict[str, Any] | None = None
    try:
        config = BrokerConnectionConfig.from_env(**_settings(args))
    except Exception as exc:
        doc.check(
            "config",
            False,
            " ".join(str(exc).split()),
            "Set AGENT_SANDBOX_BROKER_URL (and AGENT_SANDBOX_CA_BUNDLE for a private CA).",
        )
        config = None
        explanation = _doctor_credentials(doc, None)
        doc.notes.append(
            "skipped without a broker URL: audience, reachability, tls, clock skew and "
            "authentication"
        )
    if config is not None:
        doc.check("config", True, f"broker URL {config.broker_url} (the token audience)")
        explanation = _doctor_credentials(doc, config.audience)
        credentials_ok = doc.ok
        from ._client import BrokerSandboxClient
        from ._exceptions import ConfigurationError

        try:
            client = BrokerSandboxClient(config)
        except ConfigurationError as exc:  # the CA bundle or client certificate cannot be used
            doc.check(
                "tls",
                False,
                " ".join(str(exc).split()),
                "Point AGENT_SANDBOX_CA_BUNDLE (or --ca-bundle) at the PEM file of the CA that "
                "signed the broker's certificate.",
            )
        else:
            try:
                _doctor_broker(doc, client, credentials_ok)
            finally:
                client.close()
    if args.json:
        _print_json({"ok": doc.ok, "checks": doc.checks, "credentials": explanation})
    else:
        for c in doc.checks:
            print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['check']:<14} {c['detail']}")
            if c["hint"]:
                print(f"      hint: {c['hint']}")
        if doc.notes:
            print("details:")
            for note in doc.notes:
                print(f"  {note}")
    return 0 if doc.ok else 1


# ------------------------------------------------------------------------------------ main


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments and arguments[0] in ("dev", "demo"):
        # dispatched before parsing, so that `dev --help` reaches the dev command's own parser
        try:
            return _cmd_local(arguments[0], arguments[1:])
        except _CliError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return exc.code
    parser = _parser()
    args = parser.parse_args(arguments)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command in ("dev", "demo"):
        handler = None
    else:
        handler = {
            "whoami": _cmd_whoami,
            "doctor": _cmd_doctor,
            "run": _cmd_run,
            "ls": _cmd_ls,
            "kill": _cmd_kill,
        }[args.command]
    try:
        if handler is None:
            return _cmd_local(args.command, list(args.args))
        return handler(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except _CliError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.code
    except Exception as exc:
        if args.debug or os.environ.get("AGENT_SANDBOX_DEBUG"):
            raise
        first, *more = _lines(str(exc)) or [type(exc).__name__]
        print(f"{PROG}: error: {type(exc).__name__}: {first}", file=sys.stderr)
        for line in more:  # indented: no line of a message can pass for a line of its own
            print(f"  {line}", file=sys.stderr)
        return 1


def _lines(message: str) -> list[str]:
    """A message's lines with their indentation (a list in a message stays a list), other
    runs of whitespace (tabs, CRs, ...) collapsed to one space, blank lines dropped."""
    lines = []
    for line in message.splitlines():
        if words := line.split():
            indent = len(line) - len(line.lstrip(" "))
            lines.append(" " * indent + " ".join(words))
    return lines


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
