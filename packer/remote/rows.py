"""Reads finer than a shard: a batch's rows whose shard the node's cache does not hold, read by
ranged GETs of their blocks, each block checked against the file's block list (FORMAT.md 9,
object storage form), into sparse files of this process's own (its scratch), which the gather
maps where the shard's files would be. So a random order runs at any cache limit (its batches
read every shard: whole shards refused a limit below one batch's shards, or fetched the dataset
many times over an epoch), and a cold epoch's first batch waits for its rows, not for every
shard it touches.

The rules, each for what a reader must never see:
- A block is used only once its bytes match the block list, and the list only once it matches
  the manifest's checksum of the file (by section 6 its XXH3-128 is that checksum). A block that
  does not match is fetched once more, then an IntegrityError names the object. A file without a
  list (pushed by an mmpack before lists, or one whose list is damaged) comes whole, as before.
- Only files whose rows are a block or more each are read by rows (`ranged`): a block is the
  unit a range is checked by, so smaller rows would bring their neighbours' bytes each time.
  A shard's other files (labels, keys, small columns) come whole into the shared cache, pinned
  like any shard's files while the batch maps them.
- The scratch is this process's alone (a dir under the entry's `.rows`, flocked by its owner):
  no other process reads it, so a process killed mid-write leaves nothing another would use,
  and the next open of the entry (or its next count) removes it (`drop_dead`). It holds one batch's rows while the batch is
  gathered (`drop` once it is copied): a random order reads each row once an epoch, so rows
  kept longer are never read again before they would be evicted. Its bytes are reserved in the
  entry's ledger before they are fetched, so the cache dir stays within its limit.
- Neighbouring blocks come in one request, up to REQUEST_BYTES (object stores charge and pace
  by the request), ROW_REQUESTS requests at once; a file's header block is checked once and
  written from memory after that.
"""

from __future__ import annotations

import os
import secrets
import shutil
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from packer.dataset import format as fmt
from packer.dataset.format.checksum import block_digest
from packer.remote import transfer
from packer.remote.blocks import (BLOCKS, DIGEST, block_span, blocks_of, header_of, matches, num_blocks, ranged,
                                  values_files)
from packer.remote.parts import write_whole
from packer.errors import IntegrityError
from packer.remote.url import Remote
from packer.system import flock

SCRATCH = ".rows"  # in the entry: each process's scratch dir, beside its lock file
REQUEST_BYTES = 8 * 2**20  # neighbouring blocks come in one ranged GET of at most this
ROW_REQUESTS = 32  # ranged GETs at once: each is small, so their latency, not the link, bounds the rate


def requests(blocks: np.ndarray, size: int, block: int) -> list[tuple[int, int]]:
    """Runs of neighbouring blocks, as [first, last] block pairs of at most REQUEST_BYTES each."""
    out: list[list[int]] = []
    for i in blocks.tolist():
        if out and i == out[-1][1] + 1 and block_span(i, size, block)[1] - block_span(out[-1][0], size, block)[0] \
                <= REQUEST_BYTES:
            out[-1][1] = i
        else:
            out.append([i, i])
    return [(a, b) for a, b in out]


def drop_dead(root: Path) -> tuple[list[Path], int]:
    """The entry's scratch dirs whose process is gone (its flock is free: a kill drops it)
    removed: (the live ones, how many were removed). A killed reader's dir held a sparse file of
    each file it read by rows, at the file's full size, until a count of the entry that might
    never come (a cache without a limit counts nothing): every open removes them too."""
    live, dead = [], 0
    try:
        locks = [i for i in os.scandir(root / SCRATCH) if i.name.endswith((".lock", ".lock.part"))]
    except (FileNotFoundError, NotADirectoryError):
        return live, dead
    for item in locks:
        where = Path(item.path[:-len(".lock")]) if item.name.endswith(".lock") else None
        try:
            with open(item.path, "rb") as f:
                if flock(f, block=False):  # its process is gone
                    if where is not None:
                        shutil.rmtree(where, ignore_errors=True)
                    os.unlink(item.path)
                    dead += 1
                    continue
        except FileNotFoundError:
            continue
        if where is not None:
            live.append(where)
    return live, dead


def scratch_bytes(root: Path) -> int:
    """Bytes on disk of the entry's live scratch dirs; a dead process's removed."""
    total = 0
    for where in drop_dead(root)[0]:
        for path in where.rglob("*"):
            try:
                total += path.lstat().st_blocks * 512 if path.is_file() else 0
            except FileNotFoundError:
                pass
    return total


