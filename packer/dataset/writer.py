"""Writes a shard's column files (pairs with `packer.dataset.reader`; publishing is `packer.dataset.outdir`'s).

A shard's columns are streamed to `.npy` files behind a fixed-length header that is rewritten
once the row count is known, so memory stays bounded by one sample. A shard is written into
`OUT/.staging/shard-k.partial/` and renamed whole into its generation, `OUT/<generation>/shard-k/`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from packer import errors
from packer.dataset import codec
from packer.dataset import format as fmt
from packer.system import linux_libc


def checksum_file(path: Path, algo: str = fmt.CHECKSUM) -> str:
    """The checksum of a whole column file by `algo` (this writer's, or any readable version's), hex."""
    digest = fmt.hasher(algo)
    if digest is None:
        raise errors.IntegrityError(f"{path}: checksum algorithm {algo!r} is not known to this mmpack; "
                                    "use the release that wrote it, or a newer one")
    return file_digest(path, digest).hexdigest()


def file_digest(path: str | Path, digest):
    """`digest` updated with the whole file at `path`, in blocks: `hashlib.file_digest`, which
    Python 3.10 lacks."""
    block = bytearray(1 << 20)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            digest.update(view[:n])
    return digest


# Seconds this process spent blocked writing shard files (their writes and fsyncs). Pool
# workers send theirs to the build with their progress (`shards.Ticker`), and the build's summary
# says from the total whether the disk set its pace.
_disk_wait = [0.0]


@contextlib.contextmanager
def on_disk(path: Path) -> Iterator[None]:
    """A write or an fsync of `path`: its OSError names the file (`naming`), its time is disk wait."""
    started = time.perf_counter()
    try:
        with naming(path):
            yield
    finally:
        _disk_wait[0] += time.perf_counter() - started


def take_disk_wait() -> float:
    """The disk wait noted in this process since the last take (`on_disk`, `add_disk_wait`)."""
    waited, _disk_wait[0] = _disk_wait[0], 0.0
    return waited


def add_disk_wait(seconds: float) -> None:
    """Another process's disk wait (a pool worker's), noted here."""
    _disk_wait[0] += seconds


@contextlib.contextmanager
def naming(path: Path) -> Iterator[None]:
    """An OSError inside carries `path` as its file name: ENOSPC from write(), flush() or
    fsync() names none, and the user needs to know where the disk filled up."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise


class _NpyStream:
    """An .npy file written row by row; the header is final only after close()."""

    def __init__(self, path: Path, dtype: str, sample_shape: tuple[int, ...]):
        self.path, self.dtype, self.sample_shape = path, np.dtype(dtype), sample_shape
        self.num_rows = 0
        with naming(path):
            self._file: BinaryIO = open(path, "wb")
            self._file.write(fmt.npy_header(self.dtype.str, (0, *sample_shape)))

    def write(self, array: np.ndarray, num_rows: int) -> None:
        data = np.ascontiguousarray(array, dtype=self.dtype).reshape(-1).data
        with on_disk(self.path):
            self._file.write(data)
        self.num_rows += num_rows

    def close(self) -> None:
        with on_disk(self.path):
            self._file.seek(0)
            self._file.write(fmt.npy_header(self.dtype.str, (self.num_rows, *self.sample_shape)))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def abort(self) -> None:
        """Close without keeping anything: a failing flush (the disk that is full) is not news."""
        with contextlib.suppress(OSError):
            self._file.close()


def _check_shape(col: fmt.Column, shape: tuple[int, ...]) -> None:
    """A sample's shape fits its column (None in the column's shape: any length there)."""
    if shape != col.shape and (len(shape) != len(col.shape) or any(
            want is not None and got != want for got, want in zip(shape, col.shape))):
        raise ValueError(f"column {col.name}: sample shape {shape}, expected {col.shape}")


