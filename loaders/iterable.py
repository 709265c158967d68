"""`MMapIterableDataset`: the iterable twin of MMapDataset, with Loader's order semantics.

Samples in the epoch's order for this rank (see `loaders.sampler`). DataLoader workers split
them in chunks of `chunk` samples, round-robin: with `chunk` equal to the DataLoader's
batch_size, the global order is the same for any number of workers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .dataset import MMapDataset
from .sampler import EpochPlan, Order, worker_batches


class MMapIterableDataset(torch.utils.data.IterableDataset):
    def __init__(self, root: str | Path, *, shuffle: bool = True, seed: int = 0, order: Order | None = None,
                 chunk: int = 1, drop_last: bool = False, rank: int | None = None, world_size: int | None = None,
                 columns: list[str] | None = None, cache_dir: str | Path | None = None):
        self.dataset = MMapDataset(root, columns=columns, cache_dir=cache_dir)
        self._plan = EpochPlan(len(self.dataset), chunk, shuffle=shuffle, order=order, seed=seed,
                               drop_last=drop_last, rank=rank, world_size=world_size)

    def set_epoch(self, epoch: int) -> None:
        self._plan.epoch = epoch

    def __len__(self) -> int:
        return len(self._plan.share())

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        share, chunk = self._plan.share(), self._plan.batch_size
        for c in worker_batches(self._plan.num_batches(share), worker, workers):
            for i in share[c * chunk:(c + 1) * chunk].tolist():
                yield self.dataset[i]