class Rows:
    """One gather's reads by rows of one cache entry, in one process (see the module): `usable`,
    whether any file is read so; `fetch(spans)` makes a batch's rows present in its scratch
    (`ShardCache.acquire_rows` pins their shards, `pin`); `drop()` ends the batch, and so does
    the object's end (a Loader left mid-pass)."""

    def __init__(self, cache):
        self.cache = cache
        self.block = ranged(cache.manifest)  # path -> data block bytes
        self.entries = {e.path: e for files in cache.bulk for e in files if e.path in self.block}
        self._lists: dict[str, bytes | None] = {}
        # each file's header block: the one the manifest implies until it is checked against the
        # list's first digest (then kept, or None: fetched), then the one checked
        self._heads: dict[str, bytes | None] = {}
        self._made = {e.path: header_of(shard, c, e) for shard, c, e in values_files(cache.manifest)
                      if e.path in self.block}
        self._state = _Scratch(cache)
        self._usable = None
        self._guard = threading.Lock()
        weakref.finalize(self, self._state.drop)

    @property
    def reserved(self) -> int:
        return self._state.reserved

    def pin(self, k: int, pin) -> None:
        """Shard k's pin file (a shared flock), held until `drop`."""
        with self._guard:
            old, self._state.pins[k] = self._state.pins.get(k), pin
        if old is not None:
            old.close()

    def pinned(self) -> set[int]:
        """The shards this gather's batch pins (their small files mapped from the entry)."""
        with self._guard:
            return set(self._state.pins)

    def drop(self) -> None:
        self._state.drop()

    def usable(self) -> bool:
        """Whether this dataset has files read by rows, the store holds their block lists (asked
        once, of the first such file) and the cache can be written (a scratch is made there)."""
        if self._usable is None:
            self._usable = bool(self.entries) and os.access(self.cache.root, os.W_OK) and \
                self.block_list(next(iter(self.entries.values()))) is not None
        return self._usable

    def why_not(self) -> str | None:
        """Why this dataset is not read by rows, in words; None where it is (`usable`)."""
        if self.usable():
            return None
        if not self.entries:
            return "its samples are under 32 KiB each: a range is checked by its block of 64 KiB, which holds two or " \
                "more, so each would bring its neighbours"
        if not os.access(self.cache.root, os.W_OK):
            return "its rows would be read into the cache dir, which this process cannot write"
        return "the store holds no block lists beside its files (pushed by an older mmpack): push it again to read " \
            "it by rows"

    def block_list(self, entry: fmt.FileEntry) -> bytes | None:
        """The block list of `entry`, checked against the manifest's checksum: from the cache,
        else the store (written into the cache); None where the store has none, or a damaged
        one (the file then comes whole)."""
        if entry.path in self._lists:
            return self._lists[entry.path]
        size = DIGEST * num_blocks(entry.size_bytes, self.block[entry.path])
        where = self.cache.root / entry.path
        kept = where.parent / BLOCKS / where.name
        got = None
        try:
            data = kept.read_bytes()
            got = data if matches(data, size, entry) else None
        except OSError:
            pass
        if got is None:
            data = transfer.get_small(self.cache.store, self.cache.url, entry.path + BLOCKS, size)
            self.cache.traffic.add(gets=1, bytes=len(data or b""))
            if data is not None and matches(data, size, entry):
                got = data
                try:
                    kept.parent.mkdir(exist_ok=True)
                    write_whole(kept, data)  # (checked again when read)
                except OSError:  # a read-only cache: kept in this process only
                    pass
        self._lists[entry.path] = got
        return got

    def lists(self, paths) -> None:
        """The block lists of `paths` (those read by rows) at hand, fetched ROW_REQUESTS at once."""
        todo = [self.entries[p] for p in dict.fromkeys(paths) if p in self.entries and p not in self._lists]
        if todo:
            with ThreadPoolExecutor(min(ROW_REQUESTS, len(todo))) as pool:
                list(pool.map(self.block_list, todo))

    def split(self, k: int, spans: dict[str, np.ndarray]) -> tuple[dict, list]:
        """Shard k's files: those read by rows (path -> spans, each with its block list) and
        those that come whole (the shard's other files, and any without a list)."""
        rowed = {p: s for p, s in spans.items() if p in self.entries and self.block_list(self.entries[p]) is not None}
        return rowed, [e for e in self.cache.bulk[k] if e.path not in rowed]

    def fetch(self, spans: dict[str, np.ndarray]) -> Path:
        """The blocks of `spans` (path -> [n, 2] byte spans) present in this process's scratch,
        each checked; the scratch dir (shard dirs below it, as in the entry)."""
        state = self._state
        where = state.where()
        todo = []
        for path, wanted in spans.items():
            entry, block = self.entries[path], self.block[path]
            target = where / path
            with self._guard:
                have = state.have.get(path)
                if have is None:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with open(target, "wb") as f:
                        f.truncate(entry.size_bytes)  # sparse: only what is fetched takes room
                    have = state.have[path] = np.zeros(num_blocks(entry.size_bytes, block), bool)
            need = blocks_of(wanted, entry.size_bytes, block)
            head = None if have[0] else self._head(path)
            if head is not None:  # the header, checked: written, not fetched
                with open(target, "r+b") as f:
                    os.pwrite(f.fileno(), head, 0)
                have[0] = True
            need = need[~have[need]]
            todo += [(entry, block, target, a, b) for a, b in requests(need, entry.size_bytes, block)]
        if not todo:
            return where
        nbytes = sum(block_span(b, e.size_bytes, bl)[1] - block_span(a, e.size_bytes, bl)[0] for e, bl, _, a, b in todo)
        self.cache.reserve(self, nbytes)
        with self._guard:
            state.reserved += nbytes
        self._gets = self._bytes = 0
        try:
            with ThreadPoolExecutor(min(ROW_REQUESTS, len(todo))) as pool:
                for done in [pool.submit(self._one, *job) for job in todo]:
                    done.result()
        finally:
            self.cache.traffic.add(gets=self._gets, bytes=self._bytes)
        return where

    def _head(self, path: str) -> bytes | None:
        """The header block of `path` where it is known and checked: the one the manifest implies
        where it matches the block list's first digest, or one fetched and checked before."""
        if path not in self._heads:
            made = self._made.get(path)
            ok = made is not None and block_digest(made) == self._lists[path][:DIGEST]
            self._heads[path] = made if ok else None
        return self._heads[path]

    def _one(self, entry: fmt.FileEntry, block: int, target: Path, a: int, b: int) -> None:
        """Blocks a..b of `entry` fetched into `target` and checked: fetched once more where one
        does not match its list, then refused naming the object."""
        size, digests = entry.size_bytes, self._lists[entry.path]
        start, end = block_span(a, size, block)[0], block_span(b, size, block)[1]
        for _ in (1, 2):
            fits = transfer.get_range(self.cache.store, self.cache.url, entry.path, start, end, target)
            with self._guard:  # added to the cache's counts once the batch's rows are in (`fetch`)
                self._gets, self._bytes = self._gets + 1, self._bytes + end - start
            if fits and self._check(target, digests, a, b, size, block):
                with self._guard:
                    self._state.have[entry.path][a:b + 1] = True
                if a == 0:
                    with open(target, "rb") as f:
                        self._heads[entry.path] = os.pread(f.fileno(), block_span(0, size, block)[1], 0)
                return
        raise IntegrityError(f"{Remote(self.cache.url).where(entry.path)}: bytes {start:,} to {end:,} do not match its block list "
                             "(fetched twice); the remote dataset is damaged: push it again")

    @staticmethod
    def _check(target: Path, digests: bytes, a: int, b: int, size: int, block: int) -> bool:
        with open(target, "rb") as f:
            for i in range(a, b + 1):
                s, e = block_span(i, size, block)
                if block_digest(os.pread(f.fileno(), e - s, s)) != digests[DIGEST * i:DIGEST * (i + 1)]:
                    return False
        return True

