"""Sandbox backends: where a sandbox's runtime runs."""
