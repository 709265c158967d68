"""`MMapIterableDataset`: the iterable twin of MMapDataset, with Loader's orders and epochs.

Samples in the epoch's order for this rank (see `loaders.order.sampler`). DataLoader workers split
them in chunks of `chunk` samples, round-robin: with `chunk` equal to the DataLoader's
batch_size, the global order is the same for any number of workers. Through
`loaders.StatefulDataLoader` a chunk is a batch, epochs advance by themselves and the loader
resumes; with a plain DataLoader, call `set_epoch(epoch)` at the top of every epoch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from loaders.batched import EpochDataset
from loaders.views.dataset import MMapDataset
from loaders.order.sampler import Epochs, Order, Pass


class MMapIterableDataset(EpochDataset):
    def __init__(self, root: str | Path, *, shuffle: bool = True, seed: int = 0, order: Order | None = None,
                 chunk: int = 1, drop_last: bool = False, rank: int | None = None, world_size: int | None = None,
                 columns: list[str] | None = None, cache_dir: str | Path | None = None,
                 cache_limit: int | str | None = None):
        self.dataset = MMapDataset(root, columns=columns, cache_dir=cache_dir, cache_limit=cache_limit)
        self._epochs = Epochs(len(self.dataset), chunk, shuffle=shuffle, order=order, seed=seed,
                               drop_last=drop_last, rank=rank, world_size=world_size,
                               source=self.dataset.reader.content_id)

    def __len__(self) -> int:
        """Samples of this rank left in the current epoch."""
        return self._epochs.per_rank()

    def make(self, p: Pass, c: int, ahead: bool = False):
        """Chunk c of pass p, collated (StatefulDataLoader's batch; `ahead`: nothing fetched
        ahead, its samples are read one at a time)."""
        ids = self._epochs.batch_ids(p, c)
        return torch.utils.data.default_collate([self.dataset[i] for i in ids.tolist()])

    def __iter__(self):
        for p, c in self._worker_pass():
            for i in self._epochs.batch_ids(p, c).tolist():
                yield self.dataset[i]
