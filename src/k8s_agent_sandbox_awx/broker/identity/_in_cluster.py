"""An issuer whose keys are looked up under an in-cluster host name (issue 30): a Kubernetes
API server's issuer is often ``https://kubernetes.default.svc``, which resolves only inside
the cluster, so a broker outside it that derives the key set's URL from the issuer (its
discovery document, or ``/openid/v1/jwks`` under it) never gets keys and never becomes ready.
The fix, in the configuration's own words: the ``jwks_uri`` the discovery document names (an
address reachable from outside) as ``jwks_url``."""

from __future__ import annotations

from urllib.parse import urlsplit

from ..._fix import CONFIG, Fix, Setting

__all__ = ["in_cluster_host", "jwks_hint"]

_SUFFIXES = (".svc", ".svc.cluster.local", ".cluster.local")


def in_cluster_host(host: str) -> bool:
    """Whether ``host`` is a cluster-internal service name (``kubernetes.default.svc``...)."""
    host = host.lower().rstrip(".")
    return host in ("kubernetes", "kubernetes.default") or host.endswith(_SUFFIXES)


def jwks_hint(url: str, jwks_url: str | None) -> str | None:
    """The next step for an issuer whose keys are fetched from an in-cluster host (``None``:
    they are not)."""
    host = urlsplit(jwks_url or url).hostname or ""
    if not in_cluster_host(host):
        return None
    return Fix(
        f"{host!r} is a name inside the cluster, which does not resolve from elsewhere: set ",
        Setting("jwks_url"),
        " to the jwks_uri of the API server's discovery document (`kubectl get --raw "
        "/.well-known/openid-configuration`; an address reachable from here), with ",
        Setting("discovery", False),
        ", or run the broker in the cluster",
    ).render(CONFIG)
