"""The contract every batch source keeps (`BatchSource`), declared once: what a Loader or a
BatchedDataset may ask of a view's batch source (`ColumnGather`, `TokenWindows`,
`PackedDocuments`, `AudioClips`, `Mixture`), each thing a source does not offer given its
default here, so nothing asks a source what it has. `Batchable` is what a loader takes: a
dataset that gives a batch source (`MMapDataset`, of the columns asked for), or a source itself."""

from __future__ import annotations

import numpy as np


class Batchable:
    """What `Loader` and `ds.batched` take: `batch_source(columns)`, the source a loader reads."""

    def batch_source(self, columns: list[str] | None = None, *, device_decode: bool = False) -> BatchSource:
        raise NotImplementedError


class BatchSource(Batchable):
    """A batch source: its size, its identity (`source_id`: what a sample id means, part of the
    resume state), buffers (`alloc`) and a gather of ids into them (`gather`); and, with
    defaults, what only some sources offer."""

    source_id: str
    # a source that reads a URL through a node's cache: what this process holds of it
    # (`packer.remote.residency.Residency`), its shards fetched ahead of the order, released at close
    residency = None
    per_epoch = False  # a batch depends on the epoch: gather takes `epoch=` (AudioClips' crops)
    encoded = False  # holds the JPEG lane, which a device may decode (`batch_source(device_decode=True)`)

    def __len__(self) -> int:
        raise NotImplementedError

    def alloc(self, batch_size: int, memory) -> dict:
        raise NotImplementedError

    def gather(self, ids: np.ndarray, buffers: dict, pool=None, num_threads: int = 1) -> dict:
        raise NotImplementedError

    def batch_source(self, columns: list[str] | None = None, *, device_decode: bool = False) -> BatchSource:
        """Itself: columns= picks an MMapDataset's columns, and only a dataset's gather decodes."""
        from packer.errors import ConfigError

        if columns is not None:
            raise ConfigError("columns= applies to an MMapDataset only")
        return self

    @property
    def remote(self) -> bool:
        return self.residency is not None

    @property
    def column_gather(self):
        """The gather of dataset columns under this source (its ragged columns' lengths are what
        batches by length plan by), else None (token views)."""
        return None

    def order_stream(self):
        """What orders this source's epochs instead of a permutation (a Mixture's blend), else None."""
        return None

    def all_mapped(self) -> bool:
        """Every shard it reads is mapped here: nothing to fetch ahead."""
        return True

    def release(self) -> None:
        """Let go of what it holds of a node's cache (nothing, but for a remote dataset's gather)."""
