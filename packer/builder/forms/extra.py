"""--fields: the other fields of a record a build keeps, each as a column (a speech set's speaker
and age, a caption set's source URL): a manifest's or a Common Voice table's field, a Parquet
row's column, a WebDataset sample's `.json` member's key.

`--fields speaker,age=0,url=` names them, each with a default where a record lacks it (`age=0`;
`url=`: the empty text); a record that lacks one without a default is a skip naming it. A field's
type comes from all its values: integers (`3`, or text such as "3" in a CSV) make an int64
column, numbers a float64 one, anything else text (a string column); booleans a bool one. A
value of another type than the field's (text where the others are numbers) is that record's
skip. Values are read in the scan, so a field is typed before anything is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from packer.builder.records import Record
from packer.dataset import format as fmt
from packer.dataset.format import Skip
from packer.errors import ConfigError

TAKEN = ("image", "label", "tokens", "key", "audio", "loss_mask", "images", "image_positions")
_MISSING = object()


@dataclass(frozen=True)
class Field:
    name: str
    default: str | None = None  # as --fields spells it; None: a record without it is a skip


def parse(text: str | None) -> tuple[Field, ...]:
    """--fields NAME[=DEFAULT],...; () when not given."""
    if not text:
        return ()
    out = []
    for part in str(text).split(","):
        name, eq, default = part.strip().partition("=")
        if not fmt.is_column_name(name) or name in TAKEN or name.endswith(("_lengths", "_size")):
            raise ConfigError(f"--fields: {name!r} is not a field a build can keep as a column (a plain name, not "
                              f"{', '.join(TAKEN)})")
        out.append(Field(name, default if eq else None))
    if len({f.name for f in out}) != len(out):
        raise ConfigError(f"--fields {text}: a field named twice")
    return tuple(out)


def values(source: dict, fields: tuple[Field, ...]) -> tuple | str:
    """A record's (name, raw value) of each field (a default's text where it lacks one), or why
    it is no record (a field it lacks, with no default)."""
    out = []
    for f in fields:
        value = source.get(f.name, _MISSING) if isinstance(source, dict) else _MISSING
        if value is _MISSING or value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
            if f.default is None:
                return f"no {f.name!r} (--fields names it, with no default: {f.name}=DEFAULT)"
            value = f.default
        out.append((f.name, value))
    return tuple(out)


def typed(items: list[Record | Skip], fields: tuple[Field, ...]) -> tuple[list[Record | Skip], tuple[fmt.Column, ...]]:
    """The records with their fields' values as stored (a value of another type: a skip), and
    the fields' columns."""
    if not fields:
        return items, ()
    records = [r for r in items if isinstance(r, Record)]
    kinds = [_kind([r.extra[k][1] for r in records], f) for k, f in enumerate(fields)]
    out = []
    for r in items:
        if isinstance(r, Record):
            converted = [_convert(v, kind, f) for (_, v), kind, f in zip(r.extra, kinds, fields)]
            bad = next((c for c in converted if isinstance(c, str)), None)
            r = Skip(r.key, "scan", bad) if bad else replace(r, extra=tuple(zip((f.name for f in fields), converted)))
        out.append(r)
    columns = tuple(fmt.Column(f.name, "|u1", (None,), encoding="utf-8") if kind == "text" else
                    fmt.Column(f.name, {"int": "<i8", "float": "<f8", "bool": "|b1"}[kind], ())
                    for f, kind in zip(fields, kinds))
    return out, columns


def _number(value):
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        for cast in (int, float):
            try:
                return cast(value.strip())
            except ValueError:
                continue
    return None


def _kind(values: list, f: Field) -> str:
    """The type of a field from its values: bool, int, float or text. Where the input types its
    values (JSON, Parquet) and some are numbers, the field is a number (a text among them is
    its record's skip); where all are text (a CSV), numbers where every one reads as one."""
    if values and all(isinstance(v, bool) for v in values):
        return "bool"
    numbers = [_number(v) for v in values]
    typed = any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    if values and (typed or all(n is not None for n in numbers)):
        return "int" if all(isinstance(n, int) for n in numbers if n is not None) else "float"
    return "text"


def _convert(value, kind: str, f: Field):
    """A value as its column stores it (a numpy scalar, or text's bytes), or why it is none."""
    if kind == "text":
        if isinstance(value, (dict, list)):
            return f"its {f.name!r} is a {type(value).__name__}, not a value (--fields keeps numbers and text)"
        text = value if isinstance(value, str) else str(value)
        return np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
    if kind == "bool":
        return np.bool_(value)
    n = _number(value)
    if n is None:
        return f"its {f.name!r} is {str(value)[:40]!r}, not a number as the field's others are"
    return np.int64(n) if kind == "int" else np.float64(n)
