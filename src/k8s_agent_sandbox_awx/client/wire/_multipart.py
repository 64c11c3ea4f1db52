"""The one ``multipart/form-data`` framing of an upload (no I/O): the legacy ``/upload`` and the
file API's ``/fs/write`` (``core/_upload`` streams the file between its prefix and suffix).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "Multipart",
    "multipart_framing",
]


@dataclass(frozen=True)
class Multipart:
    """The framing of a ``multipart/form-data`` body whose last part is one file (field
    ``file``): ``prefix``, the file's bytes, ``suffix``."""

    prefix: bytes
    suffix: bytes
    content_type: str

    def length(self, content_length: int) -> int:
        """The body's length around ``content_length`` bytes of file."""
        return len(self.prefix) + content_length + len(self.suffix)

    def headers(self, content_length: int | None) -> dict[str, str]:
        """The body's headers: its type, and its ``Content-Length`` around
        ``content_length`` bytes of file (``None``: unknown, the body is chunked)."""
        if content_length is None:
            return {"Content-Type": self.content_type, "Transfer-Encoding": "chunked"}
        return {
            "Content-Type": self.content_type,
            "Content-Length": str(self.length(content_length)),
        }


def multipart_framing(
    filename: str, boundary: str | None = None, *, fields: Mapping[str, str] | None = None
) -> Multipart:
    """The one multipart framing of an upload: the text ``fields`` first (``/fs/write``'s
    ``path``), then the ``file`` part named ``filename`` (the legacy ``/upload``: the
    destination path). The filename is a quoted-string: ``\\`` and ``"`` are escaped with a
    backslash, which multipart parsers undo (a ``%22`` would be kept: another file's name). A
    random boundary is drawn again while a field holds it."""
    values = [(name, value.encode("utf-8")) for name, value in (fields or {}).items()]
    boundary = boundary or secrets.token_hex(16)
    while any(boundary.encode() in value for _, value in values):  # pragma: no cover
        boundary = secrets.token_hex(16)  # 128 random bits in a field
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
        + value
        + b"\r\n"
        for name, value in values
    ]
    quoted = filename.replace("\\", "\\\\").replace('"', '\\"')
    file_part = (
        f"--{boundary}\r\n"
        f'Content-Disposition: form-data; name="file"; filename="{quoted}"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    suffix = f"\r\n--{boundary}--\r\n".encode()
    return Multipart(
        b"".join(parts) + file_part, suffix, f"multipart/form-data; boundary={boundary}"
    )
