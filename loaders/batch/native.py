"""The gather's copies in C (`loaders/batch/_copy.c`, built at install time where a C compiler is
there), opened with ctypes. A Loader's `Pool` of C threads copies a whole column of a batch
per call, its threads never running Python; without a pool, one call copies a range of samples.
Either way the GIL is released for the whole copy, instead of a numpy copy per sample that
takes it back after each one. `LIB` is None where the library was not built (or
MMPACK_NATIVE=0 is set): the gather then copies sample by sample in numpy, to the same bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.machinery
import math
import os
import threading
import weakref
from pathlib import Path

import numpy as np

STREAM_CACHE_SHARE = 4  # a batch column of at least 1/this of the largest cache is written with non-temporal stores


def _load():
    if os.environ.get("MMPACK_NATIVE", "1") == "0":
        return None
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_copy{suffix}"
        if path.is_file():
            try:
                lib = ctypes.CDLL(str(path))
            except OSError:  # built for another machine or libc: the numpy copies serve
                return None
            pointer, size = ctypes.c_void_p, ctypes.c_size_t
            lib.mm_gather_rows.argtypes = [pointer, pointer, pointer, size, size, ctypes.c_int]
            lib.mm_gather_rows.restype = None
            lib.mm_gather_canvas.argtypes = [pointer, pointer, pointer, pointer, size, size, size, size, ctypes.c_int]
            lib.mm_gather_canvas.restype = None
            lib.mm_pool_new.argtypes = [ctypes.c_int]
            lib.mm_pool_new.restype = pointer
            lib.mm_pool_free.argtypes = [pointer]
            lib.mm_pool_free.restype = None
            lib.mm_pool_start.argtypes = [pointer] * 5 + [size] * 5 + [ctypes.c_int, size]
            lib.mm_pool_start.restype = None
            lib.mm_pool_finish.argtypes = [pointer]
            lib.mm_pool_finish.restype = None
            return lib
    return None


def largest_cache_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache Linux reports (the last level, shared by the cores), else `default`."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale != 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=default)


LIB = _load()
# A batch this large leaves the cache before anyone reads it (the ring holds 3 of them, and the
# gather reads as much): writing it around the cache saves reading every line of the
# destination first. Smaller batches are written through the cache, where the training step
# finds them (bench results, "c-copies", hold what each way gave).
STREAM_FROM = largest_cache_bytes() // STREAM_CACHE_SHARE


class Pool:
    """`threads` copiers in C for one Loader (`_copy.c`): the calling thread and threads - 1
    helpers that never run Python. Freed by `shutdown()` (which waits for a job running on it)
    or once dropped."""

    def __init__(self, threads: int):
        self.threads, self.pid = threads, os.getpid()
        self.handle = LIB.mm_pool_new(threads)
        if not self.handle:
            raise MemoryError("no memory for the gather's copy threads")
        self._free = weakref.finalize(self, LIB.mm_pool_free, self.handle)
        # not at exit: a daemon producer may still be copying on it then; the process's end frees it
        self._free.atexit = False
        self._lock = threading.Lock()  # one job at a time; shutdown waits for it

    @contextlib.contextmanager
    def running(self, job: Job, shares: int):
        """`job` copied on the pool in `shares` while the block runs (it ends when both are
        done), or, where the pool cannot serve (shut down, or in a forked child, which has
        none of its threads), copied here first."""
        if self.pid != os.getpid():  # before the lock: a fork during a job copied it held
            job(0, len(job.sources))
            yield
            return
        with self._lock:
            if self.handle is None:
                job(0, len(job.sources))
                yield
                return
            job.start(self.handle, shares)
            try:
                yield
            finally:
                LIB.mm_pool_finish(self.handle)

    def shutdown(self, wait: bool = True) -> None:
        if self.pid != os.getpid():  # a forked child's copy: nothing of it is this process's to free
            self.handle = None
            return
        with self._lock:
            self._free()
            self.handle = None


def region_of(values: np.ndarray | None) -> tuple[int, int]:
    """The [start, end) addresses of a C-contiguous array's bytes; (0, 0) for None (a shard not
    mapped now: no sample may be read from it)."""
    if values is None:
        return 0, 0
    return values.ctypes.data, values.ctypes.data + values.nbytes


def regions(values: list) -> np.ndarray:
    """[len(values), 2] int64: each array's `region_of`, what a `Job` reads its samples from."""
    return np.array([region_of(v) for v in values], np.int64).reshape(-1, 2)


