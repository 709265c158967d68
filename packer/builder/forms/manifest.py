"""Manifests that name image files: JSONL, a JSON list, CSV / TSV (a header row), or a Parquet
table of paths: a record each, with the image's path (relative to the manifest's folder) and
maybe its caption, label and id (which becomes the sample's key; else `manifest:N`).

A record whose field is missing or of the wrong type, whose line is not JSON, or whose path
names no file (or a folder) is a skip with its reason. Lines are read within --max-doc-bytes;
a JSON list is read whole, so it is refused past JSON_LIST_BYTES (write JSONL instead).
"""

from __future__ import annotations

import csv
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from packer.builder.forms.fields import SPELLINGS, FieldOptions, choose
from packer.builder.records import IMAGE_EXTS, Record
from packer.builder.text import read_lines, too_long
from packer.dataset.format import Skip
from packer.errors import ConfigError

EXTS = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
JSON_LIST_BYTES = 1 << 30
PROBE = 8  # records read to find a manifest's fields


def rows(path: str, rel: str, limit: int, batch_rows: int = 4096) -> Iterator[tuple[str, object]]:
    """(where, record) of a manifest: where is its key suffix (`:N`, a 1-based line of JSONL /
    CSV / TSV, a 0-based place in a JSON list or Parquet rows), record a dict, or a Skip."""
    ext = os.path.splitext(rel)[1].lower()
    if ext == ".jsonl":
        with open(path, "rb") as f:
            for line, (raw, size) in enumerate(read_lines(f, limit), start=1):
                if raw is None:
                    yield f"{line}", Skip(f"{rel}:{line}", "scan", f"line of {too_long(size, limit)}")
                elif raw.strip():
                    try:
                        yield f"{line}", json.loads(raw)
                    except ValueError as exc:
                        yield f"{line}", Skip(f"{rel}:{line}", "scan", f"not JSON ({str(exc)[:120]})")
    elif ext == ".json":
        size = os.path.getsize(path)
        if size > JSON_LIST_BYTES:
            raise ConfigError(f"{rel}: a JSON manifest of {size:,} bytes is read whole; write it as JSONL "
                              "(a record a line), which is read a line at a time")
        try:
            doc = json.loads(Path(path).read_bytes())
        except ValueError as exc:
            yield "0", Skip(rel, "scan", f"not JSON ({str(exc)[:120]})")
            return
        if not isinstance(doc, list):
            yield "0", Skip(rel, "scan", "not a JSON list of records")
            return
        yield from ((f"{i}", r) for i, r in enumerate(doc))
    elif ext in (".csv", ".tsv"):
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            csv.field_size_limit(max(limit, 1 << 17))
            reader = csv.DictReader(f, delimiter="\t" if ext == ".tsv" else ",")
            try:
                for row in reader:
                    yield f"{reader.line_num}", row
            except csv.Error as exc:
                yield f"{reader.line_num}", Skip(f"{rel}:{reader.line_num}", "scan", f"not CSV from here on ({exc})")
    else:
        yield from _parquet_rows(path, rel, batch_rows)


def _parquet_rows(path: str, rel: str, batch_rows: int) -> Iterator[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pfile = pq.ParquetFile(path)
        row = 0
        for batch in pfile.iter_batches(batch_size=batch_rows):
            for record in batch.to_pylist():
                yield f"{row}", record
                row += 1
    except (pa.ArrowException, OSError) as exc:
        yield "0", Skip(rel, "scan", f"not a readable Parquet file from here on ({str(exc).splitlines()[0][:200]})")


def fields_of(path: str, rel: str, options: FieldOptions) -> tuple[dict, list[str]] | None:
    """The field of each role, from the manifest's first records, and the fields the build
    leaves out; None when its records have no image field (not a manifest: text, say)."""
    seen: list[str] = []
    first = _first(path, rel, options.max_doc_bytes)
    for _, record in first:
        seen += [k for k in record if k not in seen]
    names = [options.image] if options.image is not None else SPELLINGS["image"]
    image = next((n for n in names if any(_image_path(r.get(n)) for _, r in first)), None)
    if image is None:  # no field names an image file ({"path": "src/x.py", "text": ...} is text)
        return None
    chosen = choose(seen, FieldOptions(**{**options.__dict__, "image": image}), rel)
    used = {v for v in chosen.values() if v}
    return chosen, [k for k in seen if k not in used]


def _image_path(value) -> bool:
    return isinstance(value, str) and os.path.splitext(value)[1].lower() in IMAGE_EXTS


def _first(path: str, rel: str, limit: int) -> list:
    out = []
    try:
        for _, record in rows(path, rel, limit, batch_rows=PROBE):
            if isinstance(record, dict):
                out.append((None, record))
            if len(out) >= PROBE:
                break
    except (OSError, ConfigError):
        return []
    return out


def records(path: str, rel: str, fields: dict, options: FieldOptions, met: dict,
            stats: dict, named: set) -> Iterator[Record | Skip]:
    """A record per row of one manifest (its image file stat'ed into `stats`, its (device,
    inode) into `named`), or a Skip."""
    folder = os.path.dirname(path)
    for where, row in rows(path, rel, options.max_doc_bytes):
        key = f"{rel}:{where}"
        if isinstance(row, Skip):
            yield row
            continue
        if not isinstance(row, dict):
            yield Skip(key, "scan", f"a {type(row).__name__}, not a record of fields")
            continue
        problem = _problem(row, fields)
        if problem:
            yield Skip(key, "scan", problem)
            continue
        if fields["id"] is not None and row.get(fields["id"]) not in (None, ""):
            key = str(row[fields["id"]])
        image = os.path.join(folder, row[fields["image"]])
        try:
            st = os.stat(image)
        except OSError as exc:
            yield Skip(key, "scan", f"{row[fields['image']]}: {exc.strerror or 'cannot be read'}")
            continue
        if not stat.S_ISREG(st.st_mode):
            yield Skip(key, "scan", f"{row[fields['image']]}: a folder, not an image file")
            continue
        stats[image] = (st.st_size, st.st_mtime_ns)
        named.add((st.st_dev, st.st_ino))
        label = row.get(fields["label"]) if fields["label"] else None
        text = row.get(fields["text"]) if fields["text"] else None
        yield Record(key, image, label=None if label is None else met.setdefault(label, len(met)), text=text)


def _problem(row: dict, fields: dict) -> str | None:
    """Why a row is no record: a missing field, or one of the wrong type."""
    image = row.get(fields["image"])
    if not isinstance(image, str) or not image:
        return f"no image path ({fields['image']!r} is {'missing' if image is None else type(image).__name__})"
    for role in ("text", "label"):
        name = fields[role]
        if name is None:
            continue
        value = row.get(name)
        if value is None or value == "":
            return f"no {role} ({name!r} is missing)"
        ok = isinstance(value, str) if role == "text" else isinstance(value, (int, str)) and not isinstance(value, bool)
        if not ok:
            return f"{name!r} is {type(value).__name__}, not {'a string' if role == 'text' else 'an int or a name'}"
    return None
