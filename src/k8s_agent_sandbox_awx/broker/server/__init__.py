"""The broker's server runtime: uvicorn on the ``[server]`` listen address, TLS re-loaded when
the certificate files change, a graceful stop on SIGTERM, ``/healthz`` and ``/readyz``.

``serve(ServedApp(app, ready), settings)`` runs until SIGTERM/SIGINT; ``run_server`` is its
coroutine. Needs uvicorn (the ``[broker]`` extra).
"""

from ._probes import READINESS_TIMEOUT, ASGIApp, ReadinessCheck, with_probes
from ._run import ListenError, ServedApp, bind, run_server, serve
from ._tls import ReloadingCertificate, TLSFilesError, server_context

__all__ = [
    "READINESS_TIMEOUT",
    "ASGIApp",
    "ListenError",
    "ReadinessCheck",
    "ReloadingCertificate",
    "ServedApp",
    "TLSFilesError",
    "bind",
    "run_server",
    "serve",
    "server_context",
    "with_probes",
]
