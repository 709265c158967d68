"""Batch gather: a batch of sample ids -> one copy per column into reusable (pinned) buffers
(`loaders.batch.buffers`), over one dataset's shards or several datasets' as one (a `Mixture`).

Each column goes the way its samples are stored: fixed-shape columns of big samples (images)
are copied sample by sample in (shard, row) order, split across threads that write straight
into the batch buffer (`loaders.batch.rows`); ragged images as one canvas of the batch's largest
sides (`loaders.batch.canvas`), by the same per-thread copies. Those start first, on the
Loader's C pool (`loaders.batch.native`) or a thread pool; meanwhile this thread gathers the
small columns: labels vectorised per shard, strings as one take per shard, ragged 1-D columns
(tokens) padded, with their lengths (`loaders.batch.ragged`). A remote dataset's shards (or a
batch's rows of them) are mapped while its batches need them, as its residency says
(`packer.remote.residency`; fetched ahead by `loaders.lookahead`).
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from packer.errors import ConfigError
from packer.dataset.format import columns_text as fmt_columns
from packer.dataset.reader import ColumnArrays, DatasetReader
from packer.remote.residency import Residency

from loaders.batch import native
from loaders.batch.buffers import Memory, batch_dtype, empty
from loaders.batch.canvas import CANVAS_BUFFER_BYTES, canvas_copy
from loaders.batch.decode import Decoders, decode_copy, jpeg_bytes
from loaders.batch.ragged import (AUDIO_BUFFER_BYTES, RAGGED_BUFFER_BYTES, frames_of, gather_ragged, gather_strings,
                                  shapes_at)
from loaders.batch.rows import in_shares, rows_copy
from loaders.batch.source import BatchSource

BIG_SAMPLE_BYTES = 1024  # below this a column is gathered vectorised, not sample by sample


class ColumnGather(BatchSource):
    """Gathers the named columns of a dataset into batch buffers (see `alloc` / `gather`); of
    several datasets with the same columns (a `Mixture`'s), as if their shards were one
    dataset's, in the order given: sample ids of the second start after the first's."""

    def __init__(self, reader: DatasetReader | list[DatasetReader], names: list[str], padding_value: int = 0, *,
                 device_decode: bool = False):
        readers = list(reader) if isinstance(reader, (list, tuple)) else [reader]
        for r in readers:
            r.check_columns(names)
        self.reader, self.readers, self.padding_value = readers[0], readers, padding_value
        self.source_id = "+".join(r.content_id for r in readers)
        self.columns = [readers[0].manifest.column(n) for n in names]
        lists = [c.name for c in self.columns if c.image_list]
        if lists:  # K images of their own sizes a sample: no batch layout of the column's own
            raise ConfigError(f"{readers[0].root}: column {lists[0]} holds each conversation's images at their own "
                              "sizes; read the conversations with PackedDocuments(out, seq_len) (its batches carry "
                              "their images as a canvas), or pass columns= without it")
        for r in readers[1:]:
            theirs = [r.manifest.column(n) for n in names]
            if theirs != self.columns:
                raise ConfigError(f"{r.root}: columns {fmt_columns(theirs)} differ from {readers[0].root}'s "
                                  f"{fmt_columns(self.columns)}; mixed datasets must hold the same columns")
        counts = [n for r in readers for n in np.diff([0, *r.shard_ends])]
        ends = np.cumsum(np.asarray(counts, dtype=np.int64)) if counts else np.zeros(0, np.int64)
        self._shards = [(r, k) for r in readers for k in range(len(r.shard_ends))]
        # a remote dataset's shards are mapped while its residency holds them, the others None
        self.residency = Residency(readers, ends, names, self._remap) if any(r.cache is not None for r in readers) \
            else None
        self._ends = ends
        self._starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        self._by_column: dict[str, list[ColumnArrays | None]] = {}
        self._index_of: dict[str, list[ColumnArrays]] = {}
        self._longest_of: dict[str, int] = {}
        self._largest_of: dict[str, tuple[int, ...]] = {}
        self._regions_of: dict[str, np.ndarray | None] = {}
        self._decoders = Decoders()  # the JPEG lane's decode threads, made when first needed
        # the JPEG lane handed over as bytes, for a Loader's device to decode (`loaders.device_decode`)
        self.device_decode = device_decode

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def __getstate__(self) -> dict:
        """Without the maps and addresses found so far: pickled (to a DataLoader's spawned
        worker), the maps' bytes would go whole into the pickle, and their addresses mean
        nothing in another process. The reader pickles as its path; what the checks of a cache
        limit decided (`packer.remote.limits`) goes with it: a spawned worker that lost
        `rows_pass` fetched whole shards the limit could not hold."""
        held = self.residency
        return {"reader": self.readers, "names": [c.name for c in self.columns], "padding_value": self.padding_value,
                "rows_pass": held.rows_pass if held else False, "processes": held.processes if held else 1}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["reader"], state["names"], state.get("padding_value", 0))
        if self.residency is not None:
            self.residency.rows_pass, self.residency.processes = state.get("rows_pass", False), state.get("processes", 1)

    @property
    def column_gather(self) -> ColumnGather:
        return self

    @property
    def encoded(self) -> bool:
        return any(c.encoded for c in self.columns)

    def image_column(self) -> str:
        """The column whose samples have their own sizes (height, width, channels): what a batch
        grouped by shape groups by."""
        ragged = [c.name for c in self.columns if None in c.shape and len(c.shape) > 1 and frames_of(c) is None]
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
        return shapes_at(arrays, shard, rows, arrays[0].shapes.shape[1] if arrays else 0)

    def _arrays(self, name: str) -> list[ColumnArrays | None]:
        """Every shard's maps of one column, built once: not O(shards) work per batch (a
        remote dataset's: those of the shards mapped now, None for the others)."""
        arrays = self._by_column.get(name)
        if arrays is None:
            held = self.residency
            arrays = self._by_column[name] = [self._mapped(g, name) if held is None or held.holds(g) else None
                                              for g in range(len(self._shards))]
        return arrays

    def _mapped(self, g: int, name: str) -> ColumnArrays:
        r, k = self._shards[g]
        rowed = self.residency.scratch(g) if self.residency is not None else None
        if rowed is None:
            return r.column(k, name)
        scratch, paths = rowed
        return r.column_in(k, name, scratch if r.values_path(k, name) in paths else None)

    def _index(self, name: str) -> list[ColumnArrays]:
        """Every shard's offsets and shapes of a ragged column (a remote dataset's without its values)."""
        if self.residency is None:
            return self._arrays(name)
        if name not in self._index_of:
            self._index_of[name] = [r.index(k, name) for r, k in self._shards]
        return self._index_of[name]

    def _remap(self, g: int) -> None:
        """Shard g's maps made again, or dropped where the residency no longer holds it."""
        held = self.residency.holds(g)
        for name, arrays in self._by_column.items():
            arrays[g] = self._mapped(g, name) if held else None
            regions = self._regions_of.get(name)
            if regions is not None:
                regions[g] = native.region_of(arrays[g].values if held else None)

    def all_mapped(self) -> bool:
        """Every shard of a remote dataset is mapped here (in its cache, nothing to fetch)."""
        return self.residency is None or self.residency.all_mapped()

    def release(self) -> None:
        """Unmaps and unpins every shard of a remote dataset this gather holds."""
        if self.residency is not None:
            self.residency.release()

    def alloc(self, batch_size: int, memory: Memory) -> dict[str, torch.Tensor]:
        """Buffers for the fixed-shape columns; in a Loader's ring (long-lived), also for each
        column ragged along its first axis (tokens, audio) a flat buffer (a batch of width w is
        its first B x w elements: a contiguous [B, w] tensor) of B x its longest sample, at most
        RAGGED_BUFFER_BYTES (AUDIO_BUFFER_BYTES for audio; a wider batch gets a fresh plain
        one), and its `{name}_lengths`; for each ragged image
        column a flat canvas buffer of B x its largest height x largest width, at most
        CANVAS_BUFFER_BYTES, and its `{name}_size`."""
        out = {}
        for c in self.columns:
            if c.encoded and self.device_decode:  # bytes, taken fresh each batch
                continue
            if not c.ragged or (c.encoded and None not in c.shape):  # the JPEG lane's batch is the pixel lane's
                out[c.name] = empty((batch_size, *c.shape), batch_dtype(c.dtype), memory)
            elif len(c.shape) > 1 and frames_of(c) is None and memory in ("huge", "pinned"):
                dtype = np.dtype(c.dtype)
                most = max(1, CANVAS_BUFFER_BYTES // dtype.itemsize)
                out[c.name] = empty((min(batch_size * math.prod(self._largest(c.name)), most),), dtype, memory)
                out[f"{c.name}_size"] = empty((batch_size, 2), np.int64, memory)
            elif frames_of(c) is not None and memory in ("huge", "pinned"):
                dtype = batch_dtype(c.dtype)
                cap = AUDIO_BUFFER_BYTES if c.name == "audio" and self.reader.manifest.kind == "audio" else RAGGED_BUFFER_BYTES
                most = max(1, cap // dtype.itemsize)
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

    def _regions(self, name: str) -> np.ndarray | None:
        """Where each shard's values of a column lie in memory ([start, end) addresses, int64
        [shards, 2]; (0, 0) for a shard not mapped now), for the native copies, which check every
        sample against them; None without them, or when a shard's values are not one
        contiguous block."""
        if native.LIB is None:
            return None
        if name not in self._regions_of:
            arrays = [a for a in self._arrays(name) if a is not None]
            ok = all(a.values.flags.c_contiguous for a in arrays)  # a remote shard mapped later is a whole file too
            self._regions_of[name] = native.regions([a.values if a is not None else None
                                                     for a in self._arrays(name)]) if ok else None
        return self._regions_of[name]

    def gather(self, ids: np.ndarray, buffers: dict[str, torch.Tensor],
               pool: native.Pool | ThreadPoolExecutor | None = None, num_threads: int = 1) -> dict:
        try:
            return self._gather(ids, buffers, pool, num_threads)
        finally:
            if self.residency is not None:
                self.residency.cold = False  # a pass's first batch is gathered: the lookahead goes on

    def _gather(self, ids: np.ndarray, buffers: dict[str, torch.Tensor], pool, num_threads: int) -> dict:
        n = len(ids)
        shard = np.searchsorted(self._ends, ids, side="right")
        rows = ids - self._starts[shard]
        if self.residency is not None:
            self.residency.ensure(shard, rows)
        order = np.lexsort((rows, shard))  # the copies run in (shard, row) order: locality
        out: dict = {}
        copies, decodes, rest = [], [], []
        for col in self.columns:
            if not col.ragged and not col.encoding and (col.sample_nbytes or 0) >= BIG_SAMPLE_BYTES:
                out[col.name] = buffers[col.name][:n]
                copies.append(rows_copy(out[col.name].numpy(), self._arrays(col.name), self._regions(col.name),
                                    shard, rows, order))
            elif col.encoded and self.device_decode:  # its bytes, for the device to decode
                out[col.name] = jpeg_bytes(col, self._arrays(col.name), shard, rows)
            elif col.encoded:
                fill, batch = decode_copy(col, self._arrays(col.name), shard, rows, order, buffers,
                                          f"{self.reader.root}: column {col.name}")
                out.update(batch)
                decodes.append(fill)
            elif col.ragged and len(col.shape) > 1 and frames_of(col) is None:
                fill, batch = canvas_copy(col.name, self._arrays(col.name), self._regions(col.name), shard, rows,
                                      order, buffers, f"{self.reader.root}: column {col.name}")
                out.update(batch)
                copies.append(fill)
            else:
                rest.append(col)
        # the big copies start first, small columns meanwhile: a native job on the Loader's C
        # pool (the first; any others after it), else split over a thread pool
        on_pool = [c for c in copies if isinstance(c, native.Job)] if isinstance(pool, native.Pool) else []
        threads = pool if isinstance(pool, ThreadPoolExecutor) else None
        pending = [f for fill in decodes for f in in_shares(fill, n, self._decoders.pool(num_threads), num_threads)]
        pending += [f for copy in copies if copy not in on_pool for f in in_shares(copy, n, threads, num_threads)]
        with pool.running(on_pool[0], num_threads) if on_pool else contextlib.nullcontext():
            self._small(rest, shard, rows, buffers, n, out)
        for job in on_pool[1:]:
            with pool.running(job, num_threads):
                pass
        for f in pending:
            f.result()
        if self.residency is not None:
            self.residency.done()  # copied: a batch's rows hold room in the cache only while it is gathered
        out = {c.name: out.pop(c.name) for c in self.columns} | out  # columns in schema order
        for c in self.columns:
            if c.bfloat16:  # its bits were gathered as int16
                out[c.name] = out[c.name].view(torch.bfloat16)
        return out

    def _small(self, rest, shard, rows, buffers, n: int, out: dict) -> None:
        """The columns gathered in this thread: labels, strings, ragged 1-D."""
        for col in rest:
            arrays = self._arrays(col.name)
            if col.string:
                out[col.name] = gather_strings(arrays, shard, rows, col.encoding, f"{self.reader.root}: column {col.name}")
            elif col.ragged:
                pad = self.padding_value if col.name.endswith("tokens") else 0  # a mask, a clip: zeros after it
                out.update(gather_ragged(col.name, arrays, shard, rows, buffers, pad, col.shape[1:]))
            else:
                buf = buffers[col.name][:n]
                dst = buf.numpy()
                for k in np.unique(shard):
                    sel = shard == k
                    dst[sel] = arrays[k].values[rows[sel]]
                out[col.name] = buf
