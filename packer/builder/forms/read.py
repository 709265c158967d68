"""A record's bytes as a worker reads them, whatever form holds them: the image as something
Pillow opens (a file's path; a view of a tar member's bytes, never read whole; a Parquet row's
bytes, from its row group, read once a process and kept until the next is needed) and its
caption (a file beside the image, the manifest's text, a tar member, a Parquet row's value).
Memory is bounded by a row group or a member, never by the file that holds them."""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

from packer.builder.records import Record
from packer.builder.text import MAX_DOC_BYTES, read_caption, too_long
from packer.errors import SourceError


class MemberView(io.RawIOBase):
    """Bytes [offset, offset + size) of a file, as a read-only seekable file: what Pillow reads
    of a tar member, a read at a time (a member that claims gigabytes allocates nothing)."""

    def __init__(self, path: str, offset: int, size: int):
        super().__init__()
        self._fd, self._offset, self._size, self._pos = os.open(path, os.O_RDONLY), offset, size, 0
        if os.fstat(self._fd).st_size < offset + size:
            os.close(self._fd)
            raise SourceError("truncated: the member ends past the end of its tar")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._size - self._pos))
        data = os.pread(self._fd, n, self._offset + self._pos) if n else b""
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


@contextlib.contextmanager
def image_source(record: Record, form: str, fields) -> Iterator[str | io.IOBase]:
    """What Pillow opens for the record's image, for the block: its file's path, or a file
    object of its bytes (closed after)."""
    if record.at is None:
        yield record.path
        return
    source = io.BufferedReader(MemberView(record.path, *record.at)) if form == "tar" else \
        io.BytesIO(_parquet_image(record, fields))
    with source:
        yield source


def caption_of(record: Record, form: str, fields, limit: int = MAX_DOC_BYTES) -> str:
    """The record's caption, stripped; SourceError (a skip) when it is empty, too long or unreadable."""
    if record.caption is not None:
        return read_caption(record.caption, limit)
    if record.text is not None:
        text = record.text
    elif record.text_at is not None:
        text = _member_text(record, fields["text"], limit)
    elif form == "parquet":
        text = _value(record, fields, "text")
        if not isinstance(text, str):
            raise SourceError(f"caption: {fields['text']!r} is {type(text).__name__}, not a string")
    else:
        raise SourceError("no caption")
    if len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit:
        raise SourceError(f"caption: {too_long(len(text.encode('utf-8', 'surrogatepass')), limit)}")
    text = text.strip()
    if not text:
        raise SourceError("empty caption")
    return text


def _member_text(record: Record, field: str, limit: int) -> str:
    offset, size, ext = record.text_at
    if size > limit:
        raise SourceError(f"caption: the .{ext} member is {too_long(size, limit)}")
    with MemberView(record.path, offset, size) as view:
        raw = view.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"caption: .{ext} is not UTF-8 (byte {exc.start})") from None
    if ext != "json":
        return text
    key = field.split(":", 1)[1]
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise SourceError(f"caption: the .json member is not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(key), str):
        raise SourceError(f"caption: the .json member has no string {key!r}")
    return doc[key]


# -- Parquet: one row group at a time a process -------------------------------------------------
_file: tuple[str, object] | None = None  # (path, its pyarrow ParquetFile): the footer parsed once
_group: tuple[tuple, dict] | None = None  # ((path, row group, columns), {column: its arrow array})
_worker = False  # this process is a build's worker: its memory pool is ours to choose


def in_worker() -> None:
    """Called as a pool worker starts (`packer.builder.workers.init_worker`)."""
    global _worker
    _worker = True


def _pool() -> None:
    """A worker reads row groups into jemalloc's pool where pyarrow has it: a row group's
    buffers go back to the system between reads, where the default pool kept a few more of them
    a process (a build of a 1 GB file peaked at about 130 MB more on two workers)."""
    global _worker
    if _worker:
        _worker = False
        import pyarrow as pa

        try:
            pa.set_memory_pool(pa.jemalloc_memory_pool())
        except (NotImplementedError, pa.ArrowException):  # a pyarrow built without it: its default
            pass


def _row_group(record: Record, fields) -> dict:
    """The columns this form reads of the record's row group, as arrow arrays, read once and
    kept until another row group is asked for (a shard's records come in row order); a row's
    value is taken out of them alone (`_value`), never the whole column as Python objects."""
    global _file, _group
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = tuple(c for c in (fields["image"], fields["text"]) if c is not None)
    key = (record.path, record.at[0], columns)
    if _group is None or _group[0] != key:
        _group = None  # the last group's memory goes before the next one comes
        _pool()
        try:
            if _file is None or _file[0] != record.path:
                _file = record.path, pq.ParquetFile(record.path)  # read, not mapped: a map's pages count in its RSS
            table = _file[1].read_row_group(record.at[0], columns=list(columns), use_threads=False)
        except (pa.ArrowException, OSError) as exc:
            raise SourceError(f"row group {record.at[0]} unreadable ({str(exc).splitlines()[0][:200]})") from None
        _group = key, {c: table.column(c).combine_chunks() for c in columns}
    return _group[1]


def _value(record: Record, fields, role: str):
    """The row's value of the column playing `role`, as a Python object (a struct's {bytes,
    path} as a dict)."""
    return _row_group(record, fields)[fields[role]][record.at[1]].as_py()


def _parquet_image(record: Record, fields) -> bytes:
    value = _value(record, fields, "image")
    if isinstance(value, dict):  # Hugging Face's Image feature: {bytes, path}
        data, path = value.get("bytes"), value.get("path")
        if data is None and isinstance(path, str) and path:
            where = Path(record.path).parent / path
            try:
                return where.read_bytes()
            except OSError as exc:
                raise SourceError(f"no image bytes in the row, and its path {path} is unreadable "
                                  f"({exc.strerror or exc})") from None
        value = data
    if not isinstance(value, (bytes, bytearray)) or not value:
        raise SourceError(f"no image bytes in the row ({fields['image']!r} is "
                          f"{'empty' if value == b'' else type(value).__name__})")
    return bytes(value)
