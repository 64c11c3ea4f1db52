"""The stand-in node: a scheduler and a kubelet whose pods are local sandbox runtimes.

The test API server has no scheduler and no kubelet, so a Pod the stand-in Sandbox controller
creates would stay Pending forever. ``Kubelet`` plays both for the pods it is given:

- scheduler: a Pod with no ``spec.nodeName`` is bound (``pods/binding``) to this node, which
  sets ``nodeName`` and the Pod's ``PodScheduled`` condition as kube-scheduler's binding does;
- kubelet: a Pod bound to this node runs as one process group: the pod's container is the
  project's sandbox runtime (``RUNTIME_MODULE``) listening on the Pod's own address
  ``127.x.y.z`` (each pod another one, like pod IPs) and the same port for every pod (8888 by
  default), in a temporary base directory of its own, with the container's ``env``, under a
  supervisor (``_pod_sandbox.py``) that leaves no process behind. The kubelet writes the Pod's
  status through the status subresource: ``Running`` with its IP once the container runs,
  ``Ready`` once ``GET /`` answers (plus ``ready_delay``); a container that dies makes the Pod
  not Ready and is restarted after ``restart_delay`` (``restartPolicy`` Always or OnFailure;
  a real kubelet's back-off starts at 10 s) or ends the Pod (``Failed``/``Succeeded``:
  ``restartPolicy: Never``). A deleted Pod (``deletionTimestamp``: the API server waits for
  the kubelet of a bound Pod) has its processes killed and folder removed, then is deleted for
  good (grace period 0), as a kubelet does.

A pod whose container's ``image`` is one of the node's ``images`` (``_pod_containers.py``: the
runtime image CI builds, under the reference the example template names) runs instead as a
real container of that image (runc, ``_oci.py``): the pod's securityContext, read-only root and
volumes as a kubelet applies them, a new writable layer for each restart, SIGTERM then SIGKILL
at deletion; its listen address (``--host``) is the pod's ``127.x.y.z``, as every pod shares
the host's network namespace here.

Only Pods bound to this node are run, and each ``Kubelet`` is a node of its own name, so the
Pods of an earlier test's stand-in (bound to a node that is gone) are left alone. ``stop()``
kills every pod's processes and removes the work folder.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx

import k8s_agent_sandbox_awx
from tests._support import _agent_sandbox as rules
from tests._support import _oci, _pod_containers
from tests._support.kube import KubeError

log = logging.getLogger("tests.standin")

RUNTIME_MODULE: Final = "k8s_agent_sandbox_awx.broker.runtime"
"""The sandbox runtime each pod runs as ``python -m RUNTIME_MODULE --host IP --port PORT
--base-dir DIR``: the one place its module path is written."""
RUNTIME_PARENT_ENV: Final = "AGENT_SANDBOX_RUNTIME_PARENT_PID"
"""The runtime's variable naming the process it dies with (its supervisor)."""
SUPERVISOR: Final = Path(__file__).with_name("_pod_sandbox.py")
_PACKAGE_ROOT: Final = str(Path(k8s_agent_sandbox_awx.__file__).resolve().parents[1])
_ENV_PASSED: Final = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TZ")
_TICK: Final = 0.02


def runtime_argv(host: str, port: int, base_dir: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        RUNTIME_MODULE,
        "--host",
        host,
        "--port",
        str(port),
        "--base-dir",
        base_dir,
    ]


