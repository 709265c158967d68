"""Fixed-shape columns' copy of a batch (images of one size: any column of at least
`loaders.batch.gather.BIG_SAMPLE_BYTES` a sample), sample by sample in (shard, row) order,
straight into the batch buffer: one native `Job` (`loaders.batch.native`, the GIL released
throughout), else a numpy copy per sample (each releases the GIL for its memcpy, and takes it
back). np.take (which buffers its output) and fancy index + scatter (two copies) were both
several times slower. `in_shares` runs any such copy(a, b) (a canvas's too) over a Python
thread pool, one contiguous share a thread.
"""

from __future__ import annotations

import numpy as np

from packer.dataset.reader import ColumnArrays

from loaders.batch import native
from loaders.batch.buffers import values_dtype


def rows_copy(dst: np.ndarray, arrays: list[ColumnArrays], regions, shard, rows, order):
    """copy(a, b): the samples order[a:b] of a fixed-shape column into their slots of dst: in
    one native call (its whole share, the GIL released; `regions`: each shard's values in memory,
    `native.regions`), else a numpy copy each."""
    if regions is not None and arrays and dst.dtype == values_dtype(arrays):  # not widened (token ids)
        nbytes = int(np.prod(dst.shape[1:])) * dst.itemsize
        return native.Job(dst, regions, shard[order], rows[order] * nbytes, order, nbytes=nbytes,
                          stream=dst.nbytes >= native.STREAM_FROM)
    values = [a.values if a is not None else None for a in arrays]
    shard, rows, order = shard.tolist(), rows.tolist(), order.tolist()

    def copy(a, b):
        for p in order[a:b]:
            dst[p] = values[shard[p]][rows[p]]
    return copy


def in_shares(copy, n: int, pool, num_threads: int) -> list:
    """Run copy(a, b) over [0, n) as one contiguous range per pool thread (returns their
    futures), or here without a pool."""
    if pool is None or num_threads <= 1:
        copy(0, n)
        return []
    bounds = [i * n // num_threads for i in range(num_threads + 1)]
    return [pool.submit(copy, a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
