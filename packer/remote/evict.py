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
        mine, soft = set(cache._pins), set(cache._soft)
    present = [j for j in ledger.present() if j not in mine]

    def last_use(j):
        try:
            return (cache.shard_dir(j) / PIN).stat().st_mtime_ns
        except FileNotFoundError:
            return 0
    later = (lambda j: True) if rank is None else (lambda j: next_use(j) > rank)
    # used farthest ahead first; beyond what the order ahead shows, the shard used last
    # first: an order that goes round (sequential, blocks, an epoch's end) uses it last again
    candidates = sorted((j for j in present if later(j)), key=lambda j: (-next_use(j), -last_use(j)))
    candidates += sorted((j for j in soft if later(j)), key=lambda j: (-next_use(j), -last_use(j)))
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
