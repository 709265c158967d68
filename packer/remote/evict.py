"""Eviction from a cache entry (`packer.remote.cache`'s rules): the shards no process maps, then
this process's soft pins, those used farthest ahead first; and one shard's files on request
(`drop_shard`)."""

from __future__ import annotations

import os

from packer.remote.ledger import Ledger
from packer.remote.parts import PIN
from packer.system import flock


def evict(cache, over: int, rank: float | None, ledger: Ledger) -> bool:
    """Remove unpinned shards, then this process's soft pins, farthest next use first
    (for a fetch ahead at `rank`, only those used after it), until `over` bytes are freed."""
    next_use = cache.next_use or (lambda j: float("inf"))
    mine, soft, used = cache.holdings()
    mine |= cache.rows_held()[0]  # shards its reads by rows pin: its own, not another process's
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
        freed = _remove(cache, j, ledger)
        if freed is None:
            continue  # another process reads it
        over -= freed
        if over <= 0:
            return True
    return False


def drop_shard(cache, k: int) -> bool:
    """Shard k's files removed now (`ShardCache.drop`), unless a process maps it: this one (k
    pinned, or softly pinned and then released), or another (its pin taken); whether they went."""
    pins, softly, _ = cache.holdings()
    if k in pins and k not in softly:
        return False
    if k in pins:
        cache.release(k)
    if k in cache.rows_held()[0]:
        return False
    with cache.accounting() as ledger:
        return _remove(cache, k, ledger) is not None


def _remove(cache, j: int, ledger: Ledger) -> int | None:
    """Shard j's files removed, if no process maps it (an exclusive flock on its pin file, not
    waited for): the bytes freed, or None."""
    freed = 0
    with open(cache.shard_dir(j) / PIN, "ab") as pin:
        if not flock(pin, block=False):
            return None
        for entry in cache.bulk[j]:
            try:
                size = (cache.root / entry.path).stat().st_size
                os.unlink(cache.root / entry.path)
            except FileNotFoundError:
                continue
            freed += size
        ledger.add(-freed, j, present=False)
    return freed
