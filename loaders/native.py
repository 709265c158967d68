"""The gather's copies in C (`loaders/_copy.c`, built at install time where a C compiler is
there), opened with ctypes: one call per gather thread and batch copies that thread's whole
share with the GIL released, instead of a numpy copy per sample that takes the GIL back after
each one. `LIB` is None where the library was not built (or MMPACK_NATIVE=0 is set): the
gather then copies sample by sample in numpy, to the same bytes.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.machinery
import os
from pathlib import Path

import numpy as np

STREAM_CACHE_SHARE = 2  # a batch column of at least 1/this of the largest cache is written with non-temporal stores


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
# A batch this large leaves the cache before anyone reads it (the ring holds 3 of them): writing
# it around the cache saves reading every line of the destination first. Smaller batches are
# written through the cache, where the training step finds them.
STREAM_FROM = largest_cache_bytes() // STREAM_CACHE_SHARE


def gather_rows(dst: np.ndarray, sources: np.ndarray, positions: np.ndarray, nbytes: int, stream: bool) -> None:
    """Copies `nbytes` from each address in `sources` (uint64) to dst's byte offset
    positions[i] * nbytes (dst C-contiguous, positions int64), GIL released."""
    LIB.mm_gather_rows(dst.ctypes.data, sources.ctypes.data, positions.ctypes.data, len(sources), nbytes, int(stream))


def gather_canvas(dst: np.ndarray, sources: np.ndarray, positions: np.ndarray, sizes: np.ndarray,
                  pixel_bytes: int) -> None:
    """Copies image i (sizes[i] = (h, w) pixels of `pixel_bytes`, contiguous at sources[i]) into
    the top-left of canvas slot positions[i] of dst [B, H, W, ...], zeroing the rest of the
    slot, GIL released (through the cache: see _copy.c)."""
    LIB.mm_gather_canvas(dst.ctypes.data, sources.ctypes.data, positions.ctypes.data, sizes.ctypes.data,
                         len(sources), dst.shape[1], dst.shape[2], pixel_bytes)