class _ColumnWriter:
    """Values of one column, plus offsets (and shapes) when it is ragged."""

    def __init__(self, shard_dir: Path, column: fmt.Column):
        self.column = column
        names = fmt.column_file_names(column)
        self.paths = [shard_dir / n for n in names.values()]
        self.checksums: dict[Path, str] = {}  # none known before close: its files are read back
        if column.ragged:
            self.values = _NpyStream(shard_dir / names["values"], column.dtype, ())
            self.offsets = [0]
            self.shapes: list[tuple[int, ...]] | None = [] if "shapes" in names else None
        else:
            self.values = _NpyStream(shard_dir / names["values"], column.dtype, column.shape)

    def add(self, value: np.ndarray | codec.Encoded) -> None:
        """Append one sample (of the JPEG lane: its `codec.Encoded` bytes and decoded shape)."""
        if self.column.encoded:
            self.extend([value])
            return
        _check_shape(self.column, value.shape)
        if not self.column.ragged:
            self.values.write(value, 1)
            return
        self.values.write(value, value.size)
        self.offsets.append(self.offsets[-1] + value.size)
        if self.shapes is not None:
            self.shapes.append(value.shape)

    def extend(self, values: list[np.ndarray | codec.Encoded]) -> None:
        """Append samples: the bytes of add() for each, in one write."""
        shapes = [v.shape for v in values]
        if self.column.encoded:
            if not all(isinstance(v, codec.Encoded) for v in values):
                raise ValueError(f"column {self.column.name}: takes JPEG bytes (codec.Encoded), not pixels")
            values = [v.data for v in values]
        for shape in shapes:
            _check_shape(self.column, shape)
        if not values:
            return
        if not self.column.ragged:
            self.values.write(np.stack(values), len(values))
            return
        sizes = np.fromiter((v.size for v in values), dtype=np.int64, count=len(values))
        self.values.write(np.concatenate([v.reshape(-1) for v in values]), int(sizes.sum()))
        self.offsets.extend((self.offsets[-1] + np.cumsum(sizes)).tolist())
        if self.shapes is not None:
            self.shapes.extend(shapes)

    def close(self) -> None:
        self.values.close()
        if self.column.ragged:
            write_npy(self.paths[1], np.asarray(self.offsets, dtype=fmt.OFFSETS_DTYPE))
            if self.shapes is not None:
                shapes = np.asarray(self.shapes, dtype=fmt.SHAPES_DTYPE).reshape(-1, len(self.column.shape))
                write_npy(self.paths[2], shapes)

    def abort(self) -> None:
        self.values.abort()


def write_npy(path: Path, array: np.ndarray) -> None:
    """A whole array as one column file (fixed 128-byte header), fsynced."""
    with on_disk(path), open(path, "wb") as f:
        f.write(fmt.npy_header(array.dtype.str, array.shape))
        f.write(np.ascontiguousarray(array).reshape(-1).data)
        f.flush()
        os.fsync(f.fileno())


# -- slots: a fixed-shape column filled in any order, by several processes at once ----------
def _row_bytes(column: fmt.Column) -> int:
    return np.dtype(column.dtype).itemsize * math.prod(column.shape)


def create_slots(path: Path, column: fmt.Column, slots: int) -> None:
    """`path` with room for `slots` rows of the fixed-shape `column`, filled by SlotWriters
    (pwrite, any order, any process) and finished by `_SlotColumn` once every slot is written."""
    row = _row_bytes(column)
    with naming(path), open(path, "wb") as f:
        f.write(fmt.npy_header(column.dtype, (slots, *column.shape)))
        f.truncate(fmt.NPY_HEADER_BYTES + slots * row)


