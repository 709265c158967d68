"""Class names and labels of the forms that carry labels in their records (tars, manifests,
Parquet), by one rule over all of an input's label values: either every value is an integer
(an int, or text such as "3" or "-1") and each indexes the names a file gives (`--classes FILE`,
or a Hugging Face ClassLabel's), else classes "0", "1", ...; or every value is a name, and the
names become classes sorted as torchvision's ImageFolder sorts its folder names (or are looked
up in the names given). A mix of the two is refused: "1" beside "cat" could be class 1 or the
class named "1", and either guess builds a dataset whose labels name the wrong classes. A label
outside the names is a skip; so is a value that is neither (a list, a struct, a float)."""

from __future__ import annotations

from dataclasses import replace

from packer.builder.records import Record
from packer.dataset.format import Skip
from packer.errors import ConfigError

MAX_NUMBERED = 1 << 20  # integer labels without names: classes "0" ... up to this many


def assign(records: list[Record | Skip], met: dict, names: tuple[str, ...] | None,
           where: str = "the labels") -> tuple[list, tuple[str, ...]]:
    """`records` with their labels as class indexes, and the classes. Each record's label is its
    place in `met` (every label value met, in order: an int, or text); `names`: the classes the
    input names (an integer label indexes them, a text one is looked up), else made from the
    values: "0" ... the largest integer, or the texts sorted. `where` names the labels in the
    error a mix of integers and names gets."""
    values = list(met)
    numbers = all(_number(v) is not None for v in values)
    if not numbers and any(_number(v) is not None for v in values):
        ints = sorted({str(v) for v in values if _number(v) is not None}, key=len)[:3]
        texts = sorted({str(v)[:40] for v in values if _number(v) is None})[:3]
        raise ConfigError(f"{where} mix integers ({', '.join(ints)}) and names ({', '.join(map(repr, texts))}): an "
                          "integer indexes the classes, a name is one, and an input holds one kind; make every "
                          "label a name, or every label an index of --classes FILE's names (a name a line)")
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
    if isinstance(value, str):
        text = value.strip()
        return int(text) if text.removeprefix("-").isascii() and text.removeprefix("-").isdigit() else None
    return None


def problem(value) -> str | None:
    """Why a record's label value is no label (None: it is one): a label is an int or a name."""
    if value is None or value == "":
        return "no label (empty)"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return f"its label is {'a ' + type(value).__name__ if not isinstance(value, bool) else 'a bool'}, not an int or a name"
    return None


def _class(value, names: tuple[str, ...], index: dict) -> int | str:
    """The class index of a label value, or why it has none."""
    n = _number(value)
    if n is not None:
        return n if 0 <= n < len(names) else f"label {n} is outside the {len(names)} classes"
    return index.get(str(value), f"label {str(value)[:80]!r} is none of the {len(names)} classes")


def check_distinct(names: tuple[str, ...], where: str) -> None:
    """ConfigError when a class is named twice: two labels would be one class, and
    `class_to_idx` would lose one of them."""
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise ConfigError(f"{where} names {twice!r} twice, so two labels would be one class; give each class its "
                          "own name (--classes FILE: a distinct name a line)")


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
