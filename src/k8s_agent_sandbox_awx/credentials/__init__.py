"""The credential framework: types, token checks, sources, providers, discovery, cache."""
