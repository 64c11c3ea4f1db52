"""``LocalBroker.tokens``: the local broker's issuers and the tokens they sign.

:class:`Tokens` holds the issuers the broker trusts (the built-in ``kubernetes`` and ``gitlab``
ones, and any added with :meth:`Tokens.add_issuer`), issues tokens shaped as the kubelet and
GitLab CI issue theirs, writes them as projected token files, rotates signing keys and revokes
tokens. The broker binds it to its URL at start (the issuers live under ``<url>/issuers/``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from ..broker.identity._policy import Policy
from ..broker.identity._revocations import Revocations
from ._issuers import (
    GITLAB_ATTRIBUTES,
    AttributesRule,
    ClaimsRule,
    Issuer,
    kubernetes_attributes,
)

log = logging.getLogger("k8s_agent_sandbox_awx.testing")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
NOT_RUNNING = "the LocalBroker is not running: use 'with LocalBroker() as b:'"


class Tokens:
    """The issuers a :class:`LocalBroker` trusts and the tokens they sign: ``broker.tokens``.

    ``issue_kubernetes`` and ``issue_gitlab`` make tokens as the kubelet and GitLab CI make
    theirs; ``write_projected`` and ``keep_projected_rotated`` write them as the kubelet writes
    a projected volume; ``environ`` is the environment a zero-argument ``Sandbox.create()``
    needs; ``add_issuer``, ``rotate_keys`` and ``revoke`` change what the broker trusts. Usable
    while the broker runs; thread-safe.
    """

    def __init__(
        self, *, kubernetes_policy: Policy, gitlab_policy: Policy, revocations: Revocations
    ) -> None:
        self._kubernetes_policy = kubernetes_policy
        self._gitlab_policy = gitlab_policy
        self._revocations = revocations
        self._lock = threading.Lock()
        self._issuers_by_url: dict[str, Issuer] = {}
        self._issuers_by_name: dict[str, Issuer] = {}
        self._uids: dict[tuple[str, ...], str] = {}
        self._counter = itertools.count(1000)
        self._rotators: list[tuple[threading.Event, threading.Thread]] = []
        self._url: str | None = None
        self._ca_bundle: str | None = None
        self._tmp: str | None = None
        self._on_keys_changed: Callable[[Issuer], None] | None = None

    def __repr__(self) -> str:
        return f"Tokens(issuers={sorted(self.issuers)!r})"

    # -- the broker's side: binding at start, stopping, the verifier's view ---------------------
    def bind(
        self, url: str, ca_bundle: str, tmp: str, on_keys_changed: Callable[[Issuer], None]
    ) -> None:
        """At the broker's start: its URL (issuers' base and default audience), CA bundle and
        temporary directory (``environ``'s token files), and what to do when an issuer's keys
        change; adds the built-in ``kubernetes`` and ``gitlab`` issuers."""
        self._url, self._ca_bundle, self._tmp = url, ca_bundle, tmp
        self._on_keys_changed = on_keys_changed
        self._add_issuer(
            "kubernetes",
            provider="kubernetes",
            policy=self._kubernetes_policy,
            attributes=kubernetes_attributes,
            audience_as_list=True,
        )
        self._add_issuer(
            "gitlab", provider="gitlab", policy=self._gitlab_policy, attributes=GITLAB_ATTRIBUTES
        )

    def stop_rotating(self) -> None:
        """At the broker's stop: every ``keep_projected_rotated`` rotator ends."""
        for event, _thread in self._rotators:
            event.set()
        self._rotators.clear()

    def snapshot(self) -> Mapping[str, Issuer]:
        """The trusted issuers by URL, now (the token verifier's view)."""
        with self._lock:
            return dict(self._issuers_by_url)

    def named(self, name: str) -> Issuer | None:
        """The issuer called ``name``, if any."""
        with self._lock:
            return self._issuers_by_name.get(name)

    # -- issuers -------------------------------------------------------------------------------
    @property
    def kubernetes(self) -> Issuer:
        """The Kubernetes-like issuer (``<url>/issuers/kubernetes``)."""
        return self._issuers_by_name["kubernetes"]

    @property
    def gitlab(self) -> Issuer:
        """The GitLab-like issuer (``<url>/issuers/gitlab``)."""
        return self._issuers_by_name["gitlab"]

    @property
    def issuers(self) -> dict[str, Issuer]:
        """Every trusted issuer, by name."""
        with self._lock:
            return dict(self._issuers_by_name)

    def _require_url(self) -> str:
        if self._url is None:
            raise RuntimeError(NOT_RUNNING)
        return self._url

    def _add_issuer(
        self,
        name: str,
        *,
        provider: str,
        policy: Policy,
        claims: ClaimsRule = None,
        attributes: AttributesRule = None,
        algorithm: str = "RS256",
        audience_as_list: bool = False,
    ) -> Issuer:
        if not _DNS_LABEL.match(name):
            raise ValueError(f"issuer name {name!r} must be a DNS-1123 label")
        url = self._require_url()
        issuer = Issuer(
            name,
            f"{url}/issuers/{name}",
            provider=provider,
            policy=policy,
            default_audience=url,
            algorithm=algorithm,
            claims=claims,
            attributes=attributes,
            audience_as_list=audience_as_list,
            on_keys_changed=self._on_keys_changed,
        )
        with self._lock:
            if name in self._issuers_by_name:
                raise ValueError(f"an issuer named {name!r} already exists")
            self._issuers_by_name[name] = issuer
            self._issuers_by_url[issuer.url] = issuer
        return issuer

    def add_issuer(
        self,
        name: str,
        *,
        claims: ClaimsRule = None,
        policy: Policy | None = None,
        provider: str | None = None,
        attributes: AttributesRule = None,
        algorithm: str = "RS256",
        audience_as_list: bool = False,
    ) -> Issuer:
        """Add and trust a custom issuer at ``<url>/issuers/<name>``.

        - ``claims``: extra claims of every token it issues (a mapping, or a callable of the
          subject returning one); ``issue_token(..., claims=...)`` adds more per token.
        - ``policy``: its callers' :class:`Policy` (default: template ``python``, namespace
          ``name``).
        - ``provider``: the provider name the broker derives from this issuer (default ``name``).
        - ``attributes``: the claim names that are the provider's key attributes (or a callable
          of the claims); default: every non-registered scalar claim.
        - ``algorithm``: ``RS256`` or ``ES256``; ``audience_as_list``: ``aud`` as a list.
        """
        self._require_url()
        return self._add_issuer(
            name,
            provider=provider or name,
            policy=policy or Policy(templates=("python",), namespace=name),
            claims=claims,
            attributes=attributes,
            algorithm=algorithm,
            audience_as_list=audience_as_list,
        )

    def rotate_keys(self, issuer: str = "kubernetes", *, retire_old: bool = False) -> str:
        """Rotate ``issuer``'s signing key (see :meth:`Issuer.rotate_key`); returns the new kid."""
        target = self.named(issuer)
        if target is None:
            raise KeyError(f"no issuer named {issuer!r}; known: {sorted(self.issuers)}")
        return target.rotate_key(retire_old=retire_old)

    def revoke(self, token: str) -> None:
        """Reject ``token`` from now on (``401 token_revoked``), by ``jti`` and by digest."""
        self._require_url()
        self._revocations.revoke(token)

    # -- tokens --------------------------------------------------------------------------------
    def _stable_uid(self, *key: str) -> str:
        with self._lock:
            return self._uids.setdefault(key, str(uuid.uuid4()))

    def _numeric_id(self, *key: str) -> str:
        with self._lock:
            value = self._uids.get(key)
            if value is None:
                value = self._uids[key] = str(next(self._counter))
            return value

    def issue_kubernetes(
        self,
        namespace: str,
        service_account: str,
        audience: str | Sequence[str] | None = None,
        ttl: int = 3600,
        *,
        pod_name: str | None = None,
        claims: Mapping[str, Any] | None = None,
    ) -> str:
        """A projected ServiceAccount token (RS256) as the kubelet would mount it.

        Claims: ``iss``, ``sub`` = ``system:serviceaccount:NS:NAME``, ``aud`` (a list; default
        ``[broker.url]``), ``exp``, ``iat``, ``nbf`` (= ``iat``), ``jti`` and ``kubernetes.io``
        ``{namespace, serviceaccount{name, uid}, pod{name, uid}}``; ``claims`` overrides any.
        """
        pod = pod_name or f"{service_account}-local"
        info = {
            "namespace": namespace,
            "serviceaccount": {
                "name": service_account,
                "uid": self._stable_uid("sa", namespace, service_account),
            },
            "pod": {"name": pod, "uid": self._stable_uid("pod", namespace, pod)},
        }
        payload: dict[str, Any] = {"kubernetes.io": info}
        payload.update(claims or {})
        return self.kubernetes.issue_token(
            f"system:serviceaccount:{namespace}:{service_account}",
            payload,
            audience=audience,
            ttl=ttl,
        )

    def issue_gitlab(
        self,
        project_path: str,
        ref: str = "main",
        audience: str | Sequence[str] | None = None,
        ttl: int = 3600,
        *,
        ref_type: str = "branch",
        user_login: str = "local-developer",
        claims: Mapping[str, Any] | None = None,
    ) -> str:
        """A GitLab CI ``id_tokens`` token (RS256).

        ``sub`` = ``project_path:GROUP/PROJECT:ref_type:branch:ref:REF``; claims as GitLab sends
        them (ids as strings, ``ref_protected`` "true"/"false"); ``aud`` a string (default the
        broker URL); ``claims`` overrides any.
        """
        if "/" not in project_path:
            raise ValueError(f"project_path {project_path!r} must be GROUP/PROJECT")
        namespace_path = project_path.rsplit("/", 1)[0]
        pipeline_id = str(next(self._counter))
        payload: dict[str, Any] = {
            "namespace_id": self._numeric_id("ns", namespace_path),
            "namespace_path": namespace_path,
            "project_id": self._numeric_id("project", project_path),
            "project_path": project_path,
            "user_id": self._numeric_id("user", user_login),
            "user_login": user_login,
            "user_email": f"{user_login}@example.invalid",
            "pipeline_id": pipeline_id,
            "pipeline_source": "push",
            "job_id": str(next(self._counter)),
            "ref": ref,
            "ref_type": ref_type,
            "ref_path": f"refs/{'heads' if ref_type == 'branch' else 'tags'}/{ref}",
            "ref_protected": "true" if ref in ("main", "master") else "false",
            "runner_id": self._numeric_id("runner", "local"),
            "runner_environment": "self-hosted",
            "sha": secrets.token_hex(20),
        }
        payload.update(claims or {})
        return self.gitlab.issue_token(
            f"project_path:{project_path}:ref_type:{ref_type}:ref:{ref}",
            payload,
            audience=audience,
            ttl=ttl,
        )

    # -- token files and environment -----------------------------------------------------------
    def write_projected(
        self,
        path: str | os.PathLike[str],
        namespace: str = "default",
        service_account: str = "default",
        ttl: int = 3600,
        *,
        audience: str | Sequence[str] | None = None,
    ) -> str:
        """Write a Kubernetes token to ``path`` the way the kubelet does; returns the token.

        The directory gets a timestamped data directory, an atomically swapped ``..data``
        symlink and ``path`` as a symlink through ``..data``. Call again to rotate.
        """
        token = self.issue_kubernetes(namespace, service_account, audience, ttl)
        write_kubelet_style(os.fspath(path), token)
        return token

    def keep_projected_rotated(
        self,
        path: str | os.PathLike[str],
        namespace: str = "default",
        service_account: str = "default",
        ttl: int = 3600,
    ) -> str:
        """Write the token now and rewrite it at 80 % of its lifetime until the broker stops."""
        token = self.write_projected(path, namespace, service_account, ttl)
        stop = threading.Event()

        def rotate() -> None:
            while not stop.wait(ttl * 0.8):
                try:
                    self.write_projected(path, namespace, service_account, ttl)
                except Exception:
                    log.exception("LocalBroker: rotating the projected token failed")

        thread = threading.Thread(target=rotate, name="token-rotator", daemon=True)
        thread.start()
        self._rotators.append((stop, thread))
        return token

    def environ(
        self,
        kind: str = "kubernetes",
        *,
        namespace: str = "default",
        service_account: str = "default",
        project_path: str = "group/project",
        ref: str = "main",
        ttl: int = 3600,
        token_file: str | os.PathLike[str] | None = None,
    ) -> dict[str, str]:
        """Environment variables that make ``Sandbox.create()`` work with zero arguments.

        Always ``AGENT_SANDBOX_BROKER_URL`` and ``AGENT_SANDBOX_CA_BUNDLE``; for
        ``kind="kubernetes"`` also ``AGENT_SANDBOX_TOKEN_FILE`` (a projected token written
        kubelet-style, to ``token_file`` or a fresh temp path); for ``kind="gitlab"``
        ``AGENT_SANDBOX_TOKEN`` (the id token, as a CI job would have it).
        """
        url = self._require_url()
        assert self._ca_bundle is not None and self._tmp is not None
        env = {"AGENT_SANDBOX_BROKER_URL": url, "AGENT_SANDBOX_CA_BUNDLE": self._ca_bundle}
        if kind == "kubernetes":
            if token_file is None:
                token_dir = tempfile.mkdtemp(prefix="token-", dir=self._tmp)
                token_file = os.path.join(token_dir, "agent-sandbox-token")
            self.write_projected(token_file, namespace, service_account, ttl)
            env["AGENT_SANDBOX_TOKEN_FILE"] = os.fspath(token_file)
        elif kind == "gitlab":
            env["AGENT_SANDBOX_TOKEN"] = self.issue_gitlab(project_path, ref, ttl=ttl)
        else:
            raise ValueError(f"kind must be 'kubernetes' or 'gitlab', not {kind!r}")
        return env


def write_kubelet_style(path: str, token: str) -> None:
    """Atomically (re)write ``path`` as the kubelet's projected volume does (``..data`` swap)."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    name = os.path.basename(path)
    os.makedirs(directory, exist_ok=True)
    stamp = datetime.now(UTC).strftime("..%Y_%m_%d_%H_%M_%S.%f")
    data_dir = tempfile.mkdtemp(prefix=stamp + "-", dir=directory)
    with open(os.path.join(data_dir, name), "w") as fh:
        fh.write(token)
    os.chmod(os.path.join(data_dir, name), 0o600)
    data_link = os.path.join(directory, "..data")
    old_target = os.readlink(data_link) if os.path.islink(data_link) else None
    tmp_link = os.path.join(directory, "..data_tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp_link)
    os.symlink(os.path.basename(data_dir), tmp_link)
    os.replace(tmp_link, data_link)
    if not os.path.islink(path):
        if os.path.exists(path):
            os.unlink(path)
        os.symlink(os.path.join("..data", name), path)
    if old_target and old_target != os.path.basename(data_dir):
        shutil.rmtree(os.path.join(directory, old_target), ignore_errors=True)
