"""The node-local cache of a dataset in object storage: its files fetched shard by shard when a
reader first needs them (or a `loaders.lookahead.Lookahead` ahead of that), kept under an
optional byte limit, and shared by every process and rank on the node.

A cache entry is a dataset dir (FORMAT.md) whose manifest and index files (the offsets and
shapes of ragged columns, a few bytes a sample) are there from the open on, and whose other
files come and go per shard. The rules, each for a failure users of peers have met:

- A file is fetched once per node: a reader takes the shard's fetch lock (an flock), and one
  that waited on it finds the files there.
- A file lands only whole and verified: it is written to a hidden part file, checked against
  the manifest's checksum (fetched once more on a mismatch, then an IntegrityError naming the
  URL) and renamed into place. A process killed at any instant leaves at most a part file,
  which no reader maps and the next accounting removes (its flock is gone with its writer).
- A file is checked again before a process maps it (a shard's data files when it is pinned, the
  index files at each open, `packer.remote.entry.check_index`): one whose size, times or inode
  differ from the stamp taken when its checksum last held (`packer.remote.stamps`) is hashed
  again, and removed and fetched again when it no longer matches; a flipped byte is never
  served.
- A cache this process cannot write (a read-only mount of a filled one) is read as it is; a
  file it lacks, or one that no longer matches, is one line saying so.
- A shard a process maps is pinned (a shared flock on the shard's pin file, held while it is
  mapped); eviction takes an exclusive one without waiting, so it never removes a pinned shard.
  A shard fetched ahead is pinned softly: the process that fetched it may drop it for a shard
  it needs sooner.
- `limit` bounds the bytes of the cache dir: this entry's files (index, data and part files)
  and other entries (`packer.remote.cachedir`), which go first, whole, when no process holds
  them (counted once a process, at its first reservation). A download
  reserves its bytes first (its part files are made at their full size), evicting unpinned
  shards, then the process's own soft pins, those whose next use is farthest first
  (`next_use`, which a reader that knows its order sets; unknown is farthest, and among those
  another process's least recently used go first, then this process's most recently used: an
  order that goes round uses it last again, while another process in block order reads its
  last shards again within its window).
  A fetch ahead evicts only shards used later than its own, and gives up when that frees too
  little. The bytes held and the shards present are kept in a ledger (`Ledger`), so neither
  a download nor an eviction counts every shard's files, which on a dataset of many shards
  took most of a limited cache's time. A reader whose own holdings leave no room (the shards
  it maps, those its reads by rows pin and their rows: `packer.remote.rows` tells the cache
  of them, whose pins no eviction could take) is refused with the bytes it needs; one that
  waits on other processes' pins waits outside the shard's fetch lock (another reader may
  fetch it meanwhile) and gives up after WAIT_FOR_ROOM_S, saying so. A killed fetch's part
  files go at the shard's next fetch, with a limit or without one.
- Only the files the manifest lists, under the entry's own dir, are ever removed: a local
  dataset is never a cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from packer.dataset import format as fmt
from packer.errors import ConfigError, IntegrityError
from packer.remote import cachedir, client
from packer.remote.ledger import Ledger
from packer.remote.parts import count_files, drop_abandoned_parts, open_pin, part_file, whole
from packer.remote.evict import drop_shard, evict
from packer.remote.limits import check_limit
from packer.remote.blocks import list_bytes
from packer.remote.rows import ROW_REQUESTS, Rows, scratch_bytes
from packer.remote.traffic import Traffic
from packer.remote.stamps import name_of, read_stamps, recheck, stamps_bound, stat_key, unchanged, write_stamps
from packer.remote.transfer import DOWNLOADS, fetch_file
from packer.remote.url import Remote
from packer.system import flock

FETCH = ".fetch"  # in each shard dir: the flock of the process downloading it
ACCOUNTING = ".accounting.lock"  # in the entry: one process at a time reserves or evicts; holds the ledger
WAIT_FOR_ROOM_S = 120  # how long a download waits for other processes to unpin shards
INDEX_PARTS = ("offsets", "shapes")


def index_names(manifest: fmt.Manifest) -> set[str]:
    """The file names, inside a shard dir, of the index files: a ragged column's offsets and shapes."""
    return {name for c in manifest.columns for part, name in fmt.column_file_names(c).items() if part in INDEX_PARTS}


