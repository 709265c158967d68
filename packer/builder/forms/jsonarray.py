"""The elements of a JSON array file, streamed: each element's byte offset, length and bytes,
found by a scan of the file's structure a chunk at a time (strings, escapes and nesting), never
the whole file in memory. A LLaVA-style `data.json` of 2 GB reads in the memory of its largest
element, as JSONL reads in the memory of its longest line; a build's shards can start at any
element (its byte offset), as they start at a JSONL line.

Only the array's structure is checked here; each element's bytes are `json.loads`'s to judge
(a damaged one is that record's skip). A file that is not an array, or ends inside one, raises
SourceError naming where.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from packer.errors import SourceError

CHUNK = 1 << 20
_WS = b" \t\r\n"
_OUTSIDE = re.compile(rb'[\[\]{}"]')  # what changes the nesting outside a string
_INSIDE = re.compile(rb'["\\]')  # what ends a string, or escapes the byte after it
_SCALAR_END = re.compile(rb"[,\]\s]")


class _Reader:
    """The file's bytes from a position on, a chunk at a time; `keep` bytes from a mark on are
    held (an element's), the rest let go."""

    def __init__(self, f, pos: int):
        self.f, self.base, self.buf, self.eof = f, pos, b"", False
        f.seek(pos)

    def more(self, keep_from: int | None) -> bool:
        """Read the next chunk; drop what lies before `keep_from` (a file offset; None: all of it)."""
        if self.eof:
            return False
        data = self.f.read(CHUNK)
        if not data:
            self.eof = True
            return False
        cut = len(self.buf) if keep_from is None else max(0, keep_from - self.base)
        self.buf, self.base = self.buf[cut:] + data, self.base + cut
        return True

    def byte(self, pos: int, keep_from: int | None = None) -> int | None:
        """The byte at `pos` (None past the end), keeping what lies from `keep_from` on (else
        from `pos`) should more have to be read."""
        while pos - self.base >= len(self.buf):
            if not self.more(pos if keep_from is None else min(pos, keep_from)):
                return None
        return self.buf[pos - self.base]


def elements(f, start: int = 0, stop: int | None = None, *, limit: int) -> Iterator[tuple[int, int, bytes | None]]:
    """(offset, length, bytes) of each element of the JSON array in the binary file `f`, from
    `start` (0: the file's start, before its '['; else an element's first byte) up to `stop` (an
    element's first byte, not included; None: the array's end); bytes None for an element of
    more than `limit` bytes (scanned past, never held)."""
    r = _Reader(f, start)
    pos = _skip_ws(r, start)
    if start == 0:
        if r.byte(pos) == 0xEF and (r.byte(pos + 1), r.byte(pos + 2)) == (0xBB, 0xBF):
            pos = _skip_ws(r, pos + 3)  # a byte-order mark
        if r.byte(pos) != ord("["):
            raise SourceError(f"not a JSON array (byte {pos:,} is {_shown(r.byte(pos))}, not '[')")
        pos = _skip_ws(r, pos + 1)
        if r.byte(pos) == ord("]"):
            return
    while stop is None or pos < stop:
        end, kept = _value_end(r, pos, limit)
        yield pos, end - pos, kept
        pos = _skip_ws(r, end)
        sep = r.byte(pos)
        if sep == ord("]"):
            return
        if sep != ord(","):
            raise SourceError(f"not a JSON array from byte {pos:,} on ({_shown(sep)} where ',' or ']' belongs)")
        pos = _skip_ws(r, pos + 1)


def _shown(b: int | None) -> str:
    return "the end of the file" if b is None else repr(bytes([b]))


def _skip_ws(r: _Reader, pos: int) -> int:
    while (b := r.byte(pos)) is not None and b in _WS:
        pos += 1
    return pos


def _value_end(r: _Reader, start: int, limit: int) -> tuple[int, bytes | None]:
    """The offset just past the value at `start`, and its bytes (None past `limit`)."""
    first = r.byte(start)
    if first is None:
        raise SourceError(f"the file ends at byte {start:,}, inside its array")
    keep_from = start
    depth, pos, in_string = 0, start, False
    if first not in b'[{"':  # a number, true, false, null: to the next ',', ']' or space
        while True:
            found = _SCALAR_END.search(r.buf, pos - r.base)
            if found:
                end = r.base + found.start()
                return end, bytes(r.buf[start - r.base:end - r.base]) if keep_from is not None and \
                    end - start <= limit else None
            pos = r.base + len(r.buf)
            if pos - start > limit:
                keep_from = None
            if not r.more(keep_from):
                raise SourceError(f"the file ends inside the value at byte {start:,}")
    while True:
        pattern = _INSIDE if in_string else _OUTSIDE
        found = pattern.search(r.buf, pos - r.base)
        if found is None:
            pos = r.base + len(r.buf)
            if keep_from is not None and pos - start > limit:
                keep_from = None  # over the limit: scanned, not held
            if not r.more(keep_from):
                raise SourceError(f"the file ends inside the value at byte {start:,}")
            continue
        at = r.base + found.start()
        ch = found.group()
        if in_string:
            if ch == b"\\":
                if r.byte(at + 1, keep_from) is None:
                    raise SourceError(f"the file ends inside the value at byte {start:,}")
                pos = at + 2
                continue
            in_string, pos = False, at + 1
        elif ch == b'"':
            in_string, pos = True, at + 1
        else:
            depth += 1 if ch in b"[{" else -1
            pos = at + 1
        if depth == 0 and not in_string:
            if keep_from is None or pos - start > limit:
                return pos, None
            return pos, bytes(r.buf[start - r.base:pos - r.base])
