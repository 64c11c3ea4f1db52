"""The deployment files under ``deploy/``, read as the tests check them.

- ``render``: the objects ``kubectl kustomize`` makes of a kustomization and the components
  given, for the subset of kustomize that deploy/ uses: ``resources`` (files and folders) and
  ``components``, no generators, patches or transformers (so every object is exactly what the
  YAML files say). Anything else in a kustomization is refused, naming the file and the field:
  the renderer never guesses what kustomize would do. ``kubectl_kustomize`` runs the real one
  when kubectl is installed, and tests/deploy/ compares the two.
- ``Containerfile``: the instructions of a Containerfile (continuation lines joined), with the
  few readings the tests need (FROM, USER, ENV, the exec-form ENTRYPOINT and CMD).
- ``lost_fields``: what of an object sent to the API server is missing or different in what
  came back: the API server of our tests (1.20) drops a field it does not know instead of
  refusing it, so a misspelt field shows up here.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml  # type: ignore[import-untyped]

REPO_ROOT: Final = Path(__file__).resolve().parents[2]
DEPLOY: Final = REPO_ROOT / "deploy"
BROKER: Final = DEPLOY / "broker"
COMPONENTS: Final = BROKER / "components"
EXAMPLES: Final = DEPLOY / "examples"
BROKER_CONTAINERFILE: Final = BROKER / "Containerfile"
RUNTIME_CONTAINERFILE: Final = DEPLOY / "runtime" / "Containerfile"

_KINDS: Final = {
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
    "Component": "kustomize.config.k8s.io/v1alpha1",
}
_FIELDS: Final = frozenset({"apiVersion", "kind", "resources", "components"})


class KustomizeError(ValueError):
    """A kustomization this renderer cannot render exactly as kustomize would."""


def component_dirs() -> list[Path]:
    """deploy/broker/components/*, sorted."""
    return sorted(p for p in COMPONENTS.iterdir() if (p / "kustomization.yaml").is_file())


def render(root: Path, components: Sequence[Path] = ()) -> list[dict[str, Any]]:
    """The objects of the kustomization in ``root`` plus ``components`` (as an overlay that
    lists ``root`` as its resource and these as its components would give them)."""
    objects = _build(root, "Kustomization")
    for component in components:
        objects += _build(component, "Component")
    seen: dict[tuple[str, ...], None] = {}
    for obj in objects:
        key = object_id(obj)
        if key in seen:
            raise KustomizeError(f"{'/'.join(key)} is defined twice (kustomize refuses that)")
        seen[key] = None
    return objects


def _build(folder: Path, kind: str) -> list[dict[str, Any]]:
    path = folder / "kustomization.yaml"
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = sorted(set(spec) - _FIELDS)
    if unknown:
        raise KustomizeError(
            f"{path}: {unknown} not supported by this renderer (only {sorted(_FIELDS)}): keep "
            "deploy/ to plain resources and components, or teach tests/_support/deploy.py"
        )
    if (spec.get("kind"), spec.get("apiVersion")) != (kind, _KINDS[kind]):
        raise KustomizeError(
            f"{path}: expected kind {kind} of {_KINDS[kind]}, got {spec.get('kind')!r} "
            f"of {spec.get('apiVersion')!r}"
        )
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources") or []:
        target = folder / entry
        if target.is_dir():
            objects += _build(target, "Kustomization")
        else:
            objects += [d for d in yaml.safe_load_all(target.read_text()) if d is not None]
    for entry in spec.get("components") or []:
        objects += _build(folder / entry, "Component")
    return objects


def object_id(obj: Mapping[str, Any]) -> tuple[str, str, str, str]:
    meta = obj.get("metadata") or {}
    return (obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"])


def describe(obj: Mapping[str, Any]) -> str:
    _, kind, namespace, name = object_id(obj)
    return f"{kind}/{namespace + '/' if namespace else ''}{name}"


def find(objects: Iterable[Mapping[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The one object of ``kind`` named ``name``."""
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(found) != 1:
        raise LookupError(f"{len(found)} objects {kind}/{name} in the rendered manifests")
    return dict(found[0])


def kubectl() -> str | None:
    """The kubectl on PATH if it has ``kustomize`` (kubectl >= 1.14), else None."""
    binary = shutil.which("kubectl")
    if binary is None:
        return None
    probe = subprocess.run([binary, "kustomize", "--help"], capture_output=True, timeout=60)
    return binary if probe.returncode == 0 else None


def kubectl_kustomize(binary: str, root: Path, components: Sequence[Path] = ()) -> list[Any]:
    """What ``kubectl kustomize`` renders for ``root`` plus ``components`` (through an
    overlay in a temporary folder: kustomize takes relative paths only)."""
    with tempfile.TemporaryDirectory() as overlay:
        relative = [os.path.relpath(p, overlay) for p in (root, *components)]
        Path(overlay, "kustomization.yaml").write_text(
            json.dumps(
                {
                    "apiVersion": _KINDS["Kustomization"],
                    "kind": "Kustomization",
                    "resources": relative[:1],
                    "components": relative[1:],
                }
            )
        )
        done = subprocess.run(
            [binary, "kustomize", overlay], capture_output=True, text=True, timeout=120
        )
    if done.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {root} {components}: {done.stderr.strip()}")
    return [d for d in yaml.safe_load_all(done.stdout) if d is not None]


# ------------------------------------------------------------------------------ Containerfiles


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    arguments: str
    line: int


class Containerfile:
    """The instructions of a Containerfile (comments dropped, continuations joined)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.instructions: list[Instruction] = []
        pending, start = "", 0
        for number, raw in enumerate(path.read_text().splitlines(), 1):
            stripped = raw.strip()
            if not pending and (not stripped or stripped.startswith("#")):
                continue
            if pending and stripped.startswith("#"):
                continue  # a comment line inside a continued instruction
            start = start or number
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            keyword, _, arguments = (pending + stripped).partition(" ")
            self.instructions.append(Instruction(keyword.upper(), arguments.strip(), start))
            pending, start = "", 0

    def all(self, keyword: str) -> list[str]:
        return [i.arguments for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        if not found:
            raise LookupError(f"{self.path}: no {keyword} instruction")
        return found[-1]

    def exec_form(self, keyword: str) -> list[str]:
        """The JSON (exec) form of ENTRYPOINT or CMD; ValueError for the shell form."""
        value = json.loads(self.last(keyword))
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{self.path}: {keyword} is not the exec form (a JSON list)")
        return value

    def env(self) -> dict[str, str]:
        """The variables of every ``ENV key=value ...`` instruction."""
        found: dict[str, str] = {}
        for arguments in self.all("ENV"):
            for word in shlex.split(arguments):
                key, sep, value = word.partition("=")
                if not sep:
                    raise ValueError(f"{self.path}: ENV {arguments!r}: use the key=value form")
                found[key] = value
        return found


# ------------------------------------------------------------------------------ round trips


def lost_fields(sent: Any, returned: Any, path: str = "") -> list[str]:
    """Where ``returned`` lacks or changes something of ``sent`` (dotted paths; list items
    by index). ``returned`` may hold more (defaults, status, managedFields)."""
    if isinstance(sent, Mapping):
        if not isinstance(returned, Mapping):
            return [f"{path or '.'}: sent an object, got {returned!r}"]
        lost: list[str] = []
        for key, value in sent.items():
            where = f"{path}.{key}" if path else str(key)
            if key not in returned:
                lost.append(f"{where}: dropped by the API server (unknown field?)")
            else:
                lost += lost_fields(value, returned[key], where)
        return lost
    if isinstance(sent, list):
        if not isinstance(returned, list) or len(returned) != len(sent):
            return [f"{path}: sent {len(sent)} items, got {returned!r}"]
        return [
            m
            for i, (s, r) in enumerate(zip(sent, returned, strict=True))
            for m in lost_fields(s, r, f"{path}[{i}]")
        ]
    if sent != returned:
        return [f"{path}: sent {sent!r}, got {returned!r}"]
    return []


# ------------------------------------------------------------------------------ cert-manager


def _crd(kind: str, plural: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.cert-manager.io",
            "annotations": {"description": "TEST STAND-IN for cert-manager's CRD (tests only)"},
        },
        "spec": {
            "group": "cert-manager.io",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": plural,
                      "singular": kind.lower()},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "required": ["spec"],
                    "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                   "metadata": {"type": "object"}, "spec": spec,
                                   "status": {"type": "object",
                                              "x-kubernetes-preserve-unknown-fields": True}}}},
            }],
        },
    }  # fmt: skip


_STRING: Final = {"type": "string"}
_STRINGS: Final = {"type": "array", "items": _STRING}


def cert_manager_stand_in_crds() -> list[dict[str, Any]]:
    """TEST STAND-INS, shaped like cert-manager v1's Certificate and Issuer CRDs for the fields
    deploy/broker/components/cert-manager uses (their names, types and enums as in
    cert-manager's API reference, cert-manager.io/v1). Structural schemas without
    preserve-unknown-fields: a field they do not know is pruned, as cert-manager's own CRDs
    prune it, so a misspelt field fails the round trip."""
    certificate = {
        "type": "object",
        "required": ["issuerRef", "secretName"],
        "properties": {
            "secretName": _STRING, "commonName": _STRING, "dnsNames": _STRINGS,
            "ipAddresses": _STRINGS, "uris": _STRINGS, "duration": _STRING,
            "renewBefore": _STRING, "isCA": {"type": "boolean"},
            "usages": {"type": "array", "items": {"type": "string", "enum": [
                "signing", "digital signature", "content commitment", "key encipherment",
                "key agreement", "data encipherment", "cert sign", "crl sign",
                "encipher only", "decipher only", "any", "server auth", "client auth",
                "code signing", "email protection", "s/mime", "ipsec end system",
                "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
                "microsoft sgc", "netscape sgc"]}},
            "privateKey": {"type": "object", "properties": {
                "algorithm": {"type": "string", "enum": ["RSA", "ECDSA", "Ed25519"]},
                "size": {"type": "integer"},
                "encoding": {"type": "string", "enum": ["PKCS1", "PKCS8"]},
                "rotationPolicy": {"type": "string", "enum": ["Never", "Always"]}}},
            "issuerRef": {"type": "object", "required": ["name"], "properties": {
                "name": _STRING, "kind": _STRING, "group": _STRING}},
        },
    }  # fmt: skip
    issuer = {
        "type": "object",
        "properties": {
            "selfSigned": {"type": "object", "properties": {"crlDistributionPoints": _STRINGS}},
            "ca": {"type": "object", "required": ["secretName"], "properties": {
                "secretName": _STRING, "crlDistributionPoints": _STRINGS,
                "ocspServers": _STRINGS}},
        },
    }  # fmt: skip
    return [
        _crd("Certificate", "certificates", certificate),
        _crd("Issuer", "issuers", issuer),
    ]