class SlotWriter:
    """One process's handle on a slots file: put(slot, row)."""

    def __init__(self, path: Path, column: fmt.Column):
        self.path, self.column, self.row = path, column, _row_bytes(column)
        with naming(path):
            self.fd = os.open(path, os.O_WRONLY)

    def put(self, slot: int, value: np.ndarray) -> bytes | None:
        """Write one row; returns its checksum block's digest when a row is a block of its own
        (hashed here, while the row is in this core's cache), else None."""
        _check_shape(self.column, value.shape)
        data = memoryview(np.ascontiguousarray(value, dtype=self.column.dtype)).cast("B")
        digest = fmt.block_digest(data) if fmt.rows_per_block(self.row) == 1 else None
        offset = fmt.NPY_HEADER_BYTES + slot * self.row
        with on_disk(self.path):
            while data:
                done = os.pwrite(self.fd, data, offset)
                data, offset = data[done:], offset + done
        return digest

    def start_writeback(self, first: int, count: int) -> None:
        """Have the kernel start writing slots [first, first + count) to disk now, without
        waiting, so that the shard's fsync later finds little left to write."""
        start_writeback(self.fd, fmt.NPY_HEADER_BYTES + first * self.row, count * self.row)

    def close(self) -> None:
        os.close(self.fd)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a range's dirty pages to disk, without waiting (Linux sync_file_range
    WRITE); elsewhere, and on any failure, nothing: the fsync that follows is what counts."""
    call = _sync_file_range()
    if call is not None:
        call(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE


@functools.cache
def _sync_file_range():
    call = linux_libc("sync_file_range")
    if call is not None:
        import ctypes

        call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return call


class _SlotColumn:
    """The ShardWriter side of a slots file: at close the rows of skipped records (`keep`
    False) are squeezed out and the header gets the row count, so the bytes are exactly those
    `_ColumnWriter` writes for the kept rows in order. With the digest of every kept row (from
    SlotWriter.put) the file's checksum needs no reading back."""

    def __init__(self, shard_dir: Path, column: fmt.Column, keep: list[bool], digests: dict[int, bytes]):
        self.column, self.keep, self.digests = column, keep, digests
        self.paths = [shard_dir / fmt.column_file_names(column)["values"]]
        self.checksums: dict[Path, str] = {}

    def add(self, value) -> None:
        pass

    def close(self) -> None:
        path, col, row = self.paths[0], self.column, _row_bytes(self.column)
        kept = [slot for slot, k in enumerate(self.keep) if k]
        with on_disk(path), open(path, "r+b") as f:
            for new, slot in enumerate(kept):
                if new != slot:  # only after a skip: move the row up
                    data = os.pread(f.fileno(), row, fmt.NPY_HEADER_BYTES + slot * row)
                    os.pwrite(f.fileno(), data, fmt.NPY_HEADER_BYTES + new * row)
            f.truncate(fmt.NPY_HEADER_BYTES + len(kept) * row)
            header = fmt.npy_header(col.dtype, (len(kept), *col.shape))
            f.write(header)
            f.flush()
            os.fsync(f.fileno())
        if fmt.rows_per_block(row) == 1 and all(slot in self.digests for slot in kept):
            self.checksums[path] = fmt.checksum_of_blocks([fmt.block_digest(header), *map(self.digests.get, kept)])

    def abort(self) -> None:
        pass


def partial_dir(staging: Path, index: int, *, fresh: bool = False) -> Path:
    """Where shard `index` is written until it is whole; `fresh`: emptied and made first."""
    path = staging / (fmt.shard_dir_name(index) + ".partial")
    if fresh:
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    return path


class ShardWriter:
    """Writes shard `index` into `staging`/shard-k.partial, then renames it whole to `final_dir`
    (the shard's dir in its generation, `rel_dir` relative to the dataset dir); use as a context
    manager.

    On an exception inside the `with` block the partial shard is deleted and nothing is renamed:
    a shard dir without the `.partial` suffix is always whole. `slots`: columns already written
    into slots files in the partial dir (create_slots), each with its keep-flag per slot; then
    the dir is kept and the other columns are added sample by sample as usual.
    """

    def __init__(self, staging: Path, index: int, columns: tuple[fmt.Column, ...], *, final_dir: Path | None = None,
                 rel_dir: str | None = None, slots: dict[str, list[bool]] | None = None,
                 digests: dict[str, dict[int, bytes]] | None = None):
        self.index = index
        self.final_dir = final_dir or staging / fmt.shard_dir_name(index)
        self.rel_dir = rel_dir or fmt.shard_dir_name(index)
        self.dir = partial_dir(staging, index, fresh=not slots)
        slots, digests = slots or {}, digests or {}
        self._columns = [_SlotColumn(self.dir, c, slots[c.name], digests.get(c.name, {})) if c.name in slots
                         else _ColumnWriter(self.dir, c) for c in columns]
        self.num_samples = 0

    def add(self, sample: dict[str, np.ndarray]) -> None:
        for writer in self._columns:
            writer.add(sample.get(writer.column.name))
        self.num_samples += 1

    def extend(self, samples: list[dict[str, np.ndarray]]) -> None:
        """Append samples, each column's values in one write: the bytes of an add() per sample."""
        for writer in self._columns:
            if not isinstance(writer, _SlotColumn):
                writer.extend([sample[writer.column.name] for sample in samples])
        self.num_samples += len(samples)

    def close(self) -> fmt.Shard:
        for writer in self._columns:
            writer.close()
        files = []
        for writer in self._columns:
            for path in writer.paths:
                checksum = writer.checksums.get(path) or checksum_file(path)
                files.append(fmt.FileEntry(f"{self.rel_dir}/{path.name}", path.stat().st_size, checksum))
        self.final_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.final_dir, ignore_errors=True)
        os.rename(self.dir, self.final_dir)
        return fmt.Shard(self.index, self.num_samples, tuple(files))

    def abort(self) -> None:
        for writer in self._columns:
            writer.abort()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
