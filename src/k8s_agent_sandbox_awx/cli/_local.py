"""``agent-sandbox-awx dev`` and ``agent-sandbox-awx demo`` (dispatched here by the CLI)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from ..credentials._cache import clear_credential_cache
from ..testing import EXTRA_HINT, IsolationUnavailable, isolation_warning, local_isolation
from ._dev_issuers import add_options as add_issuer_options
from ._dev_issuers import claims_of, identity_line, keep_token_rotated
from ._dev_state import DevState, certificates, default_state_dir, port_error

DEMO_CODE = """\
from k8s_agent_sandbox_awx import Sandbox

with Sandbox.create() as sandbox:
    print(sandbox.commands.run("python3 -c 'print(6 * 7)'").stdout)
"""
ISOLATIONS = ("auto", "bwrap", "none")
_ABOUT_ISOLATION = (
    "Local sandboxes run in bubblewrap (namespaces of their own, not a virtual machine) when it "
    "works here, else as host processes with NO isolation: development and tests only, never "
    "untrusted code. The warning printed at start says which, and what it does not protect."
)


def _add_isolation(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--isolation",
        choices=ISOLATIONS,
        default=None,
        help="auto: bubblewrap when it works here, else none; bwrap: fail without it; none: "
        "host processes (default: $AGENT_SANDBOX_LOCAL_ISOLATION, else auto)",
    )


def _isolation_line(broker: Any) -> str:
    """Which isolation the started ``broker``'s sandboxes have, and why (one line)."""
    info = broker.isolation_info
    return f"isolation {info.describe()}" if info else "isolation of a custom backend"


def _warn(broker: Any) -> None:
    info = broker.isolation_info
    warning = isolation_warning(info.mode if info else None)
    print(f"WARNING: {_isolation_line(broker)}. {warning}", file=sys.stderr, flush=True)


def local_isolation_report() -> dict[str, str | None]:
    """What ``doctor`` says of local sandboxes here (``dev``, ``demo``, ``LocalBroker()`` as
    ``$AGENT_SANDBOX_LOCAL_ISOLATION`` asks): ``mode`` (``"bwrap"``, ``"none"``, or ``None``
    when the isolation asked for cannot be had) and ``detail`` (why, and the fix)."""
    try:
        info = local_isolation()
    except (ValueError, IsolationUnavailable) as exc:
        return {"mode": None, "detail": " ".join(str(exc).split())}
    return {"mode": info.mode, "detail": info.describe()}


def _import_broker() -> type:
    try:
        from ..testing._broker import LocalBroker
    except ImportError as exc:
        raise SystemExit(f"agent-sandbox-awx: {EXTRA_HINT} ({exc})") from None
    return LocalBroker


