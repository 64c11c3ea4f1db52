"""Support code the test suites import (``from tests._support.kube import ...``).

pytest runs with ``--import-mode=importlib``: test modules cannot import each other, but this
package is imported like any other (its parent, ``tests``, is a namespace package under the
rootdir). Only helpers live here, no tests and no fixtures.
"""