class ShardCache:
    """One remote dataset's cache entry, as one process uses it (see the module's rules).

    `acquire(k)` makes shard k's files present and pins them for this process, `prefetch(k,
    rank)` softly (see the module); `soften(k)` turns a pin soft, `release(k)` drops it.
    `next_use(k)`, when set, orders eviction. Pickles as (url, dir, limit, manifest, packed): each
    process (a forked or spawned DataLoader worker) makes its own client and pins."""

    def __init__(self, url: str, root: Path, manifest: fmt.Manifest, limit: int | None = None,
                 packed: dict | None = None):
        self.url, self.root, self.manifest, self.limit = url, Path(root), manifest, limit
        self.packed = packed  # the archive form: each file's compressed object by path
        index = index_names(manifest)
        self.bulk = [[f for f in s.files if f.path.rsplit("/", 1)[-1] not in index] for s in manifest.shards]
        self.index = [f for s in manifest.shards for f in s.files if f.path.rsplit("/", 1)[-1] in index]
        self.sizes = [sum(f.size_bytes for f in files) for files in self.bulk]
        # the index files, the manifest's copies (the entry's and each generation's) and each
        # shard's stamps (at most, once written) stay
        self.index_bytes = sum(f.size_bytes for f in self.index) + \
            (1 + len(manifest.generations)) * len(manifest.to_json().encode()) + \
            sum(stamps_bound([name_of(e) for e in files]) for files in self.bulk) + list_bytes(manifest)
        self.next_use = None
        self._pid = None

    def __getstate__(self) -> dict:
        return {"url": self.url, "root": str(self.root), "limit": self.limit, "manifest": self.manifest.to_json(),
                "packed": [dataclasses.asdict(f) for f in self.packed.values()] if self.packed else None}

    def __setstate__(self, state: dict) -> None:
        manifest = fmt.Manifest.from_json(state["manifest"], where=f"{state['root']}/{fmt.MANIFEST_NAME}")
        packed = {f["of"]: fmt.ArchiveFile(**f) for f in state["packed"]} if state.get("packed") else None
        self.__init__(state["url"], Path(state["root"]), manifest, state["limit"], packed)

    def here(self) -> ShardCache:
        """This process's state: a forked child drops its parent's (its pins stay the parent's:
        an flock belongs to the open file, which the parent keeps)."""
        if self._pid != os.getpid():
            for f in getattr(self, "_pins", {}).values():
                f.close()
            self._pid, self._pins, self._soft, self._guard = os.getpid(), {}, set(), threading.Lock()
            self._used: set[int] = set()  # the shards this process pinned: eviction tells them from others'
            self._rows = weakref.WeakSet()  # this process's reads by rows (`acquire_rows`): their pins are its own
            self._store, self.traffic = None, Traffic(self.root)
            self._held, self._others = None, None
            if self.root.parent.is_dir():
                self._held = cachedir.hold(self.root)  # never removed whole while this process has it open
        return self

    @property
    def downloaded(self) -> int:
        return self.here().traffic.mine["bytes"]

    def store(self):
        self.here()
        if self._store is None:
            self._store = client.store(Remote(self.url))
        return self._store

    def shard_dir(self, k: int) -> Path:
        return self.root / self.manifest.shards[k].dir

    def pinned(self) -> list[int]:
        with self.here()._guard:
            return list(self._pins)

    def holdings(self) -> tuple[set[int], set[int], set[int]]:
        """This process's pins, at one instant: (the shards it pins, those pinned softly, those
        it ever pinned), what eviction tells its own shards from other processes' by."""
        with self.here()._guard:
            return set(self._pins), set(self._soft), set(self._used)

    def present(self, k: int, files: list | None = None) -> bool:
        return all(whole(self.root / e.path, e.size_bytes) for e in (self.bulk[k] if files is None else files))

    def acquire(self, k: int) -> None:
        """Shard k's files present, verified and pinned for this process (downloaded here, or
        waited for while another process downloads them)."""
        self._pin(k, None)

    def prefetch(self, k: int, rank: float) -> bool:
        """Shard k fetched and softly pinned, if the limit has room for it once the shards used
        after `rank` (its place in the order ahead) are evicted; False when it has not."""
        return self._pin(k, rank)

    def _pin(self, k: int, rank: float | None) -> bool:
        self.here()
        with self._guard:
            if k in self._pins:
                if rank is None:
                    self._soft.discard(k)
                return True
        where = self.shard_dir(k)
        pin = open_pin(where)
        try:
            if pin is not None:
                flock(pin, shared=True)
            found = self.present(k) and self._unchanged(k)
            if not found:
                if pin is None or not os.access(where, os.W_OK):  # a read-only cache: read, never fetched into
                    found = self._check_read_only(k)
                else:
                    found = self._fetch(k, rank)
                    if found is None:
                        pin.close()
                        return False
        except BaseException:
            if pin is not None:
                pin.close()
            raise
        if pin is not None:
            with contextlib.suppress(OSError):  # its last use, which orders eviction (a read-only cache: none)
                os.utime(pin.fileno())
        if found:
            self.traffic.add(shard_hits=1)
        with self._guard:
            if k in self._pins:  # another thread of this process pinned it meanwhile
                if pin is not None:
                    pin.close()
            else:
                self._pins[k] = pin
                self._used.add(k)
                if rank is not None:
                    self._soft.add(k)
            if rank is None:
                self._soft.discard(k)
        return True

    def soften(self, k: int) -> None:
        with self.here()._guard:
            if k in self._pins:
                self._soft.add(k)

    def release(self, k: int) -> None:
        with self.here()._guard:
            pin = self._pins.pop(k, None)
            self._soft.discard(k)
        if pin is not None:
            pin.close()

    def release_all(self) -> None:
        for k in self.pinned():
            self.release(k)

    def drop(self, k: int) -> bool:
        """Shard k's files removed now, unless a process maps it (this one too): a shard the cache
        holds that a batch reads by rows instead, its files making room for its rows."""
        return drop_shard(self.here(), k)

    # -- reads by rows (`packer.remote.rows`): a batch's rows of shards not held whole
    def rows_held(self) -> tuple[set[int], int]:
        """The shards this process's reads by rows pin, and the bytes of the rows they reserved."""
        readers = list(self.here()._rows)
        return set().union(*(r.pinned() for r in readers)), sum(r.reserved for r in readers)

    def acquire_rows(self, rows: Rows, spans: dict[int, dict[str, np.ndarray]]) -> tuple[Path | None, set[str]]:
        """For each shard k of `spans` (the byte spans a batch reads of its files, by path), its
        files read by rows present in the scratch of `rows` (a gather's), its other files in the
        entry, and the shard pinned until `drop_rows`: the scratch dir, and the paths read so."""
        self.here()._rows.add(rows)  # its pins and rows are this process's own (`rows_held`)
        rows.lists([p for by_file in spans.values() for p in by_file])
        rowed, whole_files = {}, {}
        for k, by_file in spans.items():
            rowed_k, whole_files[k] = rows.split(k, by_file)
            rowed.update(rowed_k)
        with ThreadPoolExecutor(ROW_REQUESTS) as pool:  # small files, each shard's: their latency bounds the rate
            for done in [pool.submit(self._pin_rows, rows, k, files) for k, files in whole_files.items()]:
                done.result()
        return (rows.fetch(rowed) if rowed else None), set(rowed)

    def _pin_rows(self, rows: Rows, k: int, files: list[fmt.FileEntry]) -> None:
        pin = open_pin(self.shard_dir(k))
        try:
            flock(pin, shared=True)
            if files and not (self.present(k, files) and unchanged(self.root, files)):
                self._fetch(k, None, files)
        except BaseException:
            pin.close()
            raise
        rows.pin(k, pin)

    def reserve(self, rows: Rows, need: int) -> None:
        """`need` bytes of the rows of `rows` taken in the ledger, evicting as a download does
        (waiting for other processes' pins as `_fetch` does)."""
        deadline = time.monotonic() + WAIT_FOR_ROOM_S
        while True:
            with self.accounting() as ledger:
                if self._room(ledger, need, None):
                    ledger.add(need)
                    return
            self._check_own(need)
            self._wait_for_room(deadline)

    def fetch(self, shards) -> None:
        """Every shard of `shards` present (DOWNLOADS at once), none left pinned: a whole
        dataset for readers that map all of it at open (TokenWindows, `packer verify`)."""
        def one(k):
            self.acquire(k)
            self.release(k)
        with ThreadPoolExecutor(DOWNLOADS) as pool:
            for done in [pool.submit(one, k) for k in shards]:
                done.result()

    def _fetch(self, k: int, rank: float | None, files: list | None = None) -> bool | None:
        """Shard k's files checked and fetched under its fetch lock; whether they were there
        already (another process fetched them while this one waited); None for a fetch ahead
        that found no room. A fetch that waits for room waits outside the lock, so that a process
        reading without a limit, or with room, is never held up behind it."""
        deadline = time.monotonic() + WAIT_FOR_ROOM_S
        while True:
            with open(self.shard_dir(k) / FETCH, "ab") as fetching:
                flock(fetching)
                self._recheck(k)
                if self.present(k, files):
                    return True
                got = self._download(k, rank, files)
                if got is not None:
                    return False if got else None
            self._wait_for_room(deadline)

    def _wait_for_room(self, deadline: float) -> None:
        """A short wait for other processes to unpin shards (`_check_own` said that only theirs
        can make room); past `deadline`, the one line saying so."""
        if time.monotonic() > deadline:
            raise ConfigError(f"{self.url}: the cache {self.root} stayed full of shards other processes are "
                              f"reading for {WAIT_FOR_ROOM_S} s; raise cache_limit for the node's readers")
        time.sleep(0.05)

    def _check_own(self, need: int) -> None:
        """The refusal where what this process holds of the entry and `need` more exceed the limit:
        its index files, the shards it maps, the files of those its reads by rows pin and their
        rows. No eviction takes its pins, and no wait for other processes would make room."""
        with self._guard:
            mapped = {j for j in self._pins if j not in self._soft}
        rowed, reserved = self.rows_held()
        files = sum(e.size_bytes for j in rowed - mapped for e in self.bulk[j] if whole(self.root / e.path, e.size_bytes))
        check_limit(self.url, self.limit, self.index_bytes + sum(self.sizes[j] for j in mapped) + files + reserved + need,
                    "this reader's index files, the shards it maps and the rows it reads", limit=self.limit)

    def _download(self, k: int, rank: float | None = None, files: list | None = None) -> bool | None:
        """Shard k's missing files (of `files`, else all) fetched (True); False for a fetch ahead
        that found no room, None when a fetch for now found none (yet)."""
        missing = [e for e in (self.bulk[k] if files is None else files) if not whole(self.root / e.path, e.size_bytes)]
        drop_abandoned_parts(self.shard_dir(k), self.accounting)  # a killed fetch's (under the fetch lock: all)
        parts = self._reserve(missing, rank)
        if parts is None:
            return False if rank is not None else None
        renamed = False
        try:
            for entry, part in zip(missing, parts):
                packed = self.packed.get(entry.path) if self.packed else None
                gets = fetch_file(self.store, self.url, entry, self.root / entry.path, temp=part, packed=packed)
                self.traffic.add(bytes=(packed or entry).size_bytes, gets=gets)  # what came over the link
            with self.accounting() as ledger:  # not while another process counts: it would see neither name, or both
                for entry, part in zip(missing, parts):
                    os.replace(part.name, self.root / entry.path)
                renamed = True
                ledger.add(0, k)
            self._stamp(k, missing)  # verified as they arrived
            self.traffic.add(shard_downloads=int(files is None))
        finally:
            for part in parts:
                part.close()
            if not renamed:  # what was reserved and not renamed into place leaves the ledger
                with self.accounting() as ledger:
                    for entry, part in zip(missing, parts):
                        try:
                            os.unlink(part.name)
                            ledger.add(-entry.size_bytes)
                        except FileNotFoundError:
                            pass
        return True

    # -- a cached file checked again: a file changed since its checksum last held (its size,
    # times or inode differ from its stamp) is hashed again before it is mapped; one that no
    # longer matches is removed and fetched again, never served
    def _unchanged(self, k: int) -> bool:
        return unchanged(self.root, self.bulk[k])

    def check(self, k: int) -> tuple[list, list]:
        """Shard k's present files every one hashed again (`packer verify URL --cache`), under its
        fetch lock: (those that match, those that did not, now removed to be fetched again)."""
        self.here()
        with open(self.shard_dir(k) / FETCH, "ab") as fetching:
            flock(fetching)
            return self._recheck(k, every=True)

    def _recheck(self, k: int, every: bool = False) -> tuple[list, list]:
        """Under shard k's fetch lock: its present files whose stamp differs (`every`: all of
        them) hashed again (`stamps.recheck`), those that do not match removed (to be fetched
        again)."""
        good, bad = recheck(self.root, self.bulk[k], every)
        if bad:
            with self.accounting() as ledger:
                for entry in bad:
                    os.unlink(self.root / entry.path)
                    ledger.add(-entry.size_bytes)
        return good, bad

    def _check_read_only(self, k: int) -> bool:
        """Shard k of a cache this process cannot write: every file there and matching its
        checksum (hashed again where its stamp differs), else one line saying what is missing."""
        for entry in self.bulk[k]:
            if not whole(self.root / entry.path, entry.size_bytes):
                raise ConfigError(f"{self.url}: the cache {self.root} is read-only and lacks {entry.path}; fill it "
                                  "where it can be written, or give a cache_dir this process can write")
        _, bad = recheck(self.root, self.bulk[k])
        if bad:
            raise IntegrityError(f"{self.root / bad[0].path}: this cached file no longer matches its checksum, and the "
                                 "cache is read-only; fetch it again where the cache can be written")
        return True

    def _stamp(self, k: int, entries: list[fmt.FileEntry]) -> None:
        stamps = read_stamps(self.shard_dir(k))
        stamps.update({name_of(e): stat_key(self.root / e.path) for e in entries})
        write_stamps(self.shard_dir(k), stamps)

    def accounting(self) -> Ledger:
        """The entry's ledger, held (an exclusive flock) by one thread of one process at a time."""
        return Ledger(self.root / ACCOUNTING, len(self.bulk), self._count)

    def _reserve(self, entries: list[fmt.FileEntry], rank: float | None = None) -> list | None:
        """Part files for `entries`, made at their full size (so every process's accounting
        counts them) and flocked while they are written, if the limit has room for them now
        (None: not now; for a fetch ahead at `rank`, evicting only what is used after it)."""
        need = sum(e.size_bytes for e in entries)
        with self.accounting() as ledger:
            if self._room(ledger, need, rank):
                ledger.add(need)
                return [part_file(self.root / e.path, e.size_bytes) for e in entries]
        if rank is None:  # none now; none ever, when this reader's own holdings leave too little
            self._check_own(need)
        return None

    def _room(self, ledger: Ledger, need: int, rank: float | None) -> bool:
        """Whether `need` more bytes fit the limit, once eviction made room. The ledger may count
        part files of killed processes: before saying no, it is counted again from the files."""
        if self.limit is None:
            return True
        if self._others is None:  # the limit is the cache dir's: other entries' bytes count
            self._others = cachedir.others(self.root)
        for recount in (False, True):
            if recount:
                ledger.recount()
            over = self.index_bytes + ledger.used + need - self.limit + sum(size for _, size in self._others)
            if over > 0:  # entries no process has open go first, then this entry's shards
                freed, self._others = cachedir.evict(self._others, over)
                over -= freed
            if over <= 0 or evict(self, over, rank, ledger):
                return True
        return False

    def usage(self) -> int:
        """Bytes of the entry's data files and part files, its index files aside (a dead
        writer's part files removed)."""
        return self._count()[0]

    def _count(self) -> tuple[int, np.ndarray]:
        """`usage()` and whether each shard has any data file."""
        total, present = count_files([self.shard_dir(k) for k in range(len(self.bulk))], self.bulk)
        return total + scratch_bytes(self.root), present  # and the live gathers' rows (a dead one's removed)