def _dev_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agent-sandbox-awx dev",
        description="Run the local broker stack (issuers, broker, local sandboxes) in the "
        "foreground. " + _ABOUT_ISOLATION,
    )
    _add_isolation(parser)
    parser.add_argument("--namespace", default="default", help="token namespace (default)")
    parser.add_argument(
        "--service-account", default="default", help="token service account (default)"
    )
    parser.add_argument(
        "--ttl", type=int, default=3600, help="token lifetime in seconds; rotated at 80%%"
    )
    parser.add_argument(
        "--token-file",
        default=None,
        help="where to keep the projected token (default: in the state directory, removed "
        "when dev stops)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="the port on 127.0.0.1 (default: the last start's in this state directory when it "
        "is free, else a free one); 0: a free one",
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="where dev keeps its CA, server certificate, token file and record, so that the "
        "exported lines survive a restart; one dev at a time (default: "
        "${XDG_STATE_HOME:-~/.local/state}/k8s-agent-sandbox-awx/dev)",
    )
    add_issuer_options(parser)
    parser.add_argument(
        "--protocols",
        default="v1,rpc",
        help="control-plane dialects to serve, comma-separated: v1, rpc (default: v1,rpc)",
    )
    return parser


def dev_main(argv: list[str]) -> int:
    """Run the local stack in the foreground; print the ``export`` lines; stop on Ctrl-C."""
    parser = _dev_parser()
    args = parser.parse_args(argv)
    if args.ttl < 10:
        parser.error("--ttl must be at least 10 seconds")
    protocols = tuple(p.strip() for p in args.protocols.split(",") if p.strip())
    if not protocols or not set(protocols) <= {"v1", "rpc"}:
        parser.error(f"--protocols {args.protocols!r}: give v1, rpc or v1,rpc")
    if args.port is not None and not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: give a port from 1 to 65535 (0: a free one)")
    args.claims = claims_of(parser, args)
    local_broker = _import_broker()
    state = DevState(args.state_dir or default_state_dir()).hold()
    token_file = args.token_file or state.token_file
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        _serve(local_broker, args, protocols, (state, token_file), stop)
    except (IsolationUnavailable, ValueError) as exc:  # --isolation bwrap without bwrap, ...
        raise SystemExit(f"agent-sandbox-awx dev: {exc}") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        if args.token_file is None:  # its issuer's keys are gone: a token of no use
            state.remove_token()
        state.release()
    return 0


@contextlib.contextmanager
def _started(
    local_broker: type, args: argparse.Namespace, protocols: Any, state: DevState
) -> Iterator[Any]:
    """The broker of the state directory's port and certificates, started (the port's
    trouble said with the fix), its record written; stopped at the end."""
    host = "127.0.0.1"
    port = state.port(args.port, host)
    broker = local_broker(
        warn=False,
        protocols=protocols,
        isolation=args.isolation,
        host=host,
        port=port,
        tls=certificates(state.directory, host),
    )
    try:
        broker.start()
    except OSError as exc:
        said = port_error(exc, port, asked=args.port is not None)
        if said is None:
            raise
        raise SystemExit(said) from None
    try:
        state.write_record(
            url=broker.url,
            port=int(broker.url.rsplit(":", 1)[1]),
            ca_bundle=broker.ca_bundle,
            token_file=os.path.abspath(args.token_file or state.token_file),
        )
        yield broker
    finally:
        broker.stop()


def _serve(
    local_broker: type,
    args: argparse.Namespace,
    protocols: tuple[str, ...],
    files: tuple[DevState, str],
    stop: threading.Event,
) -> None:
    """Run the broker until ``stop`` is set or Ctrl-C, keeping the token file rotated."""
    state, token_file = files
    with _started(local_broker, args, protocols, state) as broker:
        stop_rotating: Callable[[], None] = _nothing
        try:  # from here on Ctrl-C stops the broker quietly (even right after the exports)
            stop_rotating = _announce(broker, args, token_file)
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            stop_rotating()
        print("# stopping the local broker", file=sys.stderr, flush=True)


def _nothing() -> None:
    return None


def _announce(broker: Any, args: argparse.Namespace, token_file: str) -> Callable[[], None]:
    """The warning, the token file written (and kept rotated: what stops that is returned),
    the exports and the line that says the broker is up."""
    _warn(broker)
    stop_rotating = keep_token_rotated(broker, args, args.claims, token_file)
    print(f"export AGENT_SANDBOX_BROKER_URL={shlex.quote(broker.url)}")
    print(f"export AGENT_SANDBOX_CA_BUNDLE={shlex.quote(broker.ca_bundle)}")
    print(f"export AGENT_SANDBOX_TOKEN_FILE={shlex.quote(os.path.abspath(token_file))}")
    print(
        f"# local broker up in {broker.startup_seconds:.3f} s as "
        f"{identity_line(args, args.claims)}, serving "
        f"{' and '.join(broker.protocols)}; sandboxes' {_isolation_line(broker)}; the "
        "token file is rotated at 80% of its lifetime. Ctrl-C stops it.",
        flush=True,
    )
    return stop_rotating


def demo_main(argv: list[str]) -> int:
    """Start the local stack, run the README example zero-arg, print its output, stop."""
    parser = argparse.ArgumentParser(
        prog="agent-sandbox-awx demo",
        description="Run the README example against a throw-away local broker. " + _ABOUT_ISOLATION,
    )
    _add_isolation(parser)
    args = parser.parse_args(argv)
    local_broker = _import_broker()
    saved = dict(os.environ)
    try:
        with local_broker(warn=False, isolation=args.isolation) as broker:
            _warn(broker)
            print(
                f"# local broker at {broker.url} (started in {broker.startup_seconds:.3f} s; "
                f"sandboxes' {_isolation_line(broker)})"
            )
            os.environ.update(broker.environ("kubernetes"))
            for name in ("AGENT_SANDBOX_TOKEN", "AGENT_SANDBOX_TEMPLATE"):
                os.environ.pop(name, None)
            clear_credential_cache()
            print("# running:")
            print(
                "\n".join(("#   " + line).rstrip() for line in DEMO_CODE.splitlines()), flush=True
            )
            namespace: dict[str, object] = {"__name__": "__agent_sandbox_demo__"}
            exec(compile(DEMO_CODE, "<agent-sandbox-awx demo>", "exec"), namespace)  # noqa: S102
    except Exception as exc:
        print(f"agent-sandbox-awx demo failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
        clear_credential_cache()
    return 0