class Job:
    """One column of one batch for the native copies: fixed-shape rows (`sizes` None) or
    canvas slots. Sample i (in copy order) is read at byte `offsets[i]` of the source region
    `regions[shard[i]]` (its [start, end) addresses, `region_of`) and written to slot
    `positions[i]` of `dst`: a row of `nbytes`, or an image of `sizes[i]` = (h, w) pixels of
    `pixel_bytes` into the top-left of a canvas slot. Every range is checked against its region
    and `dst` when the job is made, numpy over the whole batch, so that a wrong job is a
    ValueError, never a read or a write outside a buffer (`_copy.c` copies what it is given).
    Run on a Pool (`Pool.running`), or range by range as job(a, b), each call copying the
    samples [a, b) of the copy order with the GIL released. Holds the arrays whose addresses
    the C code reads."""

    def __init__(self, dst: np.ndarray, regions: np.ndarray, shard: np.ndarray, offsets: np.ndarray,
                 positions: np.ndarray, *, nbytes: int = 0, stream: bool = False, sizes: np.ndarray | None = None,
                 pixel_bytes: int = 0):
        self.dst, self.nbytes, self.stream, self.pixel_bytes = dst, int(nbytes), stream, int(pixel_bytes)
        self.positions = _ints("positions", positions, 1)
        n = len(self.positions)
        self.sizes = None if sizes is None else _ints("sizes", sizes, 2, (n, 2))
        need = self._check_destination()
        self.sources = _sources(_ints("regions", regions, 2), _ints("shard", shard, 1, (n,)),
                                _ints("offsets", offsets, 1, (n,)), need, self._alignment(), self.positions)

    def _check_destination(self) -> np.ndarray | int:
        """Each sample's source bytes, once every sample's slot lies in `dst`, is written once,
        and holds the sample whole; else a ValueError."""
        dst, positions = self.dst, self.positions
        if not isinstance(dst, np.ndarray) or not dst.flags.c_contiguous or not dst.flags.writeable or dst.ndim < 1:
            raise ValueError("native copy: the destination must be a writeable C-contiguous numpy array")
        slots = len(dst)
        outside = (positions < 0) | (positions >= slots)
        if outside.any():
            i = int(np.flatnonzero(outside)[0])
            raise ValueError(f"native copy: sample {i} goes to slot {positions[i]}, outside the destination's {slots}")
        written = np.zeros(slots, np.bool_)
        written[positions] = True
        if np.count_nonzero(written) != len(positions):
            twice = int(np.flatnonzero(np.bincount(positions, minlength=slots) > 1)[0])
            raise ValueError(f"native copy: slot {twice} of the destination is written by two samples")
        if self.sizes is None:
            row = math.prod(dst.shape[1:]) * dst.itemsize
            if self.nbytes != row:
                raise ValueError(f"native copy: rows of {self.nbytes} bytes into a destination whose rows are "
                                 f"{row} bytes")
            return self.nbytes
        pixel = math.prod(dst.shape[3:]) * dst.itemsize
        if dst.ndim < 3 or self.pixel_bytes != pixel:
            raise ValueError(f"native copy: pixels of {self.pixel_bytes} bytes into a canvas of shape {dst.shape} "
                             f"and {dst.itemsize}-byte values")
        h, w = self.sizes[:, 0], self.sizes[:, 1]
        bad = (h < 0) | (w < 0) | (h > dst.shape[1]) | (w > dst.shape[2])
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"native copy: sample {i} is {h[i]} x {w[i]} pixels, which a canvas slot of "
                             f"{dst.shape[1]} x {dst.shape[2]} does not hold")
        return h * w * pixel  # no overflow: each side at most the canvas', which is in memory

    def _alignment(self) -> int:
        """What every source offset is a multiple of: a row's bytes (a fixed-shape column's
        samples lie end to end), else a value's (a ragged sample starts at a value)."""
        return self.nbytes if self.sizes is None else self.dst.itemsize

    def __call__(self, a: int, b: int) -> None:
        if not 0 <= a <= b <= len(self.sources):
            raise ValueError(f"native copy: samples [{a}, {b}) of a job of {len(self.sources)}")
        if self.sizes is None:
            LIB.mm_gather_rows(self.dst.ctypes.data, self.sources[a:].ctypes.data, self.positions[a:].ctypes.data,
                               b - a, self.nbytes, int(self.stream))
        else:
            LIB.mm_gather_canvas(self.dst.ctypes.data, self.sources[a:].ctypes.data, self.positions[a:].ctypes.data,
                                 self.sizes[a:].ctypes.data, b - a, self.dst.shape[1], self.dst.shape[2],
                                 self.pixel_bytes, int(self.stream))

    def start(self, pool_handle, shares: int) -> None:
        """On a pool (`Pool.running`): mm_pool_finish, from this thread, completes it."""
        canvas = self.sizes is not None
        LIB.mm_pool_start(pool_handle, self.dst.ctypes.data, self.sources.ctypes.data, self.positions.ctypes.data,
                          self.sizes.ctypes.data if canvas else None, len(self.sources), self.nbytes,
                          self.dst.shape[1] if canvas else 0, self.dst.shape[2] if canvas else 0, self.pixel_bytes,
                          int(self.stream), max(1, int(shares)))


