"""What a Loader or a BatchedDataset reads, and in which order: the glue of the data flow view ->
order -> gather. A view (`loaders.views`) gives a batch source, the one interface every view
gives (`MMapDataset.batch_source`, `TokenWindows`, `PackedDocuments`, `Mixture`): its size, its
identity, its buffers and a gather of sample ids into them (`loaders.batch`); `epochs_of` binds
it to its epochs (`loaders.order`). The batch and order layers import neither each other nor the
views: this module, above them, joins them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from packer.errors import ConfigError

from loaders.batch.buffers import Memory
from loaders.order.buckets import Bucketed, aspect_bucket
from loaders.order.sampler import Epochs


class BatchSource(Protocol):
    """What Loader needs of a dataset: its size, its identity, buffers, and a gather of ids."""

    source_id: str  # what a sample id means (dataset and view): part of the resume state

    def __len__(self) -> int: ...

    def alloc(self, batch_size: int, memory: Memory) -> dict[str, torch.Tensor]: ...

    def gather(self, ids: np.ndarray, buffers: dict, pool=None, num_threads: int = 1) -> dict: ...


def as_source(dataset, columns: list[str] | None = None) -> BatchSource:
    """The batch source of a view: an MMapDataset's (of `columns`), or the view itself."""
    if hasattr(dataset, "batch_source"):
        return dataset.batch_source(columns)
    if not all(hasattr(dataset, name) for name in ("alloc", "gather", "source_id", "__len__")):
        raise ConfigError(f"a Loader reads an MMapDataset, a dataset dir, TokenWindows or PackedDocuments, not "
                          f"{type(dataset).__name__}; for other datasets use torch.utils.data.DataLoader")
    if columns is not None:
        raise ConfigError("columns= applies to an MMapDataset only")
    return dataset


def gather(source: BatchSource, ids: np.ndarray, buffers: dict, pool=None, num_threads: int = 1, *, epoch: int):
    """Batch `ids` of `epoch`: a view whose samples change with the epoch (`per_epoch`:
    AudioClips' crops) is told it."""
    if getattr(source, "per_epoch", False):
        return source.gather(ids, buffers, pool, num_threads, epoch=epoch)
    return source.gather(ids, buffers, pool, num_threads)


def epochs_of(source: BatchSource, batch_size: int, *, bucket_by: str | None = None, **kwargs) -> Epochs:
    """The epochs over a batch source: its permutations, a mixture's stream (`order_for`), or
    with `bucket_by="aspect"` batches whose images share an aspect-ratio bucket."""
    stream = source if hasattr(source, "order_for") else None
    if bucket_by is not None:
        if bucket_by != "aspect":
            raise ConfigError(f"bucket_by must be 'aspect' or None, not {bucket_by!r}")
        if stream is not None or not hasattr(source, "shapes_of"):
            raise ConfigError("bucket_by='aspect' groups the images of one MMapDataset (not a Mixture or a view)")
        column = source.image_column()
        stream = Bucketed(AspectOf(source, column), batch_size, bucket_by=bucket_by, column=column)
    return Epochs(len(source), batch_size, source=source.source_id, stream=stream, **kwargs)


class AspectOf:
    """ids -> their aspect-ratio buckets, from a batch source's image shapes (a class, not a
    closure: it goes to spawned DataLoader workers with the epochs)."""

    def __init__(self, source, name: str):
        self.source, self.name = source, name

    def __call__(self, ids):
        return aspect_bucket(self.source.shapes_of(self.name, ids))
