"""Eviction from a cache entry (`packer.remote.cache`'s rules): the shards no process maps, then
this process's soft pins, those used farthest ahead first."""

from __future__ import annotations

import os

from packer.remote.ledger import Ledger
from packer.remote.parts import PIN
from packer.system import flock


def evict(cache, over: int, rank: float | None, ledger: Ledger) -> bool:
    """Remove unpinned shards, then this process's soft pins, farthest next use first
    (for a fetch ahead at `rank`, only those used after it), until `over` bytes are freed."""
    next_use = cache.next_use or (lambda j: float("inf"))
    with cache._guard:
        mine, soft, used = set(cache._pins), set(cache._soft), set(cache._used)
    present = [j for j in ledger.present() if j not in mine]

    def last_use(j):
        try:
            return (cache.shard_dir(j) / PIN).stat().st_mtime_ns
        except FileNotFoundError:
            return 0
    later = (lambda j: True) if rank is None else (lambda j: next_use(j) > rank)

    def order(j):
        """Used farthest ahead first. Beyond what this process's order ahead shows: another
        process's shards least recently used first (its order is not known here, and in block
        order it reads a shard again within its window: the one it used last is the one it
        needs), then this process's most recently used first (an order that goes round, as
        sequential, blocks or an epoch's end do, uses it last again)."""
        ahead = next_use(j)
        if ahead != float("inf"):
            return (1, -ahead)
        return (0, 1, -last_use(j)) if j in used else (0, 0, last_use(j))
    candidates = sorted((j for j in present if later(j)), key=order)
    candidates += sorted((j for j in soft if later(j)), key=order)
    for j in candidates:
        if j in soft:
            cache.release(j)
        with open(cache.shard_dir(j) / PIN, "ab") as pin:
            if not flock(pin, block=False):
                continue  # another process reads it
            for entry in cache.bulk[j]:
                try:
                    size = (cache.root / entry.path).stat().st_size
                    os.unlink(cache.root / entry.path)
                except FileNotFoundError:
                    continue
                over -= size
                ledger.add(-size)
            ledger.add(0, j, present=False)
        if over <= 0:
            return True
    return False
