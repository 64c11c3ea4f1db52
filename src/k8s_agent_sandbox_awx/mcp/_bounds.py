"""How much a tool returns, so that one call cannot flood an agent's context (no I/O).

- :func:`cut_middle`: a command's stdout or stderr over the limit keeps its beginning and its
  end (where the error usually is) with a note in place of the middle, saying how much was cut
  and how to see all of it.
- :class:`LinePager`: a file read from a line on, fed chunk by chunk as it downloads, stops once
  it holds the limit (the download is then stopped too) and says where to go on.
- :func:`sniff`: what a file's first bytes say it is: text, an image (its MIME type) or other
  binary data.

The limits are the server's ``--max-output-chars`` (:data:`DEFAULT_MAX_OUTPUT_CHARS`),
:data:`MAX_LIST_ENTRIES` entries of a directory and :data:`MAX_IMAGE_BYTES` of an image.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_MAX_OUTPUT_CHARS",
    "MAX_IMAGE_BYTES",
    "MAX_LIST_ENTRIES",
    "LinePager",
    "cut_middle",
    "sniff",
]

DEFAULT_MAX_OUTPUT_CHARS = 20_000
"""Characters of text one field of a tool's result holds at most (a command's stdout, its
stderr, a file's text): about 5,000 tokens, a quarter of what coding agents accept from one
tool call (Claude Code warns from 10,000 tokens and cuts at 25,000)."""
MAX_LIST_ENTRIES = 500
"""Entries of a directory list_files returns at most (the count of the rest is said)."""
MAX_IMAGE_BYTES = 5 * 1024 * 1024
"""The largest image read_file or run_code returns as image content (5 MiB: the largest image
the common model APIs take)."""

_IMAGES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)
_SNIFF_BYTES = 8192


def cut_middle(text: str, limit: int, what: str) -> tuple[str, bool]:
    """``text`` within ``limit`` characters (the note included): its first two thirds and its
    last third around a note naming how many characters of ``what`` were cut; whether it was
    cut."""
    if len(text) <= limit:
        return text, False
    note_room = 200
    keep = max(limit - note_room, 0)
    head, tail = keep * 2 // 3, keep - keep * 2 // 3
    cut = len(text) - head - tail
    note = (
        f"\n[... {cut:,} characters of {what} cut here: the output limit is {limit:,} "
        "characters; redirect the output to a file and read it with read_file to see it all "
        "...]\n"
    )
    return text[:head] + note + (text[-tail:] if tail else ""), True


def sniff(first: bytes) -> str:
    """``text``, an image's MIME type (``image/png``, ...) or ``binary``, from a file's first
    bytes."""
    for magic, mime in _IMAGES:
        if first.startswith(magic):
            return mime
    if first[:4] == b"RIFF" and first[8:12] == b"WEBP":
        return "image/webp"
    head = first[:_SNIFF_BYTES]
    if b"\x00" in head:
        return "binary"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return "binary"
    return "text"


@dataclass
class LinePager:
    """Lines ``start_line`` on (1-based), at most ``line_count`` of them and ``limit``
    characters in all, from bytes fed as they arrive (UTF-8; invalid bytes replaced)."""

    start_line: int
    line_count: int | None
    limit: int
    line: int = 1
    """The number of the line the next character belongs to."""
    parts: list[str] = field(default_factory=list)
    size: int = 0
    full: bool = False
    """Enough is held: stop feeding (the download can stop)."""
    cut_line: int | None = None
    """The first line was longer than the limit: its number (only its start is held). Any
    other line that does not fit is left whole for the next page."""
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    def feed(self, data: bytes, *, final: bool = False) -> None:
        if not self.full:
            self._take(self._decoder.decode(data, final=final))

    def _take(self, text: str) -> None:
        for piece in _lines(text):
            if self.line >= self.start_line:
                if self.line_count is not None and self.line >= self.start_line + self.line_count:
                    self.full = True
                    return
                room = self.limit - self.size
                if len(piece) > room:
                    self.full = True
                    if not self.parts:  # one line longer than the limit: its start
                        self.parts.append(piece[:room])
                        self.size, self.cut_line = self.limit, self.line
                    return
                self.parts.append(piece)
                self.size += len(piece)
            if piece.endswith("\n"):
                self.line += 1

    def text(self) -> str:
        return "".join(self.parts)

    def note(self, ended: bool) -> str | None:
        """What to say after the text: where to go on (``None``: the file ended in it)."""
        if self.cut_line is not None:
            return (
                f"[line {self.cut_line} is cut at the output limit of {self.limit:,} "
                "characters; use run_command (e.g. cut, fold or head -c) to read it in pieces]"
            )
        if ended and not self.full:
            return None
        return f"[the file goes on: call read_file again with start_line={self.line} to read on]"


def _lines(text: str) -> list[str]:
    """``text`` split after each newline (only ``\\n`` ends a line: a ``\\r\\n`` split between two
    chunks is still one line end)."""
    pieces = text.split("\n")
    return [p + "\n" for p in pieces[:-1]] + ([pieces[-1]] if pieces[-1] else [])