class _Scratch:
    """A gather's scratch in one process: its dir (made at first use, flocked), the blocks it
    holds, the bytes it reserved in the ledger and the pins of the batch's shards; `drop()`
    empties it (the object's finalizer too, so it holds nothing a gather has left)."""

    def __init__(self, cache):
        self.cache, self.pid = cache, os.getpid()
        self.dir, self.lock, self.reserved = None, None, 0
        self.have: dict[str, np.ndarray] = {}
        self.pins: dict = {}

    def where(self) -> Path:
        if self.dir is None:
            base = self.cache.root / SCRATCH
            base.mkdir(exist_ok=True)
            name = f"{os.getpid()}-{secrets.token_hex(4)}"
            # flocked before it has the name `drop_dead` looks for: a lock it found free there
            # would be taken for a dead process's, and this scratch removed under its owner
            self.lock = open(base / f"{name}.lock.part", "ab")
            flock(self.lock)
            os.rename(base / f"{name}.lock.part", base / f"{name}.lock")
            self.dir = base / name
            self.dir.mkdir()
        return self.dir

    def drop(self) -> None:
        """The batch's rows gone from the scratch, their bytes from the ledger and their shards
        unpinned (maps made of them stay readable: the files are unlinked, not emptied)."""
        if os.getpid() != self.pid:  # a forked child's copy: the parent's to drop
            return
        paths, self.have = list(self.have), {}
        freed, self.reserved = self.reserved, 0
        pins, self.pins = list(self.pins.values()), {}
        for path in paths:
            try:
                os.unlink(self.dir / path)
            except FileNotFoundError:
                pass
        if freed:
            with self.cache.accounting() as ledger:
                ledger.add(-freed)
        for pin in pins:
            pin.close()
