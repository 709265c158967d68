"""The JPEG lane's batches (an image column of encoding "jpeg", `packer.dataset.codec`): the
batch the pixel lane gives, [B, S, S, 3] for a fixed size, else the canvas and `{name}_size`
(`loaders.batch.canvas`), each sample decoded into its slot. Pillow decodes outside the GIL, so
the gather runs these fills over Python threads (`Decoders`), one contiguous share each, even
where its copies run on the Loader's C pool.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from packer.dataset import codec
from packer.dataset.reader import ColumnArrays

from loaders.batch.canvas import canvas_copy
from loaders.batch.ragged import shapes_at, take_bytes


def decode_copy(column, arrays: list[ColumnArrays], shard, rows, order, buffers, where: str):
    """(fill, batch) of an encoded column: fill(a, b) decodes the samples order[a:b] into the
    batch; a decode that fails is an IntegrityError naming the shard file and row."""
    n = len(rows)
    if any(d is None for d in column.shape):  # own sizes: the canvas, as the pixel lane's
        return canvas_copy(column.name, arrays, None, shard, rows, order, buffers, where)
    batch = buffers[column.name][:n]
    dst = batch.numpy()
    shard, rows, order = shard.tolist(), rows.tolist(), order.tolist()

    def fill(a, b):
        for p in order[a:b]:
            arrays[shard[p]].sample(rows[p], out=dst[p])
    return fill, {column.name: batch}


@dataclass
class JpegBatch:
    """A batch's JPEG samples as the gather hands them to a decode on the device
    (`loaders.device_decode`)."""

    name: str
    data: torch.Tensor  # uint8: the samples' bytes one after another
    offsets: list[int]  # B + 1: sample i is data[offsets[i]:offsets[i + 1]]
    shapes: np.ndarray  # [B, 3]: what each decodes to (h, w, 3)
    fixed: bool  # the column's sides are fixed: [B, S, S, 3], no canvas
    where: list[str]  # each sample's file and row, for an error

    def __len__(self) -> int:
        return len(self.offsets) - 1


def jpeg_bytes(column, arrays: list[ColumnArrays], shard, rows) -> JpegBatch:
    """A batch's JPEG bytes, one take per shard, in batch order; each sample's header checked
    against its stored shape here (`codec.check_header`), so that no forged size reaches the
    device's decoder."""
    blob, offsets = take_bytes(arrays, shard, rows)
    shapes = shapes_at(arrays, shard, rows, 3)
    where = [f"{arrays[k].jpeg}: row {r}" for k, r in zip(shard.tolist(), rows.tolist())]
    for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        codec.check_header(blob[a:b], shapes[i], where[i])
    return JpegBatch(column.name, torch.from_numpy(blob), offsets, shapes, None not in column.shape, where)


class Decoders:
    """The threads a gather decodes on: made at the first encoded batch and again in a forked
    child (where the parent's threads do not run); none for one thread."""

    def __init__(self):
        self._pool, self._pid, self._threads = None, None, 0

    def pool(self, threads: int) -> ThreadPoolExecutor | None:
        if threads <= 1:
            return None
        if self._pool is None or self._pid != os.getpid() or self._threads != threads:
            if self._pool is not None and self._pid == os.getpid():
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mmpack-decode")
            self._pid, self._threads = os.getpid(), threads
        return self._pool
