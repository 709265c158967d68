"""Manifests that name image files: JSONL, a JSON list, CSV / TSV (a header row), or a Parquet
table of paths: a record each, with the image's path (relative to the manifest's folder) and
maybe its caption, label and id (which becomes the sample's key; else `manifest:N`).

A record whose field is missing or of the wrong type, whose line is not JSON, whose row has
more fields than its header, or whose path names no file (or a folder) is a skip with its
reason; so is a path that leads out of RAW (absolute, `..`, a link out), unless
--allow-outside: a manifest must not pack, and maybe push, whatever its writer could name.
CSV and TSV are read as spreadsheets save them: UTF-8 with or without a byte-order mark, or
UTF-16 with one (Excel's "Unicode Text"); a TSV's quotes are text, as Common Voice writes
them (`--quoted-tsv` reads them as CSV quoting). Lines, and a JSON list's elements, are read
within --max-doc-bytes, a JSON list streamed an element at a time (`jsonarray`).
"""

from __future__ import annotations

import csv
import json
import os
import stat
from collections.abc import Iterator

from packer.builder.forms import extra, jsonarray
from packer.builder.forms.fields import SPELLINGS, FieldOptions, choose
from packer.builder.records import IMAGE_EXTS, Record
from packer.builder.text import read_lines, too_long
from packer.dataset.format import Skip
from packer.errors import ConfigError, SourceError

EXTS = (".jsonl", ".json", ".csv", ".tsv", ".parquet")
PROBE = 8  # records read to find a manifest's fields


def rows(path: str, rel: str, limit: int, batch_rows: int = 4096, *,
         quoted_tsv: bool = False) -> Iterator[tuple[str, object]]:
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
        yield from _json_rows(path, rel, limit)
    elif ext in (".csv", ".tsv"):
        yield from _table_rows(path, rel, limit, tsv=ext == ".tsv", quoted=quoted_tsv or ext == ".csv")
    else:
        yield from _parquet_rows(path, rel, batch_rows)


def _json_rows(path: str, rel: str, limit: int) -> Iterator[tuple[str, object]]:
    """The records of a JSON list, streamed an element at a time (`jsonarray`)."""
    place = 0
    with open(path, "rb") as f:
        try:
            for place, (_, size, raw) in enumerate(jsonarray.elements(f, limit=limit)):
                if raw is None:
                    yield f"{place}", Skip(f"{rel}:{place}", "scan", f"an element of {too_long(size, limit)}")
                    continue
                try:
                    yield f"{place}", json.loads(raw)
                except ValueError as exc:
                    yield f"{place}", Skip(f"{rel}:{place}", "scan", f"not JSON ({str(exc)[:120]})")
        except SourceError as exc:
            yield f"{place}", Skip(rel if place == 0 else f"{rel}:{place}", "scan", str(exc))


def text_encoding(path: str) -> str:
    """How a table's text is encoded, by its byte-order mark: Excel's "CSV UTF-8" starts with
    one (read as plain UTF-8, its header's first name would be '\ufeffimage_path'), its
    "Unicode Text" is UTF-16 with one; else UTF-8."""
    with open(path, "rb") as f:
        head = f.read(3)
    if head.startswith(b"\xef\xbb\xbf"):
        return "utf-8-sig"
    return "utf-16" if head[:2] in (b"\xff\xfe", b"\xfe\xff") else "utf-8"


def _table_rows(path: str, rel: str, limit: int, *, tsv: bool, quoted: bool) -> Iterator[tuple[str, object]]:
    """CSV / TSV rows as dicts by the header's names; a row with more fields than the header is
    a skip (its fields would land under the wrong names)."""
    with open(path, newline="", encoding=text_encoding(path), errors="replace") as f:
        csv.field_size_limit(max(limit, 1 << 17))
        reader = csv.DictReader(f, delimiter="\t" if tsv else ",", quoting=csv.QUOTE_MINIMAL if quoted else
                                csv.QUOTE_NONE)
        try:
            for row in reader:
                if None in row:  # DictReader's restkey: the fields past the header's
                    n = len(reader.fieldnames or ()) + len(row[None])
                    yield f"{reader.line_num}", Skip(f"{rel}:{reader.line_num}", "scan", f"{n} fields where its header "
                                                     f"names {len(reader.fieldnames or ())}: a field holds an "
                                                     f"unquoted {'tab' if tsv else 'comma'}?")
                else:
                    yield f"{reader.line_num}", row
        except csv.Error as exc:
            yield f"{reader.line_num}", Skip(f"{rel}:{reader.line_num}", "scan", f"not CSV from here on ({exc})")


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
    first = _first(path, rel, options)
    for _, record in first:
        seen += [k for k in record if k not in seen]
    names = [options.image] if options.image is not None else SPELLINGS["image"]
    image = next((n for n in names if any(_image_path(r.get(n)) for _, r in first)), None)
    if image is None:  # no field names an image file ({"path": "src/x.py", "text": ...} is text)
        return None
    chosen = choose(seen, FieldOptions(**{**options.__dict__, "image": image}), rel)
    used = {v for v in chosen.values() if v}
    return chosen, [k for k in seen if k not in used]


def why_not(path: str, rel: str, options: FieldOptions) -> str:
    """Why `fields_of` found no manifest in a file, for the error that says none was found."""
    first = _first(path, rel, options)
    if not first:
        return f"{rel}: no record in its first lines"
    fields = list(dict.fromkeys(k for _, r in first for k in r))
    return (f"{rel}: no field of its first {len(first)} records holds an image file's path (a name ending in "
            f"{', '.join(sorted(IMAGE_EXTS))}; its fields: {', '.join(map(repr, fields[:8]))})")


def _image_path(value) -> bool:
    return isinstance(value, str) and os.path.splitext(value)[1].lower() in IMAGE_EXTS


def _first(path: str, rel: str, options: FieldOptions) -> list:
    out = []
    try:
        for _, record in rows(path, rel, options.max_doc_bytes, batch_rows=PROBE, quoted_tsv=options.quoted_tsv):
            if isinstance(record, dict):
                out.append((None, record))
            if len(out) >= PROBE:
                break
    except (OSError, ConfigError):
        return []
    return out


class Inside:
    """Whether a file a manifest names lies in RAW once links are followed: its folder's real
    path (one realpath a folder, kept) and, for a link, its target's."""

    def __init__(self, raw) -> None:
        self.root = os.path.join(os.path.realpath(raw), "")
        self._folders: dict[str, str] = {}

    def __call__(self, path: str) -> bool:
        if os.path.islink(path):
            real = os.path.realpath(path)
        else:
            folder, name = os.path.split(path)
            if folder not in self._folders:
                self._folders[folder] = os.path.realpath(folder)
            real = os.path.join(self._folders[folder], name)
        return real.startswith(self.root)


def records(path: str, rel: str, fields: dict, options: FieldOptions, met: dict,
            stats: dict, named: dict, inside: Inside) -> Iterator[Record | Skip]:
    """A record per row of one manifest (its image file stat'ed into `stats`, its (device,
    inode) into `named`, with the manifest that named it), or a Skip. An image that another
    manifest named too is a ConfigError: two manifests of one folder would pack it twice."""
    folder = os.path.dirname(path)
    for where, row in rows(path, rel, options.max_doc_bytes, quoted_tsv=options.quoted_tsv):
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
        name = row[fields["image"]]
        image = os.path.join(folder, name)
        try:
            st = os.stat(image)
        except OSError as exc:
            yield Skip(key, "scan", f"{name}: {exc.strerror or 'cannot be read'}")
            continue
        if not stat.S_ISREG(st.st_mode):
            yield Skip(key, "scan", f"{name}: a folder, not an image file")
            continue
        first = named.setdefault((st.st_dev, st.st_ino), rel)
        if first != rel:
            raise ConfigError(f"{first} and {rel} both name {name}: two manifests of the same images would pack each "
                              "twice; pick one with --manifest FILE (or --split NAME, where they are splits)")
        if not options.allow_outside and not inside(image):
            yield Skip(key, "scan", f"{name}: outside RAW (an absolute path, '..' or a link out of it); pass "
                                    "--allow-outside to pack the files a manifest names outside RAW")
            continue
        kept = extra.values(row, options.fields)
        if isinstance(kept, str):
            yield Skip(key, "scan", kept)
            continue
        stats[image] = (st.st_size, st.st_mtime_ns)
        label = row.get(fields["label"]) if fields["label"] else None
        text = row.get(fields["text"]) if fields["text"] else None
        yield Record(key, image, label=None if label is None else met.setdefault(label, len(met)), text=text,
                     extra=kept)


def _problem(row: dict, fields: dict) -> str | None:
    """Why a row is no record: a missing field, or one of the wrong type."""
    image = row.get(fields["image"])
    if not isinstance(image, str) or not image:
        return f"no image path ({fields['image']!r} is {'missing' if image is None else type(image).__name__})"
    if "\0" in image:
        return f"its image path {image[:80]!r} holds a NUL byte, which no file name can"
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
