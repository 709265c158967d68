"""The ledger of a remote dataset's cache entry: the bytes its data and part files hold and which
shards are present, kept in the entry's accounting file under an exclusive flock, so that a
download costs O(1) and an eviction O(shards present) where counting the files costs O(shards)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from packer.system import flock

LEDGER_HEAD = 38  # the ledger's head: bytes of data and part files (20 digits), its checksum; then a bit a shard


class Ledger:
    """What the entry holds, kept in its accounting file under an exclusive flock (a context
    manager): the bytes of its data and part files and which shards are present, updated by
    each reservation, rename and eviction, so a download costs O(1) and an eviction O(shards
    present) where counting the files costs O(shards). Counted from the files when it is
    missing or torn (its checksum), and when it may count a killed process's part files."""

    def __init__(self, path: Path, num_shards: int, count: Callable[[], tuple[int, np.ndarray]]):
        self.num_shards, self.count = num_shards, count  # count(): (bytes, present), from the files
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._used: int | None = None
        self._present = None  # a bool per shard
        self._dirty = False

    def __enter__(self) -> Ledger:
        try:
            flock(self.fd)
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._dirty:  # one write, its checksum telling a torn one
                bits = np.packbits(self._present).tobytes()
                head = b"%020d" % self._used
                os.pwrite(self.fd, head + b" " + _digest(head + bits) + b"\n" + bits, 0)
        finally:
            os.close(self.fd)

    def _read(self) -> None:
        n = self.num_shards
        data = os.pread(self.fd, LEDGER_HEAD + (n + 7) // 8, 0)
        head, digest, bits = data[:20], data[21:LEDGER_HEAD - 1], data[LEDGER_HEAD:]
        if len(data) == LEDGER_HEAD + (n + 7) // 8 and head.isdigit() and digest == _digest(head + bits):
            self._used = int(head)
            self._present = np.unpackbits(np.frombuffer(bits, np.uint8), count=n).astype(bool)
        else:
            self.recount()

    @property
    def used(self) -> int:
        if self._used is None:
            self._read()
        return self._used

    def present(self) -> list[int]:
        if self._present is None:
            self._read()
        return np.flatnonzero(self._present).tolist()

    def add(self, nbytes: int, shard: int | None = None, present: bool = True) -> None:
        """`nbytes` more (or fewer) in the entry; shard `shard` now present or not."""
        self._used = max(self.used + nbytes, 0)
        if shard is not None:
            self._present[shard] = present
        self._dirty = True

    def recount(self) -> None:
        self._used, self._present = self.count()
        self._dirty = True


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).hexdigest().encode()
