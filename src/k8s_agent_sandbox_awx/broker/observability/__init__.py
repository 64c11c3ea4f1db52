"""What the people who run the broker see: the access log, the audit log and the metrics.

A layer around the broker's ASGI app (:class:`._access.Observed`, made by
:class:`._observer.Observer`) follows each request: its route template, who the gate verified,
the sandbox it names, its bytes, status, duration and how it ended. The broker's parts tell it
what they decided through the hooks of :mod:`..common._observed` (a no-op outside an observed
request), so the parts stay as they are and the layer can be left out (the local broker's default).

This package's ``__init__`` imports nothing: the hooks are imported by the broker's parts on
every path, the metrics (``prometheus-client``, the ``[broker]`` extra) only when enabled.
"""
