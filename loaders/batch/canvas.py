"""Ragged images (any ragged column of 2 or more axes: keep-aspect and 'keep' datasets) as one
canvas [B, Hmax, Wmax, C] of the batch's largest sides, each sample top-left and zeros around
it, with `{name}_size` [B, 2] (h, w): a copy per sample, native (`loaders.batch.native`) or
numpy, run in shares as the fixed-shape rows are (`loaders.batch.rows`).
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from packer.errors import ConfigError
from packer.dataset.reader import ColumnArrays

from loaders.batch import native
from loaders.batch.ragged import shapes_at, spans

CANVAS_BUFFER_BYTES = 512 << 20  # an image canvas buffer: B x the dataset's largest sides, at most this
CANVAS_RAM_SHARE = 4  # a batch's canvas may take at most 1/this of the machine's memory


def canvas_copy(name, arrays: list[ColumnArrays], regions, shard, rows, order, buffers, where: str):
    """A batch of a ragged column of 2 or more axes (images): (fill, {name: canvas [B, *largest
    of each axis], name_size: [B, 2] (first two axes)}), the canvas in the batch's buffer when it
    holds it, fill(a, b) copying the samples order[a:b] into their slots' top-left corners and
    zeroing the rest of those slots (a sample's padding is never stale: the batch is a pure
    function of its ids). Samples may be empty (a 0 x w image): all padding."""
    n = len(rows)
    first = next((a for a in arrays if a is not None), None)
    dtype = first.values.dtype if first is not None else np.dtype(np.uint8)
    shapes = shapes_at(arrays, shard, rows, first.shapes.shape[1] if first is not None else 3)
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
    if regions is not None and fixed_tail and n:
        starts = spans(arrays, shard, rows)[0]
        sizes = np.ascontiguousarray(shapes[order, :2])
        job = native.Job(dst, regions, shard[order], starts[order] * dtype.itemsize, order, sizes=sizes,
                         pixel_bytes=int(np.prod(top[2:])) * dtype.itemsize)
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


def images_canvas(name: str, images: list[np.ndarray]) -> dict[str, torch.Tensor]:
    """Images of their own sizes (an image-list column's, a conversation's or a packed row's) as
    {name: uint8 canvas [K, Hmax, Wmax, 3], each top-left and zeros around it, name_size: int64
    [K, 2] (h, w)}: the layout a batch of keep-aspect images has."""
    h = max((int(x.shape[0]) for x in images), default=0)
    w = max((int(x.shape[1]) for x in images), default=0)
    canvas = np.zeros((len(images), h, w, 3), dtype=np.uint8)  # filled by numpy: the maps stay read-only
    for k, x in enumerate(images):
        canvas[k, :x.shape[0], :x.shape[1]] = x
    sizes = torch.tensor([[x.shape[0], x.shape[1]] for x in images], dtype=torch.int64).reshape(len(images), 2)
    return {name: torch.from_numpy(canvas), f"{name}_size": sizes}
