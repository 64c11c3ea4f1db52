"""The single place the package version is defined."""

__version__ = "0.5.0"
