"""Batch buffers: where they live (`Memory`: huge pages, pinned, shared or plain), how they are
allocated (`empty`, a ConfigError that says what to change when the machine cannot), and the
dtype a column's values have on disk (`values_dtype`) and in a batch (`batch_dtype`).

Token ids (uint16 / uint32 columns) come out as int64, the dtype `nn.Embedding` and
`cross_entropy` take: torch's unsigned 16- and 32-bit types are barely supported by its
operators. The widening is part of the copy (`batch_dtype`), in the gather and in every token view.
"""

from __future__ import annotations

import errno
import math
import mmap
from typing import Literal

import numpy as np
import torch

from packer.errors import ConfigError
from packer.dataset.reader import ColumnArrays

from loaders.internals import shared_storage

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


def values_dtype(arrays: list[ColumnArrays | None]) -> np.dtype:
    """The dtype of a column's values, from a shard mapped now."""
    return next(a.values.dtype for a in arrays if a is not None)
