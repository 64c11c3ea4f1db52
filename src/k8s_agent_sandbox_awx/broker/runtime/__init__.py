"""The sandbox runtime (standard library only), run as ``python -m <this package>``."""
