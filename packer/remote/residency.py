"""What one process holds of a remote dataset's shards for one batch source (`Residency`): the
only thing a gather asks to make a batch's shards or rows resident (`ensure`) and to let them go
(`done` once the batch is copied, `release` at the end), and what the order's lookahead tells it
of the coming batches (`ahead`: the shards to keep and each one's next use, which orders the
cache's eviction). It owns the shards this process maps (each pinned in its cache), the batch's
rows read by range (`packer.remote.rows`), the pass's mode (`rows_pass`: every batch by rows,
set by `limits.check_room`; `cold`: a pass's first batch) and the room the node's limit leaves
this process (`limits.budgets`, over `processes`). The gather maps what it is told is held
(`changed(g)`, then `holds(g)`, `scratch(g)`); nothing else of a cache is its business.

Shards are numbered over every reader's, in order (`g`): a Mixture's datasets read as one.
"""

from __future__ import annotations

import os
import types
import weakref

import numpy as np

from packer.remote.limits import budgets, held_whole

# A pass's first batch reads its rows by range when its shards not in the cache hold more than
# this: less comes about as fast whole (a few hundred ranged GETs against one GET a shard), and
# more would keep it waiting in proportion to the dataset, not the batch
COLD_ROWS_BYTES = 512 * 2**20


