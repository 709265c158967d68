"""Batch gather: a batch of sample ids -> one copy per column into reusable (pinned) buffers.

Fixed-shape columns are copied sample by sample in (shard, row) order, split across threads
that write straight into the batch buffer: each thread's share in one call of the native copies
(`loaders.batch.native`, the GIL released throughout), else one numpy copy per sample (each releases
the GIL for its memcpy, and takes it back). np.take (which buffers its output) and fancy index
+ scatter (two copies) were both several times slower. Small columns (labels) are gathered
vectorised per shard, strings as one take per shard. Ragged 1-D columns (tokens) come back
padded, with their lengths, in buffers of the same kind; ragged images (keep-aspect and 'keep'
datasets) as one canvas [B, Hmax, Wmax, C] of the batch's largest sides, each sample top-left
and zeros around it, with `{name}_size` [B, 2] (h, w): the same per-thread copies.

Token ids (uint16 / uint32 columns) come out as int64, the dtype `nn.Embedding` and
`cross_entropy` take: torch's unsigned 16- and 32-bit types are barely supported by its
operators. The widening is part of the copy (`token_dtype`), here and in every token view.
"""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np
import torch

from packer.errors import ConfigError
from packer.dataset.format import columns_text as fmt_columns
from packer.dataset.reader import ColumnArrays, DatasetReader, decode_text

from loaders.batch import native
from loaders.internals import shared_storage

BIG_SAMPLE_BYTES = 1024  # below this a column is gathered vectorised, not sample by sample
RAGGED_BUFFER_BYTES = 16 << 20  # a ragged column's batch buffer: up to B x its longest sample, at most this
CANVAS_BUFFER_BYTES = 512 << 20  # an image canvas buffer: B x the dataset's largest sides, at most this
CANVAS_RAM_SHARE = 4  # a batch's canvas may take at most 1/this of the machine's memory
SHORT_PIECES = 256  # ragged samples up to this long on average are gathered vectorised, longer ones one by one


HUGE_PAGE = 2 << 20

# Where a batch buffer lives:
#   "huge"   a Loader's long-lived buffer without CUDA: huge pages, faulted in once
#   "pinned" a Loader's buffer when CUDA is there: torch's pinned host allocator (DMA-able)
#   "shared" a DataLoader worker's batch: shared memory, which DataLoader then passes to the
#            main process by file descriptor instead of copying it there (as default_collate does)
#   "plain"  anything else (a fresh buffer per batch, a single sample)
Memory = Literal["huge", "pinned", "shared", "plain"]


def batch_dtype(stored) -> np.dtype:
    """What a column's values become in a batch: unsigned 16- and 32-bit ids (tokens) int64,
    everything else as stored."""
    stored = np.dtype(stored)
    return np.dtype(np.int64) if stored.kind == "u" and stored.itemsize in (2, 4) else stored


def empty(shape, dtype, memory: Memory) -> torch.Tensor:
    """An uninitialised batch buffer of `shape` and numpy `dtype` in `memory`; a ConfigError
    saying what to change when the machine cannot give that much."""
    try:
        return _allocate(shape, dtype, memory)
    except (MemoryError, OSError, RuntimeError) as exc:
        if isinstance(exc, OSError) and exc.errno != errno.ENOMEM or (
                type(exc) is RuntimeError and "memory" not in str(exc).lower()):
            raise
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        raise ConfigError(f"a batch buffer of {nbytes / 2**20:,.1f} MiB ({memory} memory) cannot be allocated "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else 'out of memory'}); "
                          "use a smaller batch size or fewer num_buffers") from None


def _allocate(shape, dtype, memory: Memory) -> torch.Tensor:
    torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    if memory == "huge":
        return torch.from_numpy(huge_array(shape, dtype))
    if memory == "shared":
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        storage = shared_storage(nbytes)  # what default_collate uses in workers
        return torch.empty(0, dtype=torch_dtype).set_(storage).view(shape)
    return torch.empty(shape, dtype=torch_dtype, pin_memory=memory == "pinned")


