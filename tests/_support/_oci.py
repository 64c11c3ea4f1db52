"""The project's images run as real containers, with runc, as a kubelet runs a pod's container.

``.ci/images`` builds the two images and exports each (``rootfs/`` and ``image.json``, the
image's config) to the cache; ``find_image("runtime")`` finds this clone's export (waiting for a
background build, like the API server's binaries). ``podman run`` cannot run them here (the
machine lacks ``CAP_SYS_RESOURCE``: its rlimits are refused), but runc runs an OCI bundle made
from the export: ``Container`` is one such container:

- its root is an overlay of the image's rootfs with a writable layer of its own (new for every
  container, as a container runtime's snapshot), mounted read-only when the pod asks for
  ``readOnlyRootFilesystem``;
- ``/proc``, ``/dev``, ``/sys`` as runc's default spec has them, without ``process.rlimits``
  (what the machine refuses); its own PID, IPC, UTS and mount namespaces; the host's network
  namespace (each pod binds its own ``127.0.0.N``, as pods have their own IPs);
- ``mounts``: bind mounts of host folders and files (emptyDirs, ConfigMaps, Secrets);
- the process: argv, env, uid, gid and groups, cwd; no capabilities when the pod drops ALL,
  ``noNewPrivileges`` unless privilege escalation is allowed.

``pod_container`` maps a pod's container (the kubelet's rules: ``command``/``args`` over the
image's ENTRYPOINT/CMD, env over the image's, ``securityContext`` of the container over the
pod's, ``runAsNonRoot`` refused for uid 0, emptyDirs as folders of mode 0777 with the
``fsGroup``, HOME from the image's passwd or ``/``) onto one. Containers need root and runc
(``container_support()`` says why not). A container that outlives its test (a killed pytest) is
found by ``sweep()`` through the pid in its id and removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tests._support.kube import cache_root

ENV_REQUIRE: Final = "AGENT_SANDBOX_REQUIRE_IMAGES"
ENV_WAIT: Final = "AGENT_SANDBOX_IMAGES_WAIT"
ENV_IMAGE: Final = {"runtime": "AGENT_SANDBOX_TEST_RUNTIME_IMAGE",
                    "broker": "AGENT_SANDBOX_TEST_BROKER_IMAGE"}  # fmt: skip
BUILD_HINT: Final = "build them with `bash .ci/images` (as root; CI does)"
REPO_ROOT: Final = Path(__file__).resolve().parents[2]
_ID_PREFIX: Final = "awx-test-"
_ID: Final = re.compile(rf"^{_ID_PREFIX}(\d+)-[0-9a-f]+$")
_DEFAULT_CAPS: Final = (  # containerd's defaults, for a container that drops nothing
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
)  # fmt: skip


class ImagesMissing(RuntimeError):
    """The images are not built (or not for this clone's sources), or cannot run here."""


def images_required() -> bool:
    """Whether a missing image is a failure (CI sets ``AGENT_SANDBOX_REQUIRE_IMAGES=1``)."""
    return os.environ.get(ENV_REQUIRE, "").strip().lower() not in ("", "0", "false", "no")


def container_support() -> str | None:
    """Why containers cannot run here, or None."""
    if os.geteuid() != 0:
        return "running the images with runc needs root"
    if shutil.which("runc") is None:
        return "runc is not installed (apt-get install runc; .ci/images installs it)"
    return None


# ------------------------------------------------------------------------------ images


@dataclass(frozen=True)
class Image:
    """One exported image: ``rootfs`` and its config (``image.json``)."""

    folder: Path
    config: Mapping[str, Any]

    @property
    def rootfs(self) -> Path:
        return self.folder / "rootfs"

    @property
    def env(self) -> dict[str, str]:
        return dict(e.split("=", 1) for e in self.config.get("Env") or [])

    @property
    def user(self) -> tuple[int, int | None]:
        uid, _, gid = str(self.config.get("User") or "0").partition(":")
        return int(uid), int(gid) if gid else None

    def passwd(self, uid: int) -> tuple[int, str] | None:
        """(primary gid, home) of ``uid`` in the image's /etc/passwd."""
        for line in (self.rootfs / "etc" / "passwd").read_text().splitlines():
            fields = line.split(":")
            if len(fields) >= 7 and fields[2] == str(uid):
                return int(fields[3]), fields[5]
        return None

    def site_packages(self) -> Path:
        [found] = (self.rootfs / "opt" / "venv" / "lib").glob("python3*/site-packages")
        return found


def _build_files() -> tuple[Path, Path, Path]:
    """This clone's env, status and log files of ``.ci/images`` (keyed by the clone's path)."""
    key = hashlib.sha256(str(REPO_ROOT).encode()).hexdigest()[:12]
    root = cache_root()
    return root / f"images-{key}.env", root / f"images-{key}.status", root / f"images-{key}.log"


def images_wait() -> float:
    """How long ``find_image`` waits for a ``.ci/images --background`` still running, else 0."""
    _, status_file, _ = _build_files()
    status = status_file.read_text().strip() if status_file.is_file() else ""
    return float(os.environ.get(ENV_WAIT, "900")) if status.startswith("running") else 0.0


def find_image(name: str) -> Image:
    """The export of image ``name`` (``runtime`` or ``broker``): from its variable
    (``AGENT_SANDBOX_TEST_RUNTIME_IMAGE``), else from what ``.ci/images`` built for this
    clone, waiting for a background build. It must hold this clone's package: an image built
    from other sources is refused (``ImagesMissing``), never run in their place."""
    reason = container_support()
    if reason:
        raise ImagesMissing(reason)
    sweep()
    folder = os.environ.get(ENV_IMAGE[name])
    if not folder:
        env_file, status_file, log_file = _build_files()
        _wait(status_file, log_file)
        values = dict(
            line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line
        ) if env_file.is_file() else {}  # fmt: skip
        folder = values.get(ENV_IMAGE[name], "")
    if not folder or not (Path(folder) / "image.json").is_file():
        shown = folder or "no export"
        raise ImagesMissing(f"the {name} image is not built ({shown}): {BUILD_HINT}")
    image = Image(Path(folder), json.loads((Path(folder) / "image.json").read_text()))
    missing, stale = _compare_package(image)
    if missing:
        raise ImagesMissing(
            f"the {name} image at {folder} lacks {len(missing)} file(s) of the package (e.g. "
            f"{missing[0]}): is it missing from the wheel (pyproject.toml's "
            f"[tool.hatch.build]), or is the image older than the file? Rebuild: {BUILD_HINT}"
        )
    if stale:
        raise ImagesMissing(
            f"the {name} image at {folder} holds another version of {len(stale)} file(s) of "
            f"the package (e.g. {stale[0]}): rebuild it, {BUILD_HINT}"
        )
    return image


def _compare_package(image: Image) -> tuple[list[str], list[str]]:
    """The package's files (its modules and data, not bytecode) that the image lacks, and
    those whose bytes differ between this clone and the image."""
    source = REPO_ROOT / "src" / "k8s_agent_sandbox_awx"
    installed = image.site_packages() / "k8s_agent_sandbox_awx"
    missing, stale = [], []
    for path in sorted(source.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        relative = path.relative_to(source)
        copy = installed / relative
        if not copy.is_file():
            missing.append(str(relative))
        elif copy.read_bytes() != path.read_bytes():
            stale.append(str(relative))
    return missing, stale


def _wait(status_file: Path, log_file: Path) -> None:
    deadline = time.monotonic() + float(os.environ.get(ENV_WAIT, "900"))
    while True:
        status = status_file.read_text().strip() if status_file.is_file() else ""
        if status.startswith("failed"):
            tail = log_file.read_text(errors="replace")[-3000:] if log_file.is_file() else ""
            raise ImagesMissing(f".ci/images failed ({status}); the end of {log_file}:\n{tail}")
        if not status.startswith("running"):
            return
        pid = status.split()[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            raise ImagesMissing(f".ci/images (pid {pid}) died without reporting; see {log_file}")
        if time.monotonic() > deadline:
            raise ImagesMissing(f".ci/images is still running ({ENV_WAIT} raises the wait)")
        time.sleep(1)


# ------------------------------------------------------------------------------ containers


@dataclass(frozen=True)
class Mount:
    """A bind mount of a host folder or file."""

    destination: str
    source: Path
    read_only: bool = False


@dataclass
class Container:
    """One runc container of ``image`` in ``folder`` (see the module)."""

    image: Image
    folder: Path
    args: Sequence[str]
    env: Mapping[str, str]
    uid: int
    gid: int
    groups: Sequence[int] = ()
    cwd: str = "/"
    read_only_root: bool = False
    mounts: Sequence[Mount] = ()
    hostname: str = "sandbox"
    drop_all_capabilities: bool = True
    no_new_privileges: bool = True
    network_namespace: bool = False
    id: str = field(default_factory=lambda: f"{_ID_PREFIX}{os.getpid()}-{os.urandom(4).hex()}")
    process: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.folder / "container.log"

    def start(self) -> Container:
        """Mount its root, write its bundle, ``runc run`` it (runc stays its parent: its exit
        status is the container's; it passes on SIGTERM and dies with this process)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        rootfs = self.folder / "rootfs"
        for part in ("upper", "work", "rootfs"):
            (self.folder / part).mkdir(exist_ok=True)
        options = (
            f"lowerdir={self.image.rootfs},upperdir={self.folder / 'upper'},"
            f"workdir={self.folder / 'work'}"
        )
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(rootfs)],
                       check=True, capture_output=True)  # fmt: skip
        (self.folder / "config.json").write_text(json.dumps(self.spec()))
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                ["runc", "run", "--bundle", str(self.folder), self.id],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
        return self

    def spec(self) -> dict[str, Any]:
        """The OCI runtime spec (runc's default, as ``runc spec`` writes it, changed as the
        module says)."""
        caps = [] if self.drop_all_capabilities else list(_DEFAULT_CAPS)
        namespaces = ["pid", "ipc", "uts", "mount"]
        if self.network_namespace:
            namespaces.append("network")
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": self.uid, "gid": self.gid, "additionalGids": list(self.groups)},
                "args": list(self.args),
                "env": [f"{k}={v}" for k, v in self.env.items()],
                "cwd": self.cwd,
                "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
                "noNewPrivileges": self.no_new_privileges,
            },
            "root": {"path": "rootfs", "readonly": self.read_only_root},
            "hostname": self.hostname,
            "mounts": _DEFAULT_MOUNTS + [_bind(m) for m in self.mounts],
            "linux": {
                "namespaces": [{"type": kind} for kind in namespaces],
                "resources": {"devices": [{"allow": False, "access": "rwm"}]},
                "maskedPaths": _MASKED,
                "readonlyPaths": _READ_ONLY,
            },
        }

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def pid(self) -> int:
        """The host pid of the container's first process (0 when it does not run)."""
        state = subprocess.run(["runc", "state", self.id], capture_output=True, text=True)
        return int(json.loads(state.stdout).get("pid") or 0) if state.returncode == 0 else 0

    def signal(self, name: str) -> None:
        subprocess.run(["runc", "kill", self.id, name], capture_output=True)

    def exec(self, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the running container as its process runs (user, env, cwd)."""
        process = json.loads((self.folder / "config.json").read_text())["process"]
        process["args"] = list(argv)
        spec = self.folder / f"exec-{os.urandom(3).hex()}.json"
        spec.write_text(json.dumps(process))
        try:
            return subprocess.run(["runc", "exec", "--process", str(spec), self.id],
                                  capture_output=True, text=True, timeout=timeout)  # fmt: skip
        finally:
            spec.unlink()

    def stop(self, grace: float = 3.0) -> int | None:
        """SIGTERM (as a pod's deletion), SIGKILL after ``grace``; then remove it and its
        writable layer. Returns its exit status."""
        if self.process is not None and self.process.poll() is None:
            self.signal("TERM")
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal("KILL")
                self.process.wait(10)
        self.remove()
        return None if self.process is None else self.process.returncode

    def remove(self) -> None:
        subprocess.run(["runc", "delete", "--force", self.id], capture_output=True)
        rootfs = self.folder / "rootfs"
        if os.path.ismount(rootfs):
            subprocess.run(["umount", "--lazy", str(rootfs)], capture_output=True)
        shutil.rmtree(self.folder / "upper", ignore_errors=True)
        shutil.rmtree(self.folder / "work", ignore_errors=True)

    def __enter__(self) -> Container:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


_DEFAULT_MOUNTS: Final[list[dict[str, Any]]] = [
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
     "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
    {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
     "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
    {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
     "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
    {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
     "options": ["nosuid", "noexec", "nodev"]},
    {"destination": "/sys", "type": "sysfs", "source": "sysfs",
     "options": ["nosuid", "noexec", "nodev", "ro"]},
]  # fmt: skip


_MASKED: Final = ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/timer_list",
                  "/proc/sched_debug", "/sys/firmware", "/proc/scsi"]  # fmt: skip
_READ_ONLY: Final = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]


def _bind(mount: Mount) -> dict[str, Any]:
    options = ["rbind", "ro" if mount.read_only else "rw", "nosuid", "nodev"]
    return {"destination": mount.destination, "type": "bind", "source": str(mount.source),
            "options": options}  # fmt: skip


def _die_with_parent() -> None:  # between fork and exec: runc gets SIGTERM when we die
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def sweep() -> None:
    """Remove the containers (and unmount the roots) of test processes that are gone."""
    if container_support():
        return
    listed = subprocess.run(["runc", "list", "--format", "json"], capture_output=True, text=True)
    for entry in json.loads(listed.stdout or "null") or []:
        found = _ID.match(entry.get("id", ""))
        if found and not Path(f"/proc/{found.group(1)}").exists():
            subprocess.run(["runc", "delete", "--force", entry["id"]], capture_output=True)
    with open("/proc/self/mounts") as mounts:
        targets = [line.split()[1] for line in mounts if line.startswith("overlay ")]
    for target in targets:
        owner = re.search(rf"/{_ID_PREFIX}(\d+)-[0-9a-f]+/rootfs$", target)
        if owner and not Path(f"/proc/{owner.group(1)}").exists():
            subprocess.run(["umount", "--lazy", target], capture_output=True)


# ------------------------------------------------------------------------------ pods


@dataclass(frozen=True)
class PodFiles:
    """Where a pod's volumes live on this host: emptyDirs are made in ``folder``; other
    volumes (ConfigMap, Secret, projected) are folders the test filled, by volume name."""

    folder: Path
    sources: Mapping[str, Path] = field(default_factory=dict)


def pod_container(
    image: Image,
    pod_spec: Mapping[str, Any],
    container: Mapping[str, Any],
    files: PodFiles,
    *,
    hostname: str,
    args: Sequence[str] | None = None,
) -> Container:
    """A ``Container`` that runs ``container`` of ``pod_spec`` as a kubelet would (see the
    module); ``args``: the process's argv instead (the stand-in kubelet's listen address)."""
    pod_sc, sc = pod_spec.get("securityContext") or {}, container.get("securityContext") or {}
    image_uid, image_gid = image.user
    uid = int(sc.get("runAsUser", pod_sc.get("runAsUser", image_uid)))
    if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) and uid == 0:
        name = container.get("name")
        raise ValueError(f"container {name}: runAsNonRoot and uid 0 (the kubelet refuses it)")
    known = image.passwd(uid)
    default_gid = image_gid if image_gid is not None else (known[0] if known else 0)
    gid = int(sc.get("runAsGroup", pod_sc.get("runAsGroup", default_gid)))
    fs_group = pod_sc.get("fsGroup")
    groups = [int(g) for g in pod_sc.get("supplementalGroups") or []]
    if fs_group is not None:
        groups.append(int(fs_group))
    env = image.env
    for entry in container.get("env") or []:
        if "value" not in entry:
            raise ValueError(f"env {entry.get('name')}: only literal values here")
        env[str(entry["name"])] = str(entry["value"])
    env.setdefault("HOME", known[1] if known else "/")
    env.setdefault("HOSTNAME", hostname)
    argv = list(args) if args is not None else kubelet_argv(image, container)
    drop = [c.upper() for c in (sc.get("capabilities") or {}).get("drop") or []]
    return Container(
        image=image,
        folder=files.folder / f"{_ID_PREFIX}{os.getpid()}-{os.urandom(4).hex()}",
        args=argv, env=env, uid=uid, gid=gid, groups=groups,
        cwd=container.get("workingDir") or image.config.get("WorkingDir") or "/",
        read_only_root=bool(sc.get("readOnlyRootFilesystem", False)),
        mounts=_volume_mounts(pod_spec, container, files, fs_group),
        hostname=hostname,
        drop_all_capabilities="ALL" in drop,
        no_new_privileges=sc.get("allowPrivilegeEscalation") is False,
    )  # fmt: skip


def kubelet_argv(image: Image, container: Mapping[str, Any]) -> list[str]:
    """``command`` replaces the ENTRYPOINT (and drops the CMD), ``args`` replaces the CMD."""
    entrypoint: list[str] = container.get("command") or image.config.get("Entrypoint") or []
    cmd: list[str] = []
    if "args" in container:
        cmd = container["args"] or []
    elif not container.get("command"):
        cmd = image.config.get("Cmd") or []
    return [str(a) for a in (*entrypoint, *cmd)]


def _volume_mounts(
    pod_spec: Mapping[str, Any],
    container: Mapping[str, Any],
    files: PodFiles,
    fs_group: int | None,
) -> list[Mount]:
    volumes = {v["name"]: v for v in pod_spec.get("volumes") or []}
    mounts = []
    for mount in container.get("volumeMounts") or []:
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            source = files.folder / "volumes" / mount["name"]
            source.mkdir(parents=True, exist_ok=True)
            os.chmod(source, 0o777)  # the kubelet's emptyDir mode
            if fs_group is not None:
                os.chown(source, 0, int(fs_group))
                os.chmod(source, 0o2777)  # the fsGroup owns it, setgid
        elif mount["name"] in files.sources:
            source = files.sources[mount["name"]]
        else:
            raise ValueError(f"volume {mount['name']}: give its files (PodFiles.sources)")
        if mount.get("subPath"):
            source = source / mount["subPath"]
        mounts.append(Mount(mount["mountPath"], source, bool(mount.get("readOnly"))))
    return mounts
