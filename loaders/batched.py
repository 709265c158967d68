"""Whole batches for a torch DataLoader: `BatchedDataset` (`ds.batched(...)`), and what it shares
with `MMapIterableDataset`, the epochs and each worker's share of a pass (`EpochDataset`)."""

from __future__ import annotations

import os
import warnings

import torch

from packer.remote import check_workers

from loaders.batch.source import BatchSource
from loaders.lookahead import Lookahead
from loaders.source import as_source, bind, gather
from loaders.order.orders import WINDOW
from loaders.order.sampler import Epochs, Order, Pass


class EpochDataset(torch.utils.data.IterableDataset):
    """What the datasets a DataLoader iterates (`BatchedDataset`, `MMapIterableDataset`) share
    around their `_epochs`: set_epoch, and the batches of a pass that each worker makes."""

    _epochs: Epochs
    _epoch_given = False
    source: BatchSource | None = None  # what its batches are gathered from (MMapIterableDataset: its own reads)

    @property
    def epochs(self) -> Epochs:
        """The plan of its passes (`loaders.order.sampler.Epochs`): which ids each batch of each
        epoch holds, a pure function of integers."""
        return self._epochs

    def _fetch_ahead(self, source, p: Pass, b: int) -> None:
        """Over a URL (`source`: the gather of a remote dataset), the shards of this worker's
        coming batches of pass p fetched ahead, as a Loader's are (`loaders.lookahead.Lookahead`):
        its batches w, w+k, ... of the pass, then of the next (what its cache should keep); `b`:
        the batch it makes now."""
        if source is None or not source.remote:
            return
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        state = getattr(self, "_ahead", None)
        if state is None or state[0] != os.getpid() or state[1] != p:
            self._end_ahead()
            if source.all_mapped():
                return
            state = self._ahead = (os.getpid(), p, Lookahead(source.residency, *self._epochs.ahead_of(p, worker, workers)))
        state[2].at((b - worker) // workers)

    def _end_ahead(self) -> None:
        state = getattr(self, "_ahead", None)
        if state is not None and state[0] == os.getpid():
            state[2].close()
        self._ahead = None

    def set_epoch(self, epoch: int) -> None:
        self._epochs.set_epoch(epoch)
        self._epoch_given = True

    def _worker_pass(self, source=None):
        """(pass, batch number) of this worker's share of the next pass: worker w makes batches
        w, w+k, ..., which DataLoader takes round-robin, so the order is the same for any k. At
        the pass's end the epochs move on (in-process, or in a persistent worker's copy). Over a
        URL (`source`, the gather of a remote dataset), the shards of this worker's coming
        batches are fetched ahead, as a Loader's are (`loaders.lookahead.Lookahead`)."""
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if info is not None and info.id == 0:
            warn_if_epochs_repeat(self._epochs, self._epoch_given)
        if info is not None:  # a plain DataLoader never told the dataset its workers (StatefulDataLoader does)
            check_workers(source, self._epochs, info.num_workers)
        p = self._epochs.start()
        try:
            for b in self._epochs.batches(p, worker, workers):
                self._fetch_ahead(source, p, b)
                yield p, b
        finally:
            self._end_ahead()
        self._epochs.taken(p, self._epochs.count(p))


class BatchedDataset(EpochDataset):
    """Whole batches for a DataLoader, no per-sample collate, in the same order for any number of
    workers.

    `loaders.StatefulDataLoader(ds.batched(256), num_workers=k)` advances epochs by itself and
    resumes (`state_dict`). A plain `DataLoader(ds.batched(256), batch_size=None, num_workers=k)`
    works too, but its worker processes cannot tell the dataset object you hold that an epoch
    went by: call `set_epoch(epoch)` at the top of every epoch, as with DistributedSampler.
    `bucket_by`, `max_tokens`, `max_seconds` and `cost` plan batches by length, as `Loader`'s do.
    """

    def __init__(self, dataset, batch_size: int | None = None, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, order: Order | None = None, rank: int | None = None,
                 world_size: int | None = None, columns: list[str] | None = None, bucket_by: str | None = None,
                 max_tokens: int | None = None, max_seconds: float | None = None, cost: str = "linear",
                 block_window: int = WINDOW):
        self.source = as_source(dataset, columns)
        self._epochs = bind(self.source, batch_size, shuffle=shuffle, order=order, seed=seed, drop_last=drop_last,
                            rank=rank, world_size=world_size, bucket_by=bucket_by, max_tokens=max_tokens,
                            max_seconds=max_seconds, cost=cost, block_window=block_window)

    def __len__(self) -> int:
        return self._epochs.num_batches()

    def make(self, p: Pass, b: int, ahead: bool = False):
        """Batch b of pass p in fresh memory: shared memory in a DataLoader worker, so DataLoader
        hands it to the main process by descriptor, without a copy (as default_collate does).
        `ahead`: the shards of the worker's next batches fetched meanwhile (StatefulDataLoader's
        keyed batches, which come to a worker in the same round-robin)."""
        if ahead:
            self._fetch_ahead(self.source, p, b)
        memory = "shared" if torch.utils.data.get_worker_info() else "plain"
        ids = self._epochs.batch_ids(p, b)
        return gather(self.source, ids, self.source.alloc(len(ids), memory), epoch=p.epoch)

    def __iter__(self):
        for p, b in self._worker_pass(self.source):
            yield self.make(p, b)


def warn_if_epochs_repeat(epochs: Epochs, epoch_given: bool) -> None:
    """In a plain DataLoader's worker, a shuffled dataset that was never given an epoch may be
    repeating epoch 0's order (non-persistent workers start from the object in the main process,
    which no worker can advance)."""
    if not epoch_given and epochs.epoch == 0 and epochs.cursor == 0 and epochs.order != "sequential":
        warnings.warn("epochs advance in DataLoader worker processes only through set_epoch(epoch) "
                      "(call it at the top of every epoch) or loaders.StatefulDataLoader; without either, "
                      "every epoch repeats epoch 0's order", stacklevel=3)
