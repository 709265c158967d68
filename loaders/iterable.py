"""`MMapIterableDataset`: the iterable twin of MMapDataset, with Loader's order semantics.

Samples in the epoch's order for this rank (see `loaders.sampler`). DataLoader workers split
them in chunks of `chunk` samples, round-robin: with `chunk` equal to the DataLoader's
batch_size, the global order is the same for any number of workers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .dataset import MMapDataset
from .sampler import Order, epoch_order, rank_share, resolve_topology, worker_batches


class MMapIterableDataset(torch.utils.data.IterableDataset):
    def __init__(self, root: str | Path, *, shuffle: bool = True, seed: int = 0, order: Order | None = None,
                 chunk: int = 1, drop_last: bool = False, rank: int | None = None, world_size: int | None = None,
                 columns: list[str] | None = None):
        self.dataset = MMapDataset(root, columns=columns)
        self.order = order or ("random" if shuffle else "sequential")
        self.seed, self.chunk, self.drop_last, self.epoch = seed, chunk, drop_last, 0
        self.topology = resolve_topology(rank, world_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _share(self):
        ids = epoch_order(len(self.dataset), order=self.order, seed=self.seed, epoch=self.epoch)
        return rank_share(ids, 0, rank=self.topology.rank, world_size=self.topology.world_size,
                          batch_size=self.chunk, drop_last=self.drop_last)

    def __len__(self) -> int:
        return len(self._share())

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        share = self._share()
        for c in worker_batches(-(-len(share) // self.chunk), worker, workers):
            for i in share[c * self.chunk:(c + 1) * self.chunk].tolist():
                yield self.dataset[i]
