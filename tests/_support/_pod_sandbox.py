"""The stand-in kubelet's container supervisor: one process per container run, which leaves
nothing behind.

Run as ``python _pod_sandbox.py LOG PID_VARIABLE -- ARGV...`` (by path; standard library only).
It becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``), starts ``ARGV`` (the sandbox runtime,
the pod's one container) in its own session with stdout and stderr to ``LOG`` and this
process's pid in the environment variable ``PID_VARIABLE`` (a runtime that watches its parent
dies with it), prints ``pid N`` (the container's pid, also its process group) and waits.
Whatever the container starts stays below this process, even in another session or once its
own parent died: when the container ends, for whatever reason (a crash is a ``SIGKILL`` to its
group), every process left below is killed and reaped, then this process exits with the
container's status (``128 + signal`` for a signal). ``SIGTERM`` (a pod deletion) is passed to
the container, which has ``GRACE`` seconds before it is killed. This process dies with the
thread that started it (``PR_SET_PDEATHSIG``: ``SIGTERM``) and exits at once if its parent is
not the one named by ``STANDIN_KUBELET_PID``. A restart of the container is a new supervisor.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys

GRACE = 2.0
PARENT_ENV = "STANDIN_KUBELET_PID"
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _children() -> list[int]:
    """This process's direct children (orphans reparent here: we are a subreaper)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            found.append(int(entry))
    return found


def _kill_everything_below() -> None:
    """SIGKILL each child (and its group) and reap it, until no child is left: grandchildren
    reparent here as their parents die, and are found on the next round."""
    for _ in range(1000):
        children = _children()
        if not children:
            return
        for pid in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def main(argv: list[str]) -> int:
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    expected = os.environ.pop(PARENT_ENV, "")
    if expected and os.getppid() != int(expected):
        return 1  # the kubelet died before we were ready: nothing to run for
    log, pid_variable = argv[0], argv[1]
    command = argv[argv.index("--") + 1 :]
    container: list[subprocess.Popen[bytes]] = []

    def terminate(*_: object) -> None:
        if not container:
            os._exit(0)  # nothing started yet: nothing to clean up
        with contextlib.suppress(ProcessLookupError):
            os.killpg(container[0].pid, signal.SIGTERM)
        signal.setitimer(signal.ITIMER_REAL, GRACE)

    def kill(*_: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(container[0].pid, signal.SIGKILL)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGALRM, kill)
    env = {**os.environ, pid_variable: str(os.getpid())}  # the container dies with us too
    with open(log, "ab") as out:
        container.append(
            subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
    print(f"pid {container[0].pid}", flush=True)
    while True:  # blocks (no polling): any child's exit wakes it, a signal handler runs between
        pid, status = os.waitpid(-1, 0)
        if pid == container[0].pid:
            break
    _kill_everything_below()
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
