"""`Loader`: whole batches from a ring of reusable (pinned) buffers, filled ahead by a producer
thread; and `BatchedDataset`, the same batches for an existing `DataLoader`.

Order, rank share and resumption come from `loaders.sampler`; the gather from
`loaders.gather` (or `TokenWindows`). A yielded batch's tensors are views of a ring buffer and
stay valid until the next batch is taken (as in FFCV): `.clone()` to keep one longer.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch

from .gather import Memory
from .sampler import EpochPlan, Order, worker_batches


class BatchSource(Protocol):
    """What Loader needs of a dataset: its size, buffers, and a gather of ids into them."""

    def __len__(self) -> int: ...

    def alloc(self, batch_size: int, memory: Memory) -> dict[str, torch.Tensor]: ...

    def gather(self, ids: np.ndarray, buffers: dict, pool=None, num_threads: int = 1) -> dict: ...


def as_source(dataset, columns: list[str] | None = None) -> BatchSource:
    from .dataset import MMapDataset

    if isinstance(dataset, (str, os.PathLike)):
        dataset = MMapDataset(dataset)
    if isinstance(dataset, MMapDataset):
        return dataset.batch_source(columns)
    if columns is not None:
        raise ValueError("columns= applies to an MMapDataset only")
    return dataset


class Loader:
    """Batches of a packed dataset (or TokenWindows) at memory bandwidth.

    Args:
        dataset: an MMapDataset, a dataset dir, or a TokenWindows view.
        batch_size: samples per batch on this rank.
        shuffle: False means order="sequential" unless `order` is given.
        seed: with the epoch (`set_epoch`), fixes the order.
        drop_last: drop the last partial global batch (else pad by repeating, as
            DistributedSampler does, so every rank gets the same number of batches).
        num_threads: gather threads (default: min(4, cores)).
        pin_memory: None = pinned when CUDA is available.
        device: hand batches over already on this device (see `loaders.to_device`).
        order: "random", "sequential" or "block" (near-sequential, for data larger than RAM).
        rank, world_size: default from torch.distributed, else RANK / WORLD_SIZE.
        columns: the columns to gather (default all).
        num_buffers: ring size, >= 2: the batch the caller holds plus those filled ahead.
    """

    def __init__(self, dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 num_threads: int | None = None, pin_memory: bool | None = None, device=None,
                 order: Order | None = None, rank: int | None = None, world_size: int | None = None,
                 columns: list[str] | None = None, num_buffers: int = 2):
        self.source = as_source(dataset, columns)
        self._plan = EpochPlan(len(self.source), batch_size, shuffle=shuffle, order=order, seed=seed,
                               drop_last=drop_last, rank=rank, world_size=world_size)
        self.num_threads = num_threads or min(4, os.cpu_count() or 1)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.device = device
        if num_buffers < 2:
            raise ValueError("num_buffers must be >= 2")
        self.num_buffers = num_buffers
        self._ring: list[dict] | None = None
        self._pool = ThreadPoolExecutor(self.num_threads) if self.num_threads > 1 else None

    @property
    def batch_size(self) -> int:
        return self._plan.batch_size

    @property
    def rank(self) -> int:
        return self._plan.rank

    @property
    def world_size(self) -> int:
        return self._plan.world_size

    def set_epoch(self, epoch: int) -> None:
        self._plan.epoch, self._plan.cursor = epoch, 0

    def state_dict(self) -> dict:
        """A few integers: enough to resume exactly, whatever the worker or thread count."""
        return self._plan.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._plan.load_state_dict(state)

    def __len__(self) -> int:
        return self._plan.num_batches(self._plan.share())

    def __iter__(self):
        if self.device is not None:
            from .cuda import to_device

            return to_device(self._iter_host(), self.device)
        return self._iter_host()

    def _iter_host(self):
        plan = self._plan
        share = plan.share()
        num_batches = plan.num_batches(share)
        if self._ring is None:
            memory = "pinned" if self.pin_memory else "ring"
            self._ring = [self.source.alloc(plan.batch_size, memory) for _ in range(self.num_buffers)]
        ready: queue.SimpleQueue = queue.SimpleQueue()
        free = threading.Semaphore(self.num_buffers)  # ring buffers the producer may fill now
        stop = threading.Event()

        def produce():
            try:
                for b in range(num_batches):
                    while not free.acquire(timeout=0.1):  # a buffer comes free when the caller takes the next batch
                        if stop.is_set():
                            return
                    if stop.is_set():
                        return
                    ids = share[b * plan.batch_size:(b + 1) * plan.batch_size]
                    ready.put(self.source.gather(ids, self._ring[b % self.num_buffers], self._pool, self.num_threads))
                ready.put(None)
            except BaseException as exc:  # re-raised in the consumer
                ready.put(exc)

        producer = threading.Thread(target=produce, daemon=True, name="mmpack-loader")
        producer.start()
        try:
            while True:
                item = ready.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                plan.advance(1)
                yield item
                free.release()  # the caller asks for the next batch: the one it held may be refilled
            plan.cursor = 0  # the epoch is done; set_epoch() picks the next order
        finally:
            stop.set()
            producer.join()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


class BatchedDataset(torch.utils.data.IterableDataset):
    """Whole batches for an existing DataLoader: `DataLoader(ds.batched(256), batch_size=None,
    num_workers=k, pin_memory=True)`. Worker w makes batches w, w+k, ...; DataLoader takes them
    round-robin, so the global order is the same for any k. No per-sample collate."""

    def __init__(self, dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 order: Order | None = None, rank: int | None = None, world_size: int | None = None,
                 columns: list[str] | None = None):
        self.source = as_source(dataset, columns)
        self._plan = EpochPlan(len(self.source), batch_size, shuffle=shuffle, order=order, seed=seed,
                               drop_last=drop_last, rank=rank, world_size=world_size)

    def set_epoch(self, epoch: int) -> None:
        self._plan.epoch, self._plan.cursor = epoch, 0

    def state_dict(self, batches_seen: int) -> dict:
        """The state after the training loop took `batches_seen` batches from the DataLoader in
        this epoch (since the last set_epoch / load_state_dict): DataLoader hands batches over in
        the global order, so that count is all it takes. Load it into a fresh BatchedDataset
        before building its DataLoader to resume exactly, with any number of workers."""
        p = self._plan
        state = p.state_dict()
        state["cursor"] = min(p.cursor + batches_seen * p.batch_size * p.world_size, p.num_samples)
        return state

    def load_state_dict(self, state: dict) -> None:
        self._plan.load_state_dict(state)

    def __len__(self) -> int:
        return self._plan.num_batches(self._plan.share())

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        share = self._plan.share()
        bs = self._plan.batch_size
        # a fresh buffer per batch; in a worker it is shared memory from the start, so DataLoader
        # hands it to the main process without a copy
        memory = "shared" if info else "plain"
        for b in worker_batches(self._plan.num_batches(share), worker, workers):
            ids = share[b * bs:(b + 1) * bs]
            yield self.source.gather(ids, self.source.alloc(len(ids), memory))
