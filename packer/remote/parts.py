"""The files of a cache entry's shard dir, below the cache's rules (`packer.remote.cache`):
its pin file, whole files, and part files (a fetch's, flocked by their writer while written;
one whose writer is gone is abandoned)."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from pathlib import Path

import numpy as np

from packer.system import flock

PIN = ".pin"  # in each shard dir: shared flocks of the processes that map it


def open_pin(where: Path):
    """Shard dir `where`'s pin file, open for an flock; read-only where the cache is (None when
    it has none there)."""
    try:
        where.mkdir(parents=True, exist_ok=True)
        return open(where / PIN, "ab")
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
    try:
        return open(where / PIN, "rb")
    except FileNotFoundError:
        return None


def whole(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


def size_of(item: os.DirEntry) -> int:
    try:
        return item.stat().st_size
    except FileNotFoundError:
        return 0


def part_file(target: Path, size: int):
    """A part file for `target`, flocked, at its full size (sparse until written)."""
    f = open(target.with_name(f".{target.name}.part-{os.getpid()}-{threading.get_ident()}"), "w+b")
    flock(f)
    f.truncate(size)
    return f


def drop_abandoned_parts(where: Path, accounting) -> None:
    """The part files in shard dir `where` whose writer is gone (killed mid-fetch), removed and
    their bytes taken off the ledger; with a limit or without one."""
    freed = 0
    try:
        items = [i for i in os.scandir(where) if ".part-" in i.name]
    except FileNotFoundError:
        return
    for item in items:
        size = size_of(item)
        if abandoned(item.path):
            freed += size
    if freed:
        with accounting() as ledger:
            ledger.add(-freed)


def abandoned(path: str) -> bool:
    """True (and the file removed) for a part file whose writer is gone."""
    try:
        with open(path, "rb") as f:
            if not flock(f, block=False):
                return False
            os.unlink(path)
            return True
    except FileNotFoundError:
        return True


def write_whole(path: Path, data: bytes) -> None:
    """`data` as `path`, whole or absent (written beside it, then renamed), not fsynced: what a
    cache keeps beside its files (stamps, block lists) is checked again when read, and one lost
    with a crash of the machine is only made again. An OSError (a read-only cache) is raised."""
    temp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}")
    try:
        temp.write_bytes(data)
        os.replace(temp, path)
    except OSError:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise


def count_files(shard_dirs: list[Path], bulk: list) -> tuple[int, np.ndarray]:
    """Bytes of an entry's data files and live part files (a dead writer's removed), and
    whether each shard has any data file, from one listing of each shard dir."""
    total, present = 0, np.zeros(len(bulk), dtype=bool)
    for k, where in enumerate(shard_dirs):
        try:
            entries = list(os.scandir(where))
        except FileNotFoundError:
            continue
        names = {e.path.rsplit("/", 1)[-1] for e in bulk[k]}
        for item in entries:
            if item.name in names:
                total += size_of(item)
                present[k] = True
            elif ".part-" in item.name:
                if abandoned(item.path):
                    continue
                total += size_of(item)
    return total, present