class Residency:
    """Shards and rows of `readers` held in this process (see the module). `ends`: each shard's
    end over every reader's samples; `names`: the columns read; `changed(g)`: called when
    shard g comes or goes (the gather maps it again, or drops its maps)."""

    def __init__(self, readers: list, ends: np.ndarray, names: list[str], changed):
        self.readers, self.names = readers, names
        # a gather's method held weakly: no cycle keeps a dropped gather, its maps and its reads
        # by rows (whose scratch goes with their object) until the garbage collector runs
        self._changed = weakref.WeakMethod(changed) if isinstance(changed, types.MethodType) else lambda: changed
        self._ends = ends
        self._starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self._shards = [(r, k) for r in readers for k in range(len(r.shard_ends))]
        self._first = {id(r): g - k for g, (r, k) in enumerate(self._shards) if k == 0}
        # each reader's first shard by its place (a Mixture may hold one dataset twice)
        self._firsts = np.concatenate([[0], np.cumsum([len(r.shard_ends) for r in readers])])[:-1].tolist()
        self._live: set[int] = set()  # shards mapped whole (pinned)
        self._pid = os.getpid()  # a forked child holds none of its parent's pins: it maps afresh
        self._rowed: dict[int, tuple] = {}  # shard -> (scratch dir, paths read by rows), this batch
        self._rows: dict = {}  # this process's `packer.remote.rows.Rows` of each reader
        # a batch's shards not held whole are read by rows where whole ones do not fit the limit
        # (`rows_pass`) and in a pass's first batch (`cold`): it waits for its rows, not for
        # every shard it touches
        self.rows_pass, self.cold = False, True
        self.processes = 1  # the loader's worker processes, each mapping its own batch's shards
        self._window: frozenset = frozenset()  # the shards the lookahead keeps
        self._rank: dict[int, int] = {}  # the coming shards' places in the order ahead
        self._follower = None  # the lookahead whose order it follows: the newest pass's

    def changed(self, g: int) -> None:
        tell = self._changed()
        if tell is not None:
            tell(g)

    # -- what the gather asks
    def holds(self, g: int) -> bool:
        return g in self._live or g in self._rowed

    def scratch(self, g: int) -> tuple | None:
        """(scratch dir, paths read by rows) of shard g in this batch, else None (whole or not held)."""
        return self._rowed.get(g)

    def all_mapped(self) -> bool:
        """Every shard is mapped here (in its cache, nothing to fetch)."""
        return len(self._live) == len(self._shards) and self._pid == os.getpid()

    def ensure(self, shard: np.ndarray, rows: np.ndarray) -> None:
        """A batch's shards (`shard`, `rows`: each sample's) mapped, fetched and pinned first,
        or their rows (`_by_rows`). Under a cache limit, those of the last batch go first
        (`_let_go`), and the batch's whole shards are pinned before its rows take room: its rows
        had evicted present shards it then fetched again whole, into a cache its own rows and
        pins held."""
        needed = np.unique(shard).tolist()
        if self._pid != os.getpid():
            self._pid, self._rowed, self._rows = os.getpid(), {}, {}
            for g in list(self._live):
                self._drop(g, pinned=False)
        self.done()
        if any(r.cache is not None and r.cache.limit is not None for r in self.readers):
            self._let_go(needed)
        rowed = self._rows_wanted(needed, shard) if self.rows_pass or self.cold else []
        if not rowed:  # whole shards: the lookahead fetches them beside this gather
            self.cold = False
        for g in needed:
            if g in self._live or g in rowed:
                continue
            r, k = self._shards[g]
            r.cache.acquire(k)
            self._live.add(g)
            self.changed(g)
        if rowed:  # (the lookahead waits until they are copied: whole shards would share the link and CPU)
            self._by_rows(rowed, shard, rows)

    def done(self) -> None:
        """The batch is copied: its rows unmapped and gone (a batch's rows hold room in the cache
        only while it is gathered)."""
        if not self._rowed:
            return
        rowed, self._rowed = list(self._rowed), {}
        for g in rowed:
            self.changed(g)
        for rows in self._rows.values():
            rows.drop()

    def release(self) -> None:
        """Unmaps and unpins every shard held."""
        self.done()
        for g in list(self._live):
            self._drop(g)
        for r in self.readers:
            if r.cache is not None:
                r.cache.release_all()

    # -- what the order's lookahead tells and asks
    def follow(self, lookahead) -> None:
        """The caches' eviction follows `lookahead`'s order from now on (a pass's start: the
        newest pass's, where an earlier pass's iterator is still open), from an empty window."""
        self._follower, self._window, self._rank = lookahead, frozenset(), {}
        for r in self.readers:
            if r.cache is not None:
                r.cache.next_use = _NextUse(self, self._first[id(r)])

    def unfollow(self, lookahead) -> None:
        """`lookahead`'s pass ended: eviction follows no order, unless a newer pass's."""
        if self._follower is not lookahead:
            return
        self._follower, self._window, self._rank = None, frozenset(), {}
        for r in self.readers:
            if r.cache is not None:
                r.cache.next_use = None

    def ahead(self, lookahead, window: frozenset, rank: dict[int, int]) -> None:
        """The coming batches' shards, as `lookahead` sees them: those to keep (`window`) and each
        one's place in the order ahead (`rank`), which the caches evict by (unknown: never used
        again). From a lookahead the residency no longer follows, nothing."""
        if self._follower is lookahead:
            self._rank, self._window = rank, window

    def next_use(self, g: int) -> float:
        return self._rank.get(g, float("inf"))

    def prefetch(self, g: int, rank: float) -> bool:
        """Shard g fetched and softly pinned if the limit has room once the shards used after
        `rank` (its place in the order ahead) are evicted (`ShardCache.prefetch`)."""
        r, k = self._shards[g]
        return r.cache.prefetch(k, rank)

    def pinned(self) -> set[int]:
        """The shards this process pins, softly or not (each place of a dataset a Mixture holds twice)."""
        return {first + k for first, r in zip(self._firsts, self.readers) if r.cache is not None
                for k in r.cache.pinned()}

    # -- what a shard is
    def shards_of(self, ids: np.ndarray) -> np.ndarray:
        """The shards (positions over every reader's) that a batch of ids reads, sorted."""
        return np.unique(np.searchsorted(self._ends, ids, side="right"))

    def shard_bytes(self, g: int) -> int:
        r, k = self._shards[g]
        return r.cache.sizes[k] if r.cache is not None else 0

    def cache_of(self, g: int):
        return self._shards[g][0].cache

    def rows_of(self, r):
        """This process's reads by rows (`packer.remote.rows.Rows`) of reader `r`'s cache."""
        from packer.remote.rows import Rows

        if id(r) not in self._rows:
            self._rows[id(r)] = Rows(r.cache.here())
        return self._rows[id(r)]

    # -- the work of `ensure`
    def _let_go(self, needed: list[int]) -> None:
        """Under a limit only the batch's shards stay mapped (a mapped shard cannot be evicted):
        the last batch's others go, softly pinned where the lookahead still wants them, and so do
        the pins the lookahead took for shards that left its window."""
        window = self._window
        for g in self._live - set(needed):
            self._drop(g, soften=g in window)
        for g in self.pinned():
            if g not in window and g not in self._live:
                r, k = self._shards[g]
                r.cache.release(k)

    def _rows_wanted(self, needed: list[int], shard: np.ndarray) -> list[int]:
        """Of a batch's shards, those read by rows: not mapped here nor in the cache, of a reader
        whose files have block lists; in a cold batch only where they hold over COLD_ROWS_BYTES (a
        cold batch whose shards come about as soon as its rows would reads them whole). Under a
        limit, also those mapped or in the cache that it cannot hold whole beside the rows
        (`_unheld`)."""
        missing = [g for g in needed if g not in self._live and self._shards[g][0].cache is not None and
                   not self._shards[g][0].cache.present(self._shards[g][1])]
        if not self.rows_pass and sum(self.shard_bytes(g) for g in missing) <= COLD_ROWS_BYTES:
            return []  # (decided before asking the store for a block list)
        rowed = [g for g in missing if self.rows_of(self._shards[g][0]).usable()]
        if not self.rows_pass and sum(self.shard_bytes(g) for g in rowed) <= COLD_ROWS_BYTES:
            return []
        return rowed + self._unheld([g for g in needed if g not in missing], rowed, shard)

    def _unheld(self, held: list[int], rowed: list[int], shard: np.ndarray) -> list[int]:
        """Of a batch's shards mapped here or present in a limited cache (`held`), those read by
        rows all the same, unmapped and their files removed (`ShardCache.drop`) to make room for
        the rows: all but those that the room the limit leaves this process (`limits.budgets`)
        holds beside the batch's other rows (and shards that cannot be read so), the ones with
        most of its rows first (`limits.held_whole`). One that another process maps stays whole:
        its bytes are held either way."""
        room, out = budgets(self), []
        counts = np.bincount(shard, minlength=len(self._shards))
        for key, nbytes in room.items():
            def of(gs, key=key):
                return [g for g in gs if id(self.cache_of(g)) == key]
            wanted = sorted((g for g in of(held) if self.rows_of(self._shards[g][0]).usable()), key=lambda g: -counts[g])
            besides = sum(self._row_bytes(g, counts[g]) for g in of(rowed)) + \
                sum(self.shard_bytes(g) for g in of(held) if g not in wanted)
            whole = held_whole(nbytes, besides, [(self.shard_bytes(g), self._row_bytes(g, counts[g])) for g in wanted])
            for g in [g for g, keep in zip(wanted, whole) if not keep]:
                if g in self._live:
                    self._drop(g)
                if self.cache_of(g).drop(self._shards[g][1]):
                    out.append(g)
        return out

    def _row_bytes(self, g: int, n: int) -> int:
        """About the bytes `n` rows of shard g take read by rows: its files read so in proportion,
        its other files whole."""
        r, k = self._shards[g]
        ranged = set(self.rows_of(r).block) & {r.values_path(k, name) for name in self.names}
        num = max(1, int(self._ends[g] - self._starts[g]))
        return sum(e.size_bytes * int(n) // num if e.path in ranged else e.size_bytes for e in r.cache.bulk[k])

    def _by_rows(self, rowed: list[int], shard: np.ndarray, rows: np.ndarray) -> None:
        """The batch's rows of shards `rowed` fetched by range and mapped (see `rows_pass`)."""
        by_reader: dict = {}
        for g in rowed:
            r, k = self._shards[g]
            sel = rows[shard == g]
            by_reader.setdefault(id(r), (r, {}))[1][k] = dict(r.spans(k, name, sel) for name in self.names)
        for r, spans in by_reader.values():
            scratch, paths = r.cache.acquire_rows(self.rows_of(r), spans)
            for k in spans:
                self._rowed[self._first[id(r)] + k] = (scratch, paths)
        for g in self._rowed:
            self.changed(g)

    def _drop(self, g: int, soften: bool = False, pinned: bool = True) -> None:
        r, k = self._shards[g]
        self._live.discard(g)
        self.changed(g)
        if pinned:
            r.release(k, soften)


class _NextUse:
    """A cache's next use of its shard k: its place in the order ahead, else never."""

    def __init__(self, residency: Residency, first: int):
        self.residency, self.first = residency, first

    def __call__(self, k: int) -> float:
        return self.residency.next_use(self.first + k)
