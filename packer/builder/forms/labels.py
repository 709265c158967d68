"""Class names and labels of the forms that carry labels in their records (tars, manifests,
Parquet): integer labels index the names a file gives (`--classes FILE`, or a Hugging Face
ClassLabel's), else classes "0", "1", ...; string labels become classes sorted as
torchvision's ImageFolder sorts its folder names. A label outside the names is a skip."""

from __future__ import annotations

from dataclasses import replace

from packer.builder.records import Record
from packer.dataset.format import Skip
from packer.errors import ConfigError

MAX_NUMBERED = 1 << 20  # integer labels without names: classes "0" ... up to this many


def assign(records: list[Record | Skip], met: dict, names: tuple[str, ...] | None) -> tuple[list, tuple[str, ...]]:
    """`records` with their labels as class indexes, and the classes. Each record's label is its
    place in `met` (every label value met, in order: an int, or text); `names`: the classes the
    input names (an integer label indexes them, a text one is looked up), else made from the
    values: "0" ... the largest integer, or the texts sorted."""
    values = list(met)
    numbers = all(_number(v) is not None for v in values)
    top = max((_number(v) for v in values), default=-1) if numbers else -1
    if names is None and top >= MAX_NUMBERED:  # a class a number up to it: a hostile label is memory
        raise ConfigError(f"label {top:,}: integer labels without names make classes 0 to the largest; pass "
                          "--classes FILE naming them (a name a line)")
    if names is None:
        names = tuple(str(i) for i in range(top + 1)) if numbers else tuple(sorted({str(v) for v in values}))
    index = {name: i for i, name in enumerate(names)}
    final = [_class(v, names, index) for v in values]
    out = []
    for r in records:
        if isinstance(r, Record) and r.label is not None:
            label = final[r.label]
            r = replace(r, label=label) if isinstance(label, int) else Skip(r.key, "scan", label)
        out.append(r)
    return out, names


def _number(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    return int(value) if isinstance(value, str) and value.lstrip("-").isdigit() else None


def _class(value, names: tuple[str, ...], index: dict) -> int | str:
    """The class index of a label value, or why it has none."""
    n = _number(value)
    if n is not None:
        return n if 0 <= n < len(names) else f"label {n} is outside the {len(names)} classes"
    return index.get(str(value), f"label {str(value)[:80]!r} is none of the {len(names)} classes")


def read_names(path) -> tuple[str, ...]:
    """--classes FILE: a class name a line, in label order (blank lines at the end ignored)."""
    from pathlib import Path

    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--classes {path}: unreadable ({exc}); give a text file with a class name a line") from None
    while lines and not lines[-1].strip():
        lines.pop()
    names = tuple(line.strip() for line in lines)
    if not names or any(not n for n in names) or len(set(names)) != len(names):
        raise ConfigError(f"--classes {path}: needs one distinct, non-empty class name a line")
    return names
