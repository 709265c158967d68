"""The records of one conversation file, or of a shard's span of it, as (key, record) or a Skip:
JSONL a line at a time (`file:N`, N its 1-based line), a JSON list an element at a time
(`file:N`, N its 0-based place), Parquet a batch of rows at a time (`file:N`, its 0-based row).
Memory is a line's, an element's or a batch's, never the file's."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from packer.builder.forms import jsonarray
from packer.builder.records import Record
from packer.builder.text import read_lines, too_long
from packer.dataset.format import Skip
from packer.errors import SourceError

PARQUET_BATCH_ROWS = 256
COLUMNS = ("messages", "conversations", "conversation", "system", "image", "images", "id", "prompt", "chosen",
           "rejected")


def records(record: Record, span, max_bytes: int) -> Iterator[tuple[str, object] | Skip]:
    """(key, parsed record) of each record in the file or span (`packer.builder.plan.Span`:
    JSONL and JSON byte ranges, Parquet row ranges; None: the whole file)."""
    ext = os.path.splitext(record.path)[1].lower()
    start, stop = (0, None) if span is None else (span.start, span.stop)
    if ext == ".jsonl":
        yield from _jsonl(record, start, stop, 1 if span is None else span.first_line, max_bytes)
    elif ext == ".json":
        yield from _json(record, start, stop, 0 if span is None or span.start == 0 else span.first_line, max_bytes)
    else:
        yield from _parquet(record, start, stop)


def _parse(key: str, raw: bytes) -> tuple[str, object] | Skip:
    try:
        return key, json.loads(raw)
    except ValueError as exc:
        return Skip(key, "read", f"not JSON ({str(exc)[:120]})")


def _jsonl(record: Record, start: int, stop: int | None, first: int, max_bytes: int):
    with open(record.path, "rb") as f:
        f.seek(start)
        pos = start
        for number, (raw, nbytes) in enumerate(read_lines(f, max_bytes), start=first):
            if stop is not None and pos >= stop:
                return
            pos += nbytes
            key = f"{record.key}:{number}"
            if raw is None:
                yield Skip(key, "read", f"a line of {too_long(nbytes, max_bytes)}")
            elif raw.strip():
                yield _parse(key, raw)


def _json(record: Record, start: int, stop: int | None, first: int, max_bytes: int):
    place = first
    with open(record.path, "rb") as f:
        try:
            for place, (_, size, raw) in enumerate(jsonarray.elements(f, start, stop, limit=max_bytes), start=first):
                key = f"{record.key}:{place}"
                yield Skip(key, "read", f"an element of {too_long(size, max_bytes)}") if raw is None else \
                    _parse(key, raw)
        except SourceError as exc:
            yield Skip(f"{record.key}:{place}" if start else record.key, "read", str(exc))


def parquet_columns(path: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).schema_arrow.names
    except (pa.ArrowException, OSError):
        return []


def _parquet(record: Record, start: int, stop: int | None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pfile = pq.ParquetFile(record.path)
        columns = [c for c in pfile.schema_arrow.names if c in COLUMNS]
        meta = pfile.metadata
        stop = meta.num_rows if stop is None else stop
        groups, row, begin = [], None, 0  # the row groups overlapping [start, stop), and the first one's row
        for g in range(meta.num_row_groups):
            end = begin + meta.row_group(g).num_rows
            if end > start and begin < stop:
                groups.append(g)
                row = begin if row is None else row
            begin = end
        if not groups:
            return
        for batch in pfile.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns, row_groups=groups):
            if row + batch.num_rows <= start:
                row += batch.num_rows
                continue
            for value in batch.to_pylist():
                if start <= row < stop:
                    yield f"{record.key}:{row}", value
                row += 1
                if row >= stop:
                    return
    except (pa.ArrowException, OSError) as exc:
        yield Skip(record.key if start == 0 else f"{record.key}:{start}", "read",
                   f"not a readable Parquet file from here on ({str(exc).splitlines()[0][:200]})")
