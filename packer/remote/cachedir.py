"""A cache dir holds the entries of every dataset (and every build of one) a node has opened;
its limit is one over all of them. A process holds each entry it has open (a shared flock on
`.<entry>.open` beside it, kept for the process's life, touched at each open: beside the entry,
so it outlives the entry's removal and two processes never lock two files of one name). An
entry no process holds (an older build of a URL pushed again, a dataset no run reads now) is
removed whole, the least recently opened first, when a limited reader needs its room."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

from packer.system import flock

_ENTRY = re.compile(r"^[0-9a-f]{16}$")  # `packer.remote.entry.entry_dir`'s names


def hold(root: Path):
    """Entry `root` held by this process until the returned file is closed (and marked opened
    now); None in a cache this process cannot write and that has no such lock (read as it is)."""
    try:
        f = open(_held(root), "ab")
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        try:
            f = open(_held(root), "rb")
        except FileNotFoundError:
            return None
    flock(f, shared=True)
    with contextlib.suppress(OSError):  # (read-only)
        os.utime(f.fileno())
    return f


def others(root: Path) -> list[tuple[Path, int]]:
    """The cache dir's other entries (its <bucket>/<entry> dirs that an open made: their open
    lock beside them), least recently opened first, with the bytes of their files."""
    found = []
    for entry in root.parent.parent.glob("*/*"):
        held = _held(entry)
        if entry == root or not _ENTRY.match(entry.name) or not entry.is_dir() or not held.exists():
            continue
        found.append((held.stat().st_mtime, entry, _bytes(entry)))
    return [(entry, size) for _, entry, size in sorted(found)]


def evict(entries: list[tuple[Path, int]], over: int) -> tuple[int, list[tuple[Path, int]]]:
    """Entries removed whole, in order, while `over` bytes are still to be freed; only those no
    process holds (an exclusive flock on their open lock, not waited for). The bytes freed, and
    the entries left."""
    freed, left = 0, []
    for entry, size in entries:
        if freed >= over:
            left.append((entry, size))
            continue
        with open(_held(entry), "ab") as lock:
            if not flock(lock, block=False):
                left.append((entry, size))  # a process has it open
                continue
            shutil.rmtree(entry, ignore_errors=True)
        freed += size
    return freed, left


def _held(root: Path) -> Path:
    return root.parent / f".{root.name}.open"


def _bytes(root: Path) -> int:
    total = 0
    for d, _, names in os.walk(root):
        for n in names:
            try:
                total += os.stat(os.path.join(d, n)).st_size
            except FileNotFoundError:
                pass
    return total
