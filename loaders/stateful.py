"""`StatefulDataLoader`: a torch DataLoader over `ds.batched(...)` or an `MMapIterableDataset`
that advances epochs by itself and resumes exactly, with any number of workers.

Like torchdata's StatefulDataLoader: `state_dict()` / `load_state_dict(state)` on the loader.
The DataLoader's sampler runs in the main process and hands each worker a key, (pass, batch
number), from which the worker computes the batch's ids (`loaders.order.sampler`): workers never need
the epoch or the cursor of the object in the main process, so epochs advance, and a loaded
state takes effect, even with persistent workers. A batch counts as taken when the loop gets it,
not when a worker makes it or the DataLoader prefetches it.
"""

from __future__ import annotations

import torch

from packer.errors import ConfigError
from packer.remote import check_workers

from loaders.batched import BatchedDataset, EpochDataset
from loaders.order.sampler import Epochs, Pass
from loaders.resumable import Resumable


def _as_is(batch):
    return batch


class _Keyed(torch.utils.data.Dataset):
    """Map-style: key (pass, b) -> batch b of that pass."""

    def __init__(self, batches):
        self.batches = batches

    def __getitem__(self, key: tuple[Pass, int]):
        return self.batches.make(*key, ahead=True)


class _PassKeys(torch.utils.data.Sampler):
    """The keys of the epochs' next pass. Iterating does not start the pass: a DataLoader
    iterator iterates its sampler twice as it starts (once made, once reset)."""

    def __init__(self, epochs: Epochs):
        self.epochs = epochs
        self.current: Pass | None = None

    def __len__(self) -> int:
        return self.epochs.num_batches()

    def __iter__(self):
        p = self.current = self.epochs.upcoming()
        return ((p, b) for b in self.epochs.batches(p))


class StatefulDataLoader(torch.utils.data.DataLoader, Resumable):
    """`StatefulDataLoader(ds.batched(256, seed=0), num_workers=2, pin_memory=True)`, or as
    torchdata's is called, `StatefulDataLoader(ds, batch_size=256, shuffle=True, num_workers=2)`
    (ds an MMapDataset, TokenWindows, PackedDocuments or Mixture): the same, `ds.batched(256,
    shuffle=True)`; called so, it keeps the samples' order unless shuffle=True, as torchdata's and
    DataLoader do. Whole batches either way; the order a pure function of (seed, epoch), seed 0
    unless given, as for `Loader`.

    Iterating it again starts the next epoch (`set_epoch(e)` picks one; for the epoch it is in,
    it keeps a resumed cursor). `state_dict()` after any batch, loaded into a loader built the
    same way in a fresh process, with any worker count or world size, goes on with the next batch.
    """

    def __init__(self, dataset, batch_size: int | None = None, shuffle: bool | None = None, *,
                 seed: int | None = None, drop_last: bool | None = None, num_workers: int = 0,
                 pin_memory: bool = False, timeout: float = 0, worker_init_fn=None, multiprocessing_context=None,
                 prefetch_factor: int | None = None, persistent_workers: bool = False):
        order = {k: v for k, v in (("shuffle", shuffle), ("seed", seed), ("drop_last", drop_last)) if v is not None}
        if isinstance(dataset, EpochDataset):
            if batch_size is not None or order:
                raise ConfigError(f"StatefulDataLoader: {type(dataset).__name__} has its batch size and order "
                                  "already; give batch_size, shuffle, seed and drop_last to ds.batched(...) or "
                                  "pass the dataset itself")
        elif batch_size is None:
            raise ConfigError(f"StatefulDataLoader takes a dataset with its batch size, StatefulDataLoader(ds, "
                              f"batch_size=64), or ds.batched(64), or an MMapIterableDataset; not "
                              f"{type(dataset).__name__} alone")
        else:  # as torchdata's (and DataLoader's): in order unless shuffle=True
            dataset = BatchedDataset(dataset, batch_size, **{"shuffle": False, **order})
        self.batches = dataset
        check_workers(dataset.source, dataset.epochs, num_workers)  # each worker maps its own batch's shards
        self._keys = _PassKeys(dataset.epochs)
        super().__init__(_Keyed(dataset), batch_size=None, sampler=self._keys, num_workers=num_workers,
                         collate_fn=_as_is, pin_memory=pin_memory, timeout=timeout, worker_init_fn=worker_init_fn,
                         multiprocessing_context=multiprocessing_context, prefetch_factor=prefetch_factor,
                         persistent_workers=persistent_workers)

    @property
    def _epochs(self) -> Epochs:
        return self.batches.epochs

    def __iter__(self):
        batches = super().__iter__()  # iterates the sampler: the keys of the epochs' next pass
        p = self._epochs.start()  # that pass, started: a loaded cursor is used once
        return self._counted(p, batches)