def _ints(name: str, values, ndim: int, shape: tuple | None = None) -> np.ndarray:
    """`values` as a C-contiguous int64 array (no copy when it is one), refused when it is not
    integers of `ndim` axes (and `shape`)."""
    values = np.asarray(values)
    integers = values.dtype.kind in "iu" or not values.size
    if not integers or values.ndim != ndim or shape is not None and values.shape != shape:
        raise ValueError(f"native copy: {name} must be integers of shape {shape or ndim * ('n',)}, "
                         f"not {values.dtype} {values.shape}")
    return np.ascontiguousarray(values, dtype=np.int64)


def _sources(regions: np.ndarray, shard: np.ndarray, offsets: np.ndarray, need, alignment: int,
             positions: np.ndarray) -> np.ndarray:
    """The samples' source addresses (uint64, what the C code reads), once each sample's `need`
    bytes from its offset lie inside its region, the offset a multiple of `alignment`; else a
    ValueError naming the first sample that does not."""
    if regions.shape[1:] != (2,):
        raise ValueError(f"native copy: regions must be [n, 2] (start, end) addresses, not {regions.shape}")
    unknown = (shard < 0) | (shard >= len(regions))
    if unknown.any():
        i = int(np.flatnonzero(unknown)[0])
        raise ValueError(f"native copy: sample {i} names source region {shard[i]}, of {len(regions)}")
    start, end = regions[shard, 0], regions[shard, 1]
    room = end - start - offsets  # bytes from the offset to the region's end (negative: past it)
    bad = (offsets < 0) | (need > room)
    if alignment > 1:
        bad |= offsets % alignment != 0
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        size = int(end[i] - start[i])
        n = int(need if np.ndim(need) == 0 else need[i])
        raise ValueError(f"native copy: sample {i} (to slot {positions[i]}) reads bytes [{offsets[i]}, "
                         f"{offsets[i] + n}) of source region {shard[i]} of {size} bytes"
                         + (f", not at a multiple of {alignment}" if offsets[i] % max(alignment, 1) else ""))
    return (start + offsets).astype(np.uint64)
