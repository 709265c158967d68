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
            lib.mm_gather_canvas.argtypes = [pointer, pointer, pointer, pointer, size, size, size, size]
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


class Job:
    """One column of one batch for the native copies: fixed-shape rows (`sizes` None) or
    canvas slots. Run on a Pool (`Pool.running`), or range by range as job(a, b), each call
    copying the samples order[a:b] with the GIL released. Holds the arrays whose addresses the
    C code reads."""

    def __init__(self, dst: np.ndarray, sources: np.ndarray, positions: np.ndarray, *, nbytes: int = 0,
                 stream: bool = False, sizes: np.ndarray | None = None, pixel_bytes: int = 0):
        self.dst, self.sources, self.positions, self.sizes = dst, sources, positions, sizes
        self.nbytes, self.stream, self.pixel_bytes = nbytes, stream, pixel_bytes

    def __call__(self, a: int, b: int) -> None:
        if self.sizes is None:
            LIB.mm_gather_rows(self.dst.ctypes.data, self.sources[a:].ctypes.data, self.positions[a:].ctypes.data,
                               b - a, self.nbytes, int(self.stream))
        else:
            LIB.mm_gather_canvas(self.dst.ctypes.data, self.sources[a:].ctypes.data, self.positions[a:].ctypes.data,
                                 self.sizes[a:].ctypes.data, b - a, self.dst.shape[1], self.dst.shape[2],
                                 self.pixel_bytes)

    def start(self, pool_handle, shares: int) -> None:
        """On a pool (`Pool.running`): mm_pool_finish, from this thread, completes it."""
        canvas = self.sizes is not None
        LIB.mm_pool_start(pool_handle, self.dst.ctypes.data, self.sources.ctypes.data, self.positions.ctypes.data,
                          self.sizes.ctypes.data if canvas else None, len(self.sources), self.nbytes,
                          self.dst.shape[1] if canvas else 0, self.dst.shape[2] if canvas else 0, self.pixel_bytes,
                          int(self.stream), shares)
