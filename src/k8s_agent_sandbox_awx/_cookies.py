"""The cookie jar that keeps nothing, for every ``httpx`` client of the package.

The client keeps no cookies (a sandbox's ``Set-Cookie``, passed through the broker, is never
stored and sent back on later requests, and no answer is parsed for cookies: about 50 µs per
call, docs/performance.md), and the broker's router is stateless like upstream's (it never
stores a sandbox's cookies to replay them). Shared by both halves, standard library only.
"""

from __future__ import annotations

import http.cookiejar
from typing import Any

__all__ = ["NoCookies"]


class NoCookies(http.cookiejar.CookieJar):
    """A cookie jar that never stores a cookie and never adds one to a request."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        return None

    def set_cookie(self, cookie: http.cookiejar.Cookie) -> None:
        return None  # not even one set by hand (``client.cookies.set(...)``)

    def add_cookie_header(self, request: Any) -> None:
        return None
