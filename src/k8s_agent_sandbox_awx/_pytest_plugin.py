"""pytest plugin (``pytest11`` entry point): the ``sandbox_broker`` fixture.

This module is imported by every pytest run in an environment where the package is installed,
so it must stay cheap and must not import the ``[local]`` extra's dependencies at import time.
"""

from __future__ import annotations
