"""Sandbox pods as real containers of the runtime image, on the stand-in node.

The stand-in kubelet (``_kubelet.py``) runs a pod whose container names an image of its node
(``Kubelet.images``: image reference -> the export ``.ci/images`` made) as a runc container of
that image (``_oci.py``), under the pod's securityContext and with its volumes; every other pod
stays a host process (the tests that need only the control plane: a container adds nothing
there). ``runtime_registry()`` is that mapping for the runtime image: the reference the example
template names (deploy/examples/awx-runtime.yaml, as a registry would serve it), and
``example_pod_spec()`` is that template's pod spec, unmodified: what tests run is what the
example deploys.

One departure from a real node: every pod shares the host's network namespace (traffic stays
on loopback), so the pod's listen address (the runtime's ``--host``, ``::`` in the template) is
the pod's own ``127.0.0.N``, as every pod has an address of its own on a real node.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from tests._support import _oci
from tests._support.deploy import EXAMPLES, find, render

if TYPE_CHECKING:
    from tests._support.controller import StandInController

RUNTIME_TEMPLATE: Final = "awx-runtime"
"""The example SandboxTemplate that runs this project's runtime image."""


def example_template() -> dict[str, Any]:
    return find(render(EXAMPLES), "SandboxTemplate", RUNTIME_TEMPLATE)


def example_pod_spec() -> dict[str, Any]:
    """The pod spec of the example template (a copy)."""
    return copy.deepcopy(example_template()["spec"]["podTemplate"]["spec"])


def runtime_reference() -> str:
    [container] = example_pod_spec()["containers"]
    return str(container["image"])


def runtime_registry() -> dict[str, _oci.Image]:
    """{the example's image reference: the built runtime image}; raises ``ImagesMissing``."""
    return {runtime_reference(): _oci.find_image("runtime")}


def start(
    image: _oci.Image,
    pod_spec: dict[str, Any],
    container: dict[str, Any],
    folder: Path,
    *,
    name: str,
    ip: str,
) -> _oci.Container:
    """Start ``container`` of the pod as a real container (its files in ``folder``), its
    listen address (``--host``) the pod's ``ip``."""
    argv = _oci.kubelet_argv(image, container)
    if "--host" in argv:
        argv[argv.index("--host") + 1] = ip
    started = _oci.pod_container(
        image, pod_spec, container, _oci.PodFiles(folder), hostname=name, args=argv
    )
    return started.start()


def runtime_pods(controller: StandInController) -> dict[str, Any] | None:
    """Make ``controller``'s node run the runtime image and return the example pod spec for a
    template; without the image, ``None`` (the stand-in's host processes) with a warning,
    unless ``AGENT_SANDBOX_REQUIRE_IMAGES`` is set (CI): then ``ImagesMissing``."""
    try:
        controller.kubelet.images.update(runtime_registry())
    except _oci.ImagesMissing as exc:
        if _oci.images_required():
            raise
        warnings.warn(f"sandbox pods run as host processes: {exc}", stacklevel=2)
        return None
    return example_pod_spec()


def alive_in(containers: list[_oci.Container], pid: int) -> bool:
    """Whether a process numbered ``pid`` in one of ``containers``' PID namespaces runs (not a
    zombie): what a command reports as its pid is its number there, not on this host."""
    namespaces = set()
    for container in containers:
        with contextlib.suppress(OSError):
            namespaces.add(os.stat(f"/proc/{container.pid()}/ns/pid").st_ino)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/pid").st_ino not in namespaces:
                continue
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("NSpid", "").split()[-1:] == [str(pid)]:
            return not fields.get("State", "").strip().startswith(("Z", "X"))
    return False
