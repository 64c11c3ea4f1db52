"""``run_code`` benchmarks against the local broker (loopback HTTPS). Prints numbers; asserts
nothing.

    python bench/bench_code.py [--runs 100] [--path-prefix DIR]

1. ``run_code("1 + 1")`` round trip in a warm context (its interpreter runs already): the
   streamed start and the execution's events through the broker, the cell in the interpreter;
2. the first ``run_code`` of a new context: the same plus starting its interpreter (the
   sandbox's ``python3`` with the kernel program, and IPython where it is installed);
3. ``commands.run("python3 -c 'print(1 + 1)'")``: what the same work costs without a kept
   interpreter (a new Python each time), the baseline the ratios are to;
4. ``commands.run("true")``: one command's round trip, for scale.

``--path-prefix DIR``: ``DIR`` goes first on the ``PATH`` of the contexts and the commands (a
``python3`` of your choice: one without IPython, one that is not a shim). The broker runs in
this process and shares the machine's cores.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from k8s_agent_sandbox_awx import Sandbox
from k8s_agent_sandbox_awx.testing import LocalBroker


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(int(len(ordered) * 0.9) - 1, 0)]


def _timed(runs: int, call: Callable[[], object]) -> list[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
    return out


def _line(name: str, values: list[float], base: list[float] | None = None) -> str:
    median = statistics.median(values) * 1e3
    text = f"  {name:<46} median {median:8.2f} ms  p90 {_p90(values) * 1e3:8.2f} ms"
    if base:
        text += f"  ({median / (statistics.median(base) * 1e3):5.2f}x)"
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--path-prefix", default=None)
    args = parser.parse_args()
    with (
        LocalBroker(warn=False) as broker,
        Sandbox.create(environ=broker.environ("kubernetes")) as sandbox,
    ):
        path = sandbox.commands.run("echo $PATH").stdout.strip()
        envs = {"PATH": f"{args.path_prefix}:{path}"} if args.path_prefix else None
        context = sandbox.create_code_context(envs=envs)
        sandbox.run_code("1", context=context)  # its interpreter starts
        python = "python3 -c 'print(1 + 1)'"
        assert sandbox.commands.run(python, envs=envs).stdout == "2\n"
        baseline = _timed(args.runs, lambda: sandbox.commands.run(python, envs=envs))
        warm = _timed(args.runs, lambda: sandbox.run_code("1 + 1", context=context))
        sandbox.remove_code_context(context)
        starts: list[float] = []
        for _ in range(max(3, args.runs // 10)):
            context = sandbox.create_code_context(envs=envs)
            start = time.perf_counter()
            sandbox.run_code("1 + 1", context=context)
            starts.append(time.perf_counter() - start)
            sandbox.remove_code_context(context)
        true = _timed(args.runs, lambda: sandbox.commands.run("true"))
        probe = "python3 -c 'import IPython' 2>/dev/null && echo IPython || echo 'no IPython'"
        ipython = sandbox.commands.run(probe, envs=envs).stdout.strip()
    print(f"run_code against the local broker ({args.runs} runs; the sandbox's python3: {ipython})")
    print(_line('commands.run("python3 -c ...") (baseline)', baseline))
    print(_line('run_code("1 + 1"), warm context', warm, baseline))
    print(_line("first run_code of a new context", starts, baseline))
    print(_line('commands.run("true")', true, baseline))


if __name__ == "__main__":
    main()