def huge_array(shape, dtype) -> np.ndarray:
    """Zeroed, pre-faulted host memory advised onto transparent huge pages (THP "madvise" mode,
    the common default). A 38 MB image batch is 19 TLB entries instead of 9,400, so the
    gather into it misses the TLB far less. Plain memory where THP is absent."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(shape, dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP compiled out or disabled: still a good buffer
        pass
    out = np.frombuffer(region, dtype=dtype).reshape(shape)  # keeps `region` alive
    out.fill(0)  # fault it in now, not on the first batch
    return out


class ColumnGather:
    """Gathers the named columns of a dataset into batch buffers (see `alloc` / `gather`); of
    several datasets with the same columns (a `Mixture`'s), as if their shards were one
    dataset's, in the order given: sample ids of the second start after the first's."""

    def __init__(self, reader: DatasetReader | list[DatasetReader], names: list[str], padding_value: int = 0):
        readers = list(reader) if isinstance(reader, (list, tuple)) else [reader]
        for r in readers:
            r.check_columns(names)
        self.reader, self.readers, self.padding_value = readers[0], readers, padding_value
        self.source_id = "+".join(r.content_id for r in readers)
        self.columns = [readers[0].manifest.column(n) for n in names]
        for r in readers[1:]:
            theirs = [r.manifest.column(n) for n in names]
            if theirs != self.columns:
                raise ConfigError(f"{r.root}: columns {fmt_columns(theirs)} differ from {readers[0].root}'s "
                                  f"{fmt_columns(self.columns)}; mixed datasets must hold the same columns")
        counts = [n for r in readers for n in np.diff([0, *r.shard_ends])]
        ends = np.cumsum(np.asarray(counts, dtype=np.int64)) if counts else np.zeros(0, np.int64)
        self._shards = [(r, k) for r in readers for k in range(len(r.shard_ends))]
        # a remote dataset's shards are mapped while batches need them (`_resident`), the others None
        self.remote = any(r.cache is not None for r in readers)
        self._live: set[int] = set()
        self._pid = os.getpid()  # a forked child holds none of its parent's pins: it maps afresh
        self.lookahead = None  # a pass's `loaders.batch.fetch.Lookahead`, while one runs
        self._ends = ends
        self._starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self._by_column: dict[str, list[ColumnArrays | None]] = {}
        self._index_of: dict[str, list[ColumnArrays]] = {}
        self._longest_of: dict[str, int] = {}
        self._largest_of: dict[str, tuple[int, ...]] = {}
        self._addresses_of: dict[str, np.ndarray | None] = {}

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getstate__(self) -> dict:
        """Without the maps and addresses found so far: pickled (to a DataLoader's spawned
        worker), the maps' bytes would go whole into the pickle, and their addresses mean
        nothing in another process. The reader pickles as its path."""
        return {"reader": self.readers, "names": [c.name for c in self.columns], "padding_value": self.padding_value}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["reader"], state["names"], state.get("padding_value", 0))

    def image_column(self) -> str:
        """The column whose samples have their own sizes (height, width, channels): what a batch
        grouped by shape groups by."""
        ragged = [c.name for c in self.columns if c.ragged and len(c.shape) > 1]
        if not ragged:
            raise ConfigError(f"{self.reader.root}: no column of own-sized images to group batches by "
                              f"(columns {[c.name for c in self.columns]}); build with --keep-aspect or --image-size keep")
        return ragged[0]

    def shapes_of(self, name: str, ids: np.ndarray) -> np.ndarray:
        """[len(ids), ndim]: each sample's shape in a ragged column, from its shapes file."""
        ids = np.asarray(ids, dtype=np.int64)
        shard = np.searchsorted(self._ends, ids, side="right")
        rows = ids - self._starts[shard]
        arrays = self._index(name)
        out = np.empty((len(ids), arrays[0].shapes.shape[1] if arrays else 0), np.int64)
        for k in np.unique(shard).tolist():
            sel = shard == k
            out[sel] = arrays[k].shapes[rows[sel]]
        return out

    def _arrays(self, name: str) -> list[ColumnArrays | None]:
        """Every shard's maps of one column, built once: not O(shards) work per batch (a
        remote dataset's: those of the shards mapped now, None for the others)."""
        arrays = self._by_column.get(name)
        if arrays is None:
            arrays = self._by_column[name] = [r.column(k, name) if not self.remote or g in self._live else None
                                              for g, (r, k) in enumerate(self._shards)]
        return arrays

    def _index(self, name: str) -> list[ColumnArrays]:
        """Every shard's offsets and shapes of a ragged column (a remote dataset's without its values)."""
        if not self.remote:
            return self._arrays(name)
        if name not in self._index_of:
            self._index_of[name] = [r.index(k, name) for r, k in self._shards]
        return self._index_of[name]

    def shards_of(self, ids: np.ndarray) -> np.ndarray:
        """The shards (positions over every reader's) that a batch of ids reads, sorted."""
        return np.unique(np.searchsorted(self._ends, ids, side="right"))

    def shard_bytes(self, g: int) -> int:
        r, k = self._shards[g]
        return r.cache.sizes[k] if r.cache is not None else 0

    def cache_of(self, g: int):
        return self._shards[g][0].cache

    def _resident(self, needed: list[int]) -> None:
        """A remote dataset's shards of a batch mapped (fetched and pinned first); under a cache
        limit, those no longer needed (nor in the lookahead's window) unmapped and unpinned."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            for g in list(self._live):
                self._drop(g, pinned=False)
        if any(r.cache is not None and r.cache.limit is not None for r in self.readers):
            # under a limit only the batch's shards stay mapped (a mapped shard cannot be
            # evicted); those the lookahead still wants stay softly pinned, the others go
            window = self.lookahead.window() if self.lookahead is not None else frozenset()
            for g in self._live - set(needed):
                self._drop(g, soften=g in window)
            first = 0
            for r in self.readers:  # pins the lookahead took for shards that left its window
                if r.cache is not None:
                    for k in r.cache.pinned():
                        if first + k not in window and first + k not in self._live:
                            r.cache.release(k)
                first += len(r.shard_ends)
        for g in needed:
            if g in self._live:
                continue
            r, k = self._shards[g]
            r.cache.acquire(k)
            self._live.add(g)
            for name, arrays in self._by_column.items():
                arrays[g] = r.column(k, name)
                addresses = self._addresses_of.get(name)
                if addresses is not None:
                    addresses[g] = arrays[g].values.ctypes.data

    def all_mapped(self) -> bool:
        """Every shard of a remote dataset is mapped here (in its cache, nothing to fetch)."""
        return len(self._live) == len(self._shards) and self._pid == os.getpid()

    def _drop(self, g: int, soften: bool = False, pinned: bool = True) -> None:
        r, k = self._shards[g]
        self._live.discard(g)
        for name, arrays in self._by_column.items():
            arrays[g] = None
            addresses = self._addresses_of.get(name)
            if addresses is not None:
                addresses[g] = 0
        if pinned:
            r.release(k, soften)

    def release(self) -> None:
        """Unmaps and unpins every shard of a remote dataset this gather holds."""
        for g in list(self._live):
            self._drop(g)
        for r in self.readers:
            if r.cache is not None:
                r.cache.release_all()

    def alloc(self, batch_size: int, memory: Memory) -> dict[str, torch.Tensor]:
        """Buffers for the fixed-shape columns; in a Loader's ring (long-lived), also for each
        ragged 1-D column a flat buffer (a batch of width w is its first B x w elements: a
        contiguous [B, w] tensor) of B x its longest sample, at most RAGGED_BUFFER_BYTES (a
        wider batch gets a fresh plain one), and its `{name}_lengths`; for each ragged image
        column a flat canvas buffer of B x its largest height x largest width, at most
        CANVAS_BUFFER_BYTES, and its `{name}_size`."""
        out = {}
        for c in self.columns:
            if not c.ragged:
                out[c.name] = empty((batch_size, *c.shape), batch_dtype(c.dtype), memory)
            elif len(c.shape) > 1 and memory in ("huge", "pinned"):
                dtype = np.dtype(c.dtype)
                most = max(1, CANVAS_BUFFER_BYTES // dtype.itemsize)
                out[c.name] = empty((min(batch_size * math.prod(self._largest(c.name)), most),), dtype, memory)
                out[f"{c.name}_size"] = empty((batch_size, 2), np.int64, memory)
            elif len(c.shape) == 1 and memory in ("huge", "pinned"):
                dtype = batch_dtype(c.dtype)
                most = max(1, RAGGED_BUFFER_BYTES // dtype.itemsize)
                out[c.name] = empty((min(batch_size * self._longest(c.name), most),), dtype, memory)
                out[f"{c.name}_lengths"] = empty((batch_size,), np.int64, memory)
        return out

    def _longest(self, name: str) -> int:
        """The longest sample of a ragged column, from its offsets: once, not per ring buffer."""
        if name not in self._longest_of:
            self._longest_of[name] = max((int(np.diff(a.offsets).max(initial=0)) for a in self._index(name)), default=0)
        return self._longest_of[name]

    def _largest(self, name: str) -> tuple[int, ...]:
        """A ragged column's largest size along each axis (height, width, channels), from its
        shapes: once, not per ring buffer."""
        if name not in self._largest_of:
            tops = [a.shapes.max(axis=0) for a in self._index(name) if a.shapes is not None and len(a.shapes)]
            self._largest_of[name] = tuple(int(v) for v in np.max(tops, axis=0)) if tops else (0,)
        return self._largest_of[name]

    def _addresses(self, name: str) -> np.ndarray | None:
        """Where each shard's values of a column start in memory (uint64), for the native copies;
        None without them, or when a shard's values are not one contiguous block."""
        if native.LIB is None:
            return None
        if name not in self._addresses_of:
            arrays = [a for a in self._arrays(name) if a is not None]
            ok = all(a.values.flags.c_contiguous for a in arrays)  # a remote shard mapped later is a whole file too
            self._addresses_of[name] = np.array([a.values.ctypes.data if a is not None else 0
                                                 for a in self._arrays(name)], np.uint64) if ok else None
        return self._addresses_of[name]

    def gather(self, ids: np.ndarray, buffers: dict[str, torch.Tensor],
               pool: native.Pool | ThreadPoolExecutor | None = None, num_threads: int = 1) -> dict:
        n = len(ids)
        shard = np.searchsorted(self._ends, ids, side="right")
        if self.remote:
            self._resident(np.unique(shard).tolist())
        rows = ids - self._starts[shard]
        order = np.lexsort((rows, shard))  # the copies run in (shard, row) order: locality
        out: dict = {}
        copies, rest = [], []
        for col in self.columns:
            if not col.ragged and not col.encoding and (col.sample_nbytes or 0) >= BIG_SAMPLE_BYTES:
                out[col.name] = buffers[col.name][:n]
                copies.append(_rows(out[col.name].numpy(), self._arrays(col.name), self._addresses(col.name),
                                    shard, rows, order))
            elif col.ragged and len(col.shape) > 1:
                fill, batch = _canvas(col.name, self._arrays(col.name), self._addresses(col.name), shard, rows,
                                      order, buffers, f"{self.reader.root}: column {col.name}")
                out.update(batch)
                copies.append(fill)
            else:
                rest.append(col)
        # the big copies start first, small columns meanwhile: a native job on the Loader's C
        # pool (the first; any others after it), else split over a thread pool
        on_pool = [c for c in copies if isinstance(c, native.Job)] if isinstance(pool, native.Pool) else []
        threads = pool if isinstance(pool, ThreadPoolExecutor) else None
        pending = [f for copy in copies if copy not in on_pool for f in _split(copy, n, threads, num_threads)]
        with pool.running(on_pool[0], num_threads) if on_pool else contextlib.nullcontext():
            self._small(rest, shard, rows, buffers, n, out)
        for job in on_pool[1:]:
            with pool.running(job, num_threads):
                pass
        for f in pending:
            f.result()
        return {c.name: out.pop(c.name) for c in self.columns} | out  # columns in schema order

    def _small(self, rest, shard, rows, buffers, n: int, out: dict) -> None:
        """The columns gathered in this thread: labels, strings, ragged 1-D."""
        for col in rest:
            arrays = self._arrays(col.name)
            if col.encoding:
                out[col.name] = _gather_strings(arrays, shard, rows, col.encoding, f"{self.reader.root}: column {col.name}")
            elif col.ragged:
                out.update(_gather_ragged(col.name, arrays, shard, rows, buffers, self.padding_value))
            else:
                buf = buffers[col.name][:n]
                dst = buf.numpy()
                for k in np.unique(shard):
                    sel = shard == k
                    dst[sel] = arrays[k].values[rows[sel]]
                out[col.name] = buf


def _rows(dst: np.ndarray, arrays: list[ColumnArrays], addresses, shard, rows, order):
    """copy(a, b): the samples order[a:b] of a fixed-shape column into their slots of dst: in
    one native call (its whole share, the GIL released), else a numpy copy each."""
    if addresses is not None and arrays and dst.dtype == _values_dtype(arrays):  # not widened (token ids)
        nbytes = int(np.prod(dst.shape[1:])) * dst.itemsize
        sources = (addresses[shard] + rows.astype(np.uint64) * np.uint64(nbytes))[order]
        return native.Job(dst, sources, order, nbytes=nbytes, stream=dst.nbytes >= native.STREAM_FROM)
    values = [a.values if a is not None else None for a in arrays]
    shard, rows, order = shard.tolist(), rows.tolist(), order.tolist()

    def copy(a, b):
        for p in order[a:b]:
            dst[p] = values[shard[p]][rows[p]]
    return copy


def _split(copy, n: int, pool, num_threads: int) -> list:
    """Run copy(a, b) over [0, n) as one contiguous range per pool thread (returns their
    futures), or here without a pool."""
    if pool is None or num_threads <= 1:
        copy(0, n)
        return []
    bounds = [i * n // num_threads for i in range(num_threads + 1)]
    return [pool.submit(copy, a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _canvas(name, arrays: list[ColumnArrays], addresses, shard, rows, order, buffers, where: str):
    """A batch of a ragged column of 2 or more axes (images): (fill, {name: canvas [B, *largest
    of each axis], name_size: [B, 2] (first two axes)}), the canvas in the batch's buffer when it
    holds it, fill(a, b) copying the samples order[a:b] into their slots' top-left corners and
    zeroing the rest of those slots (a sample's padding is never stale: the batch is a pure
    function of its ids). Samples may be empty (a 0 x w image): all padding."""
    n = len(rows)
    first = next((a for a in arrays if a is not None), None)
    dtype = first.values.dtype if first is not None else np.dtype(np.uint8)
    shapes = np.zeros((n, first.shapes.shape[1] if first is not None else 3), np.int64)
    for k in np.unique(shard):
        sel = shard == k
        shapes[sel] = arrays[k].shapes[rows[sel]]
    top = shapes.max(axis=0, initial=0)
    need = n * math.prod(top.tolist())  # exact: the largest sides of different samples may not fit int64
    too_big = ConfigError(f"{where}: a batch of {n} samples of up to {top[0]} x {top[1]} needs a "
                          f"{need * dtype.itemsize / 1e9:,.1f} GB canvas; use a smaller batch, or a dataset built with "
                          "--keep-aspect (its --max-side caps the sides)")
    if need * dtype.itemsize > os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // CANVAS_RAM_SHARE:
        raise too_big
    flat, size = buffers.get(name), buffers.get(f"{name}_size")
    if flat is None or need > flat.numel() or size is None:  # no buffer, or larger than it was sized for
        try:
            flat = torch.from_numpy(np.empty(need, dtype))
        except MemoryError:
            raise too_big from None
        size = torch.empty(n, 2, dtype=torch.int64)
    canvas, size = flat[:need].view(n, *top.tolist()), size[:n]
    size.numpy()[:] = shapes[:, :2]
    dst = canvas.numpy()
    fixed_tail = bool((shapes[:, 2:] == top[2:]).all())  # images: every sample has the canvas' channels
    if addresses is not None and fixed_tail and n:
        starts = _spans(arrays, shard, rows)[0].astype(np.uint64)
        sources = (addresses[shard] + starts * np.uint64(dtype.itemsize))[order]
        sizes = np.ascontiguousarray(shapes[order, :2])
        job = native.Job(dst, sources, order, sizes=sizes, pixel_bytes=int(np.prod(top[2:])) * dtype.itemsize)
        return job, {name: canvas, f"{name}_size": size}
    sources = [(arrays[k], r) for k, r in zip(shard.tolist(), rows.tolist())]
    positions = order.tolist()

    def fill(a, b):
        for i in positions[a:b]:
            sample = sources[i][0].sample(sources[i][1])
            if fixed_tail:  # the padding right of and below the sample only
                h, w = shapes[i, 0], shapes[i, 1]
                dst[i, :h, :w] = sample
                dst[i, h:] = 0
                dst[i, :h, w:] = 0
            else:
                dst[i] = 0
                dst[i][tuple(slice(0, int(d)) for d in shapes[i])] = sample

    return fill, {name: canvas, f"{name}_size": size}


def _spans(arrays: list[ColumnArrays], shard, rows):
    """Where a ragged column's samples lie: each sample's start and length in its shard's flat
    values, and per shard touched (positions in the batch, that shard's values)."""
    starts = np.empty(len(rows), np.int64)
    ends = np.empty(len(rows), np.int64)
    pieces = []
    for k in np.unique(shard):
        sel = np.flatnonzero(shard == k)
        offsets = arrays[k].offsets
        starts[sel], ends[sel] = offsets[rows[sel]], offsets[rows[sel] + 1]
        pieces.append((sel, arrays[k].values))
    return starts, ends - starts, pieces


def _gather_strings(arrays: list[ColumnArrays], shard, rows, encoding: str, where: str) -> list[str]:
    """A string column: each shard's bytes for the batch in one vectorised take, decoded once
    (ASCII, the usual case for keys) and sliced, else decoded piece by piece: half
    the work of a bytes() + decode per sample, which matters because it runs on the producer
    thread while the pool copies images, and holds the GIL the whole time."""
    starts, lengths, pieces = _spans(arrays, shard, rows)
    at = np.cumsum(lengths) - lengths  # where each sample's bytes go in the batch's blob
    blob = np.empty(int(lengths.sum()), np.uint8)
    for sel, values in pieces:
        blob[_ranges(at[sel], lengths[sel])] = values[_ranges(starts[sel], lengths[sel])]
    bounds = np.concatenate([at, [len(blob)]]).tolist()
    raw = blob.tobytes()
    if encoding in ("utf-8", "ascii") and raw.isascii():
        text = raw.decode("ascii")
        return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return [decode_text(raw[a:b], encoding, where) for a, b in zip(bounds[:-1], bounds[1:])]


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))


def _gather_ragged(name, arrays, shard, rows, buffers, pad: int = 0) -> dict:
    """Ragged 1-D columns: padded [B, longest in the batch] (`pad` after each sample) plus
    `{name}_lengths`, in the batch's buffers when they hold it.
    Vectorised, because short documents would otherwise cost a Python-level copy each into a
    fresh array; for long ones the two ways are about even, most of the work being the padding."""
    starts, lengths, pieces = _spans(arrays, shard, rows)
    n, width = len(rows), int(lengths.max(initial=0))
    flat, lens = buffers.get(name), buffers.get(f"{name}_lengths")
    fresh = flat is None or n * width > flat.numel() or lens is None  # no buffer, or wider than it was sized for
    if fresh:  # zeroed by the OS, and only as far as it is touched
        flat = torch.from_numpy(np.zeros(n * width, batch_dtype(_values_dtype(arrays))))
        lens = torch.empty(n, dtype=torch.int64)
        fresh = pad == 0  # else it is filled below, as a reused buffer is
    padded, lens = flat[: n * width].view(n, width), lens[:n]
    dst = padded.numpy()
    lens.numpy()[:] = lengths
    if n and lengths.sum() <= SHORT_PIECES * n:  # short samples: one fancy-index copy per shard
        if not fresh:
            dst.fill(pad)
        out = dst.reshape(-1)
        for sel, values in pieces:
            out[_ranges(sel * width, lengths[sel])] = values[_ranges(starts[sel], lengths[sel])]
    else:  # long samples: a slice copy each, and its padding written
        for sel, values in pieces:
            for i, s, m in zip(sel.tolist(), starts[sel].tolist(), lengths[sel].tolist()):
                dst[i, :m] = values[s:s + m]
                if not fresh:
                    dst[i, m:] = pad
    return {name: padded, f"{name}_lengths": lens}


def _values_dtype(arrays: list[ColumnArrays | None]) -> np.dtype:
    """The dtype of a column's values, from a shard mapped now."""
    return next(a.values.dtype for a in arrays if a is not None)
