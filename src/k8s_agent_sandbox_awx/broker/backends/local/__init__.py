"""The local backend: claims in memory, each runtime a host process (in bubblewrap if it can)."""
