"""What a cache entry brought over the link: each process's counts (`ds.traffic`), and the
node's, every process's that read the entry added up in its `.traffic` file (`ds.node_traffic`:
what a DataLoader's workers fetched, which their own counts keep in their processes)."""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

from packer.system import flock

FIELDS = ("bytes", "gets", "shard_downloads", "shard_hits")
NODE_FILE = ".traffic"  # in the entry: FIELDS as little-endian int64, under an flock
_LAYOUT = struct.Struct("<4q")


class Traffic:
    """One process's counts of one entry (`mine`), added to the node's file as they come."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.mine = dict.fromkeys(FIELDS, 0)
        self._guard = threading.Lock()

    def add(self, **counts: int) -> None:
        with self._guard:
            for k, v in counts.items():
                self.mine[k] += v
        try:
            fd = os.open(self.root / NODE_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # a read-only cache: this process's counts only
            return
        try:
            flock(fd)
            now = _read(fd)
            os.pwrite(fd, _LAYOUT.pack(*(now[k] + counts.get(k, 0) for k in FIELDS)), 0)
        finally:
            os.close(fd)

    def node(self) -> dict:
        """The entry's counts over every process on this node that read it."""
        try:
            fd = os.open(self.root / NODE_FILE, os.O_RDONLY)
        except OSError:
            return dict.fromkeys(FIELDS, 0)
        try:
            flock(fd, shared=True)
            return _read(fd)
        finally:
            os.close(fd)


def _read(fd: int) -> dict:
    data = os.pread(fd, _LAYOUT.size, 0)
    values = _LAYOUT.unpack(data) if len(data) == _LAYOUT.size else (0,) * len(FIELDS)  # new, or torn: from zero
    return dict(zip(FIELDS, values))
