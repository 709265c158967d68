"""The inputs table of a dataset: every RAW record it was built from, with the size and mtime of
its files at the time (FORMAT.md section 5, `inputs`). `--append` compares it with RAW now, so
that files deleted or rewritten since the build are said, not silently kept.

One JSON line per record, in key order: `[key, [[size_bytes, mtime_ns], ...]]` (the image, then
its caption for pairs). Written while streaming over the scan: memory stays one line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from packer.dataset import format as fmt
from packer.errors import IntegrityError
from packer.builder.scan import Scan

STAGED = fmt.INPUTS_NAME  # in staging until the build is committed


def lines(found: Scan) -> Iterator[str]:
    for r in found.records:
        stats = [list(found.stats[p]) for p in (r.path, r.caption) if p is not None]
        yield json.dumps([r.key, stats]) + "\n"


def read(root: Path, entry: fmt.FileEntry) -> Iterator[tuple[str, list]]:
    """(key, [[size, mtime], ...]) of a dataset's inputs table, checked line by line."""
    path = root / entry.path
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                try:
                    key, stats = json.loads(line)
                    if not isinstance(key, str) or not isinstance(stats, list):
                        raise ValueError
                except ValueError:
                    raise IntegrityError(f"{path}: line {number} is not [key, stats]; run 'packer verify'") from None
                yield key, stats
    except OSError as exc:
        raise IntegrityError(f"{path}: unreadable ({exc.strerror or exc}); run 'packer verify'") from None


def write(staging: Path, found: Scan, base: tuple[Path, fmt.FileEntry] | None) -> None:
    """staging/inputs.jsonl: the base dataset's table (an append), then this build's records."""
    path = staging / STAGED
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        if base is not None:
            for key, stats in read(*base):
                f.write(json.dumps([key, stats]) + "\n")
        f.writelines(lines(found))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def changed_since(root: Path, entry: fmt.FileEntry, found: Scan) -> tuple[list[str], list[str]]:
    """The records of the table whose files RAW no longer has, and those whose size or mtime
    differ now: (deleted, changed), keys in order."""
    now = {r.key: [list(found.stats[p]) for p in (r.path, r.caption) if p is not None] for r in found.records}
    deleted, changed = [], []
    for key, stats in read(root, entry):
        if key not in now:
            deleted.append(key)
        elif now[key] != stats:
            changed.append(key)
    return deleted, changed
