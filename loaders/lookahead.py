"""Fetching ahead: the shards of a remote dataset that a pass's coming batches read, downloaded
into the node's cache (`packer.remote.cache`) before the gather needs them. It follows the
order, which the loader owns, and talks to the source's `packer.remote.residency.Residency`
alone: what the coming batches read, what to fetch and keep, and each shard's next use.

A pass's batches are a pure function of integers (`loaders.order.sampler`), so the lookahead
knows them: it walks the next AHEAD_BATCHES batches' ids (past the pass's end, the next epoch's
first batches: what it starts with stays in the cache), lists their shards in order of first
use, and keeps that list's head fetched and pinned, DOWNLOADS shards at a time: all of it
without a cache limit; under one, the next batch's shards and those of the few after it (at
most PREFETCH_SHARDS, within PREFETCH_BATCHES batches), in at most half of what the limit leaves
this process (the limit less the index files, shared by the node's ranks, LOCAL_WORLD_SIZE, and
a loader's worker processes: `packer.remote.limits.budgets`).
The rest of the room keeps shards read already, which an order that goes round reads again: a
sequential scan at half the dataset's size fetches about half of it an epoch, where a window of
the whole room fetched all of it. The same list orders eviction: a shard the list does not hold
is evicted first (the one read last first), then the one used farthest ahead
(`ShardCache.next_use`). A pass whose batches read by rows (`packer.remote.rows`: a batch's
shards do not fit the limit) fetches no whole shard ahead: they would only evict each other.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from packer.remote.limits import budgets
from packer.remote.transfer import DOWNLOADS

AHEAD_BATCHES = 64  # how far ahead the lookahead reads the order: its horizon (eviction's next uses)
PREFETCH_BATCHES = 8  # how far ahead a limited cache fetches, in batches
# and in shards: each shard fetched ahead takes a place in the cache from one an order that goes
# round would read again (a sequential scan at half the cache fetched 0.8x the dataset an epoch
# with a window of 8 batches of 64 over 55-image shards, 9 shards)
PREFETCH_SHARDS = 4


class Lookahead:
    """Keeps the shards of a pass's coming batches fetched (see the module) through `held`, a
    source's residency; `at(b)`: the gather is at batch b; `close()` at the pass's end."""

    def __init__(self, held, batch_ids, more):
        self.held, self.batch_ids, self.more = held, batch_ids, more  # more(b): whether there is a batch b
        self._now = 0
        self._stop, self._wake = threading.Event(), threading.Event()
        self._room = budgets(held)
        held.follow(self)
        held.cold = True  # a pass's first batch: shards not held come by rows
        self._thread = threading.Thread(target=self._run, daemon=True, name="mmpack-fetch")
        self._thread.start()

    def at(self, b: int) -> None:
        self._now = b
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self.held.unfollow(self)

    def _plan(self, shards_of: dict) -> list[int]:
        """The shards of the coming batches, in order of first use."""
        now = self._now
        for b in [b for b in shards_of if b < now]:
            del shards_of[b]
        order, seen = [], set()
        for b in range(now, now + AHEAD_BATCHES):
            if b not in shards_of:
                if not self.more(b):
                    break
                shards_of[b] = self.held.shards_of(self.batch_ids(b)).tolist()
            for g in shards_of[b]:
                if g not in seen:
                    seen.add(g)
                    order.append(g)
        return order

    def _near(self, shards_of: dict) -> set:
        """The shards of the next batches (those `_plan` listed): the next one's, and those of
        the ones after it while they come to at most PREFETCH_SHARDS, within PREFETCH_BATCHES."""
        near: set = set()
        for b in range(self._now, self._now + PREFETCH_BATCHES):
            got = set(shards_of.get(b, ()))
            if near and len(near | got) > PREFETCH_SHARDS:
                break
            near |= got
        return near

    def _run(self) -> None:
        pending: dict = {}
        failed: set = set()  # fetched again by the gather, which raises what went wrong
        no_room: dict = {}  # shard -> the batch at which the limit had no room for it: tried again at the next
        shards_of: dict = {}
        if self.held.rows_pass:  # its batches' rows come by range: whole shards fetched ahead would only churn
            return
        while self.held.cold and not self._stop.is_set():  # a first batch by rows has the link to itself
            self._wake.wait(0.01)
            self._wake.clear()  # (set by `at`, it would make this loop spin, holding the GIL from the gather)
        with ThreadPoolExecutor(DOWNLOADS, thread_name_prefix="mmpack-download") as pool:
            while not self._stop.is_set():
                self._wake.clear()
                try:
                    order = self._plan(shards_of)
                except Exception:  # noqa: BLE001 - the gather computes the same ids and raises
                    return
                used: dict = {}
                window = []
                near = self._near(shards_of)
                for g in order:
                    cache = self.held.cache_of(g)
                    if cache is None:
                        continue
                    key = id(cache)
                    if key in self._room:
                        # fetched ahead: the next PREFETCH_BATCHES batches' shards, in half the room;
                        # the other half keeps shards read already, which an order that goes round
                        # reads again (the next epoch's first ones): fetched once, not once an epoch
                        if g not in near or used.get(key, 0) + self.held.shard_bytes(g) > self._room[key] // 2:
                            break
                        used[key] = used.get(key, 0) + self.held.shard_bytes(g)
                    window.append(g)
                rank = {g: i for i, g in enumerate(order)}
                self.held.ahead(self, frozenset(window), rank)
                pinned = self.held.pinned()
                for g in window:
                    if len(pending) >= DOWNLOADS:
                        break
                    if g not in pending and g not in failed and no_room.get(g) != self._now and g not in pinned:
                        try:
                            pending[g] = pool.submit(self.held.prefetch, g, rank[g])
                        except RuntimeError:  # the interpreter is exiting (a pass left unfinished)
                            return
                done = wait(list(pending.values()), timeout=0.05, return_when=FIRST_COMPLETED)[0] if pending else ()
                for g in [g for g, f in pending.items() if f in done]:
                    f = pending.pop(g)
                    if f.exception() is not None:
                        failed.add(g)
                    elif not f.result():
                        no_room[g] = self._now
                if not pending:
                    self._wake.wait(0.05)