class _Addresses:
    """Pod IPs: ``127.A.B.C`` from a random ``127.A.B`` block per node, never handed out twice,
    each checked free on the pod port (another session's pods share the loopback range)."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._next = (random.randint(16, 250) << 16) | (random.randint(0, 255) << 8) | 2

    def take(self) -> str:
        for _ in range(4096):
            value, self._next = self._next, self._next + 1
            if value & 0xFF in (0, 1, 255):
                continue
            address = f"127.{value >> 16 & 0xFF}.{value >> 8 & 0xFF}.{value & 0xFF}"
            if self._free(address):
                return address
        raise RuntimeError(f"no free loopback address for port {self._port}")

    def _free(self, address: str) -> bool:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, self._port))
            except OSError:
                return False
        return True


@dataclass
class _Pod:
    """What the kubelet knows of one pod it runs."""

    namespace: str
    name: str
    uid: str
    ip: str
    folder: Path
    restart_policy: str
    container: dict[str, Any]
    scheduled: dict[str, Any]
    started: str = field(default_factory=rules.now_time)
    process: subprocess.Popen[bytes] | None = None
    runtime_pid: int = 0
    container_started: str = ""
    ready: bool = False
    ready_at: float | None = None
    restarts: int = 0
    restart_at: float | None = None
    phase: str = "Running"
    exit_code: int | None = None
    finished: str = ""
    transitions: dict[str, tuple[str, str]] = field(default_factory=dict)
    written: dict[str, Any] | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    oci: _oci.Container | None = None
    mounts: dict[str, Path] = field(default_factory=dict)
    """The container's emptyDir mounts: mount path -> the pod's own folder for it."""

    @property
    def base_dir(self) -> Path:
        return self.folder / "app"


def _empty_dirs(spec: dict[str, Any], container: dict[str, Any], folder: Path) -> dict[str, Path]:
    """The container's emptyDir volume mounts (mount path -> a folder of the pod's own, made
    now): a host process cannot mount them, so a path under one in the container's ``env``
    (the example template's ``SANDBOX_WORKSPACE_DIR=/workspace``) is given that folder."""
    empty = {v["name"] for v in spec.get("volumes") or [] if "emptyDir" in v}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts") or []:
        if mount.get("name") in empty:
            mounts[str(mount["mountPath"]).rstrip("/")] = folder / "volumes" / str(mount["name"])
    for host in mounts.values():
        host.mkdir(parents=True, exist_ok=True)
    return mounts


def _in_mounts(value: str, mounts: dict[str, Path]) -> str:
    for path, host in mounts.items():
        if value == path or value.startswith(path + "/"):
            return str(host) + value[len(path) :]
    return value


class Kubelet:
    """See the module docstring. ``on_pod`` is the Pod informer's handler."""

    def __init__(
        self,
        client: Callable[[], httpx.Client],
        workdir: Path,
        *,
        port: int,
        node_name: str,
        ready_delay: float = 0.0,
        restart_delay: float | None = 1.0,
    ) -> None:
        self.node_name, self.port, self.workdir = node_name, port, workdir
        self.ready_delay, self.restart_delay = ready_delay, restart_delay
        self._client_factory = client
        self._events: queue.SimpleQueue[tuple[str, dict[str, Any]]] = queue.SimpleQueue()
        self._pods: dict[str, _Pod] = {}
        self._to_bind: dict[str, dict[str, Any]] = {}
        self._to_finalize: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._addresses = _Addresses(port)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="standin-kubelet", daemon=True)
        self._probe = httpx.Client(timeout=0.5, trust_env=False)
        self._api: httpx.Client | None = None
        self.errors: list[str] = []
        self.images: dict[str, _oci.Image] = {}
        """The node's images: a pod whose container's ``image`` is a key here runs as a real
        container of that image (``_pod_containers.start``); any other, as a host process."""

    # ---------------------------------------------------------------------- the API

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._events.put(("STOP", {}))
        if self._thread.is_alive():
            self._thread.join(timeout)
        with self._lock:
            pods = list(self._pods.values())
            self._pods.clear()
        for pod in pods:  # the thread did it, unless it is stuck
            self._teardown(pod)
        self._probe.close()

    def on_pod(self, kind: str, pod: dict[str, Any], _old: dict[str, Any] | None) -> None:
        self._events.put((kind, pod))

    def kill(self, namespace: str, name: str) -> None:
        """SIGKILL the pod's container (a crash): the kubelet sees it die and acts per the
        pod's ``restartPolicy``."""
        with self._lock:
            pod = self._find(namespace, name)
            if pod is None or pod.process is None or pod.process.poll() is not None:
                raise LookupError(f"pod {namespace}/{name} has no running container here")
            if pod.oci is not None:
                pod.oci.signal("KILL")
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pod.runtime_pid, signal.SIGKILL)

    def address(self, namespace: str, name: str) -> str:
        with self._lock:
            pod = self._find(namespace, name)
        if pod is None:
            raise LookupError(f"pod {namespace}/{name} does not run on node {self.node_name}")
        return pod.ip

    def containers(self) -> list[_oci.Container]:
        """The real containers this node runs now (pods of its ``images``)."""
        with self._lock:
            return [p.oci for p in self._pods.values() if p.oci is not None]

    def processes(self) -> list[int]:
        """The pids of every supervisor and container this kubelet started and still runs."""
        with self._lock:
            return [
                pid
                for p in self._pods.values()
                if p.process is not None
                for pid in (p.process.pid, p.runtime_pid)
                if pid
            ]

    def _find(self, namespace: str, name: str) -> _Pod | None:
        return next(
            (p for p in self._pods.values() if p.namespace == namespace and p.name == name), None
        )

    # ---------------------------------------------------------------------- the loop

    def _run(self) -> None:
        with self._client_factory() as api:
            self._api = api
            while not self._stopping.is_set():
                try:
                    self._drain()
                    self._tick()
                except Exception as exc:  # the node carries on
                    log.exception("stand-in kubelet")
                    self.errors.append(repr(exc))
            with self._lock:
                pods = list(self._pods.values())
                self._pods.clear()
            for pod in pods:
                self._teardown(pod)

    def _drain(self) -> None:
        try:
            kind, pod = self._events.get(timeout=_TICK)
        except queue.Empty:
            return
        while True:
            if kind != "STOP":
                self._handle(kind, pod)
            try:
                kind, pod = self._events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, obj: dict[str, Any]) -> None:
        uid, spec = rules.uid(obj), obj.get("spec") or {}
        terminal = (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        if kind == "DELETED":
            self._to_bind.pop(uid, None)
            self._to_finalize.pop(uid, None)
            self._forget(uid)
        elif not spec.get("nodeName"):
            if not rules.deleting(obj) and not terminal:
                self._to_bind[uid] = obj
        elif spec["nodeName"] != self.node_name:
            return
        elif rules.deleting(obj):
            self._forget(uid)
            self._to_finalize[uid] = obj
        elif uid not in self._pods and not terminal:
            self._start_pod(obj)

    def _tick(self) -> None:
        for uid, obj in list(self._to_bind.items()):
            if self._call(self._bind, obj):
                self._to_bind.pop(uid, None)
        for uid, obj in list(self._to_finalize.items()):
            if self._call(self._finalize, obj):
                self._to_finalize.pop(uid, None)
        now = time.monotonic()
        for pod in list(self._pods.values()):
            self._check(pod, now)
            desired = self._status(pod)
            if desired != pod.written and self._call(self._write_status, pod, desired):
                pod.written = desired

    def _call(self, action: Callable[..., None], *args: Any) -> bool:
        try:
            action(*args)
        except (httpx.HTTPError, KubeError) as exc:
            if isinstance(exc, KubeError) and exc.status_code == 404:
                return True  # the pod is gone: nothing left to do
            log.info("stand-in kubelet: %s", exc)
            return False
        return True

    # ---------------------------------------------------------------------- scheduler

    def _bind(self, pod: dict[str, Any]) -> None:
        metadata = pod["metadata"]
        path = f"/api/v1/namespaces/{metadata['namespace']}/pods/{metadata['name']}/binding"
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": metadata["name"], "uid": metadata["uid"]},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name},
        }
        self._request("POST", path, json=body, conflict_ok=True)

    def _finalize(self, pod: dict[str, Any]) -> None:
        metadata = pod["metadata"]
        path = f"/api/v1/namespaces/{metadata['namespace']}/pods/{metadata['name']}"
        options = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": metadata["uid"]},
        }
        self._request("DELETE", path, json=options, conflict_ok=True)

    def _request(self, method: str, path: str, *, conflict_ok: bool = False, **kw: Any) -> None:
        assert self._api is not None
        response = self._api.request(method, path, **kw)
        if response.is_error and not (conflict_ok and response.status_code == 409):
            raise KubeError(method, path, response)

    # ---------------------------------------------------------------------- pods

    def _start_pod(self, obj: dict[str, Any]) -> None:
        metadata, spec = obj["metadata"], obj["spec"]
        containers = spec.get("containers") or [{}]
        scheduled = rules.find_condition(
            (obj.get("status") or {}).get("conditions") or [], "PodScheduled"
        )
        folder = self.workdir / metadata["namespace"] / f"{metadata['name']}-{metadata['uid'][:8]}"
        pod = _Pod(
            namespace=metadata["namespace"],
            name=metadata["name"],
            uid=metadata["uid"],
            ip=self._addresses.take(),
            folder=folder,
            restart_policy=spec.get("restartPolicy") or "Always",
            container=containers[0],
            scheduled=scheduled or rules.condition("PodScheduled", "True", "", "", 0),
            spec=spec,
        )
        pod.base_dir.mkdir(parents=True, exist_ok=True)
        pod.mounts = _empty_dirs(spec, containers[0], folder)
        with self._lock:
            self._pods[pod.uid] = pod
        self._spawn(pod)

    def _spawn(self, pod: _Pod) -> None:
        image = self.images.get(str(pod.container.get("image", "")))
        if image is not None:
            container = _pod_containers.start(image, pod.spec, pod.container, pod.folder,
                                              name=pod.name, ip=pod.ip)  # fmt: skip
            with self._lock:
                pod.oci, pod.process, pod.runtime_pid = container, container.process, 0
                pod.container_started, pod.ready, pod.ready_at = rules.now_time(), False, None
                pod.restart_at = None
            return
        env = {k: os.environ[k] for k in _ENV_PASSED if k in os.environ}
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")) if p
        )
        for entry in pod.container.get("env") or []:
            if "value" in entry:
                env[str(entry["name"])] = _in_mounts(str(entry["value"]), pod.mounts)
        env["STANDIN_KUBELET_PID"] = str(os.getpid())
        log_file = pod.folder / "container.log"
        argv = [
            sys.executable,
            str(SUPERVISOR),
            str(log_file),
            RUNTIME_PARENT_ENV,
            "--",
            *runtime_argv(pod.ip, self.port, str(pod.base_dir)),
        ]
        with log_file.open("ab") as errors:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=errors,
                env=env,
                start_new_session=True,
            )
        assert process.stdout is not None
        line = process.stdout.readline().decode().split()
        process.stdout.close()
        with self._lock:
            pod.process, pod.runtime_pid = process, int(line[1]) if len(line) == 2 else 0
            pod.container_started, pod.ready, pod.ready_at = rules.now_time(), False, None
            pod.restart_at = None

    def _check(self, pod: _Pod, now: float) -> None:
        """Notice the container's end, restart it when due, probe its readiness."""
        process = pod.process
        if process is not None and process.poll() is not None:
            self._container_ended(pod, int(process.returncode), now)
        elif process is None and pod.restart_at is not None and now >= pod.restart_at:
            self._spawn(pod)
        elif process is not None and not pod.ready:
            if pod.ready_at is None and self._answers(pod):
                pod.ready_at = now + self.ready_delay
            if pod.ready_at is not None and now >= pod.ready_at:
                pod.ready = True

    def _container_ended(self, pod: _Pod, code: int, now: float) -> None:
        log.info(
            "stand-in kubelet: pod %s/%s: container exited (%d)", pod.namespace, pod.name, code
        )
        if pod.oci is not None:
            pod.oci.remove()  # its writable layer: a restart is a new container
        with self._lock:
            pod.process, pod.runtime_pid, pod.ready, pod.exit_code = None, 0, False, code
            pod.oci = None
            pod.finished = rules.now_time()
        restarts = pod.restart_policy == "Always" or (pod.restart_policy == "OnFailure" and code)
        if restarts:
            pod.restarts += 1
            if self.restart_delay is not None:
                pod.restart_at = now + self.restart_delay
        else:
            pod.phase = "Succeeded" if code == 0 else "Failed"

    def _answers(self, pod: _Pod) -> bool:
        try:
            return self._probe.get(f"http://{pod.ip}:{self.port}/").status_code == 200
        except httpx.HTTPError:
            return False

    def _forget(self, uid: str) -> None:
        with self._lock:
            pod = self._pods.pop(uid, None)
        if pod is not None:
            self._teardown(pod)

    def _teardown(self, pod: _Pod) -> None:
        """SIGTERM the supervisor (it passes it on, then kills all below it), SIGKILL what
        is left after a grace, remove the pod's folder (a real container: SIGTERM, SIGKILL
        after the same grace, the container removed)."""
        process = pod.process
        if pod.oci is not None:
            pod.oci.stop(grace=3)
        elif process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(3)
            except subprocess.TimeoutExpired:
                for group in (process.pid, pod.runtime_pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(group, signal.SIGKILL)
                process.wait(5)
        shutil.rmtree(pod.folder, ignore_errors=True)

    # ---------------------------------------------------------------------- status

    def _status(self, pod: _Pod) -> dict[str, Any]:
        running = pod.phase == "Running"
        ready = "True" if pod.ready and running else "False"
        conditions = [
            self._condition(pod, "Initialized", "True"),
            self._condition(pod, "Ready", ready),
            self._condition(pod, "ContainersReady", ready),
            pod.scheduled,
        ]
        return {
            "phase": pod.phase,
            "hostIP": "127.0.0.1",
            "podIP": pod.ip,
            "podIPs": [{"ip": pod.ip}],
            "startTime": pod.started,
            "conditions": conditions,
            "containerStatuses": [self._container_status(pod, ready == "True")],
        }

    def _condition(self, pod: _Pod, kind: str, status: str) -> dict[str, Any]:
        previous = pod.transitions.get(kind)
        if previous is None or previous[0] != status:
            pod.transitions[kind] = previous = (status, rules.now_time())
        found = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": previous[1],
        }
        if status != "True" and kind in ("Ready", "ContainersReady"):
            done = pod.phase != "Running"
            found["reason"] = "PodCompleted" if done else "ContainersNotReady"
            if not done:
                found["message"] = f"containers with unready status: [{pod.container.get('name')}]"
        return found

    def _container_status(self, pod: _Pod, ready: bool) -> dict[str, Any]:
        if pod.process is not None:
            state: dict[str, Any] = {"running": {"startedAt": pod.container_started}}
        elif pod.phase == "Running":
            state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off restarting failed container {pod.name}",
                }
            }
        else:
            state = {
                "terminated": {
                    "exitCode": pod.exit_code or 0,
                    "reason": "Completed" if pod.exit_code == 0 else "Error",
                    "startedAt": pod.container_started,
                    "finishedAt": pod.finished,
                }
            }
        return {
            "name": pod.container.get("name", "sandbox"),
            "image": pod.container.get("image", ""),
            "imageID": "",
            "ready": ready,
            "restartCount": pod.restarts,
            "started": pod.process is not None,
            "state": state,
        }

    def _write_status(self, pod: _Pod, status: dict[str, Any]) -> None:
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status"
        patch = {"metadata": {"uid": pod.uid}, "status": status}  # the uid: a precondition
        self._request(
            "PATCH",
            path,
            content=json.dumps(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )
