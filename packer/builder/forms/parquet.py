"""Hugging Face image datasets: Parquet files whose image column is the `Image` feature's struct
`{bytes, path}` (or plain binary), with integer labels whose class names the file's schema
metadata gives (`huggingface`: `info.features.<label>.names` of a ClassLabel) and maybe a
caption column.

The scan reads each file's footer and, row group by row group, its label and id columns only;
every row is a record pointing at its row (`at`: row group, row in it), whose image and caption
the workers read a row group at a time (`read`). Memory is a row group's, never a file's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from packer.builder.forms import extra
from packer.builder.forms.fields import FieldOptions, choose
from packer.builder.forms.labels import problem as label_problem
from packer.builder.records import Record
from packer.dataset.format import Skip
from packer.errors import ConfigError


def open_file(path: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        return f"not a readable Parquet file ({str(exc).splitlines()[0][:200]})"


def features(pfile) -> dict:
    """The `huggingface` schema metadata's features ({} when it has none)."""
    meta = pfile.schema_arrow.metadata or {}
    try:
        info = json.loads(meta.get(b"huggingface", b"{}"))
        found = info.get("info", {}).get("features", {})
        return found if isinstance(found, dict) else {}
    except (ValueError, AttributeError):
        return {}


def image_column(pfile, options: FieldOptions) -> str | None:
    """The column that holds images: the one named, the `Image` feature's, else a binary or
    `{bytes, ...}` struct column with a usual name; None when there is none (a text file)."""
    import pyarrow as pa

    schema = pfile.schema_arrow
    if options.image is not None:
        return options.image if options.image in schema.names else None
    feats = features(pfile)
    typed = [n for n in schema.names if isinstance(feats.get(n), dict) and feats[n].get("_type") == "Image"]
    if typed:
        return typed[0]
    for name in ("image", "img", "jpg", "png", "webp", "image_bytes"):
        if name in schema.names:
            t = schema.field(name).type
            if pa.types.is_binary(t) or pa.types.is_large_binary(t) or (
                    pa.types.is_struct(t) and t.get_field_index("bytes") >= 0):
                return name
    return None


def path_column(pfile, options: FieldOptions) -> str | None:
    """A string column of image file paths (a Parquet manifest), by the usual names."""
    import pyarrow as pa

    schema = pfile.schema_arrow
    names = [options.image] if options.image else ["image_path", "image", "img", "file_name", "filepath", "path"]
    return next((n for n in names if n in schema.names and (pa.types.is_string(schema.field(n).type) or
                                                             pa.types.is_large_string(schema.field(n).type))), None)


def fields_of(pfile, rel: str, options: FieldOptions) -> tuple[dict, list[str]]:
    """The column of each role, and the columns the build leaves out."""
    import pyarrow as pa

    image = image_column(pfile, options)
    if image is None:
        raise ConfigError(f"{rel}: no image column (binary, or the Image feature's struct); pass --image-key COLUMN")
    t = pfile.schema_arrow.field(image).type
    if not (pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_struct(t)):
        raise ConfigError(f"--image-key {image!r}: {rel}'s column is {t}, not image bytes (binary, or the Image "
                          "feature's struct {bytes, path})")
    names = [n for n in pfile.schema_arrow.names if n != image]
    chosen = choose(names, FieldOptions(**{**options.__dict__, "image": None}), rel, roles=("text", "label", "id"))
    chosen = {"image": image, **chosen}
    used = {v for v in chosen.values() if v}
    return chosen, [n for n in pfile.schema_arrow.names if n not in used]


def class_names(pfile, label: str | None) -> tuple[str, ...] | None:
    """A ClassLabel's names, from the schema metadata."""
    feat = features(pfile).get(label) if label else None
    names = feat.get("names") if isinstance(feat, dict) and feat.get("_type") == "ClassLabel" else None
    return tuple(map(str, names)) if isinstance(names, list) and names else None


def records(pfile, path: str, rel: str, fields: dict, met: dict, kept: tuple = ()) -> Iterator[Record | Skip]:
    """A record per row of one file, its label (and id, and the --fields `kept`) read a row group
    at a time; a row whose label is null or negative (the Hub's "no label") is a skip."""
    import pyarrow as pa

    label, key_col = fields["label"], fields["id"]
    names = pfile.schema_arrow.names
    missing = [f.name for f in kept if f.name not in names and f.default is None]
    if missing:
        raise ConfigError(f"--fields: {rel} has no column {missing[0]!r} (its columns: "
                          f"{', '.join(map(repr, names[:12]))}); name one it has, or give a default ({missing[0]}=...)")
    columns = [c for c in (label, key_col, *(f.name for f in kept if f.name in names)) if c]
    row = 0
    for g in range(pfile.metadata.num_row_groups):
        n = pfile.metadata.row_group(g).num_rows
        try:
            table = pfile.read_row_group(g, columns=columns) if columns else None
        except (pa.ArrowException, OSError) as exc:
            yield Skip(f"{rel}:{row}", "scan", f"row group {g} unreadable ({str(exc).splitlines()[0][:200]})")
            row += n
            continue
        labels = table.column(label).to_pylist() if label else [None] * n
        ids = table.column(key_col).to_pylist() if key_col else [None] * n
        present = [f.name for f in kept if f.name in names]
        rows = table.select(present).to_pylist() if present else [{}] * n
        for i in range(n):
            key = f"{rel}:{ids[i]}" if ids[i] is not None else f"{rel}:{row + i}"
            value = labels[i]
            if label is not None and (value is None or (isinstance(value, int) and value < 0)):
                yield Skip(key, "scan", f"no label ({label} is {value})")
                continue
            why = label_problem(value) if label is not None else None
            if why:
                yield Skip(key, "scan", why)
                continue
            values = extra.values(rows[i], kept)
            if isinstance(values, str):
                yield Skip(key, "scan", values)
                continue
            yield Record(key, path, label=None if label is None else met.setdefault(value, len(met)), at=(g, i),
                         extra=values)
        row += n
