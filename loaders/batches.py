"""`Loader`: whole batches gathered ahead by a producer thread into reusable (pinned) buffers;
and `BatchedDataset`, the same batches for a DataLoader (see `loaders.stateful` for the
DataLoader that resumes).

Order, rank share, cursor and resume state come from `loaders.sampler`; the gather from the
source (`loaders.gather`, `TokenWindows`, `PackedDocuments`). A batch's tensors are views of a
buffer of the ring (`loaders.ring`), which is refilled only once nothing the caller holds refers
to it: batches are safe to keep.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch

from .gather import Memory
from .ring import Ring
from .sampler import EpochPlan, Order, Pass, Resumable, worker_batches

# A first batch made faster than this keeps the pass in the caller's thread: a thread hands a
# batch over in about 0.1 ms (a queue put, a wake-up, a GIL switch), more than such a batch costs.
INLINE_BELOW_S = 100e-6


class BatchSource(Protocol):
    """What Loader needs of a dataset: its size, its identity, buffers, and a gather of ids."""

    source_id: str  # what a sample id means (dataset and view): part of the resume state

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


# A default thread count is doubled while that makes the gather at least this much faster.
THREAD_GAIN = 0.10


def default_threads() -> int:
    """The most gather threads a Loader tries by default: the cores this process may use."""
    from packer.system import available_cores

    return max(1, available_cores())


def copy_pool(threads: int):
    """The copiers of a Loader's gathers: a pool of C threads (`loaders.native`), or, where the
    native copies were not built, Python threads for numpy's; None for one thread."""
    from . import native

    if threads <= 1:
        return None
    return native.Pool(threads) if native.LIB is not None else ThreadPoolExecutor(threads)


def fewest_threads(seconds_with, most: int) -> tuple[int, float]:
    """(threads, seconds): the fewest threads, doubling from 1 up to `most`, past which doubling
    them again makes `seconds_with(threads)` less than THREAD_GAIN faster. Where the copies stop
    scaling depends on the machine (its memory bandwidth, its cores, the GIL's share of a
    sample's copy) and on the columns (a token batch does not use the threads at all), so it is
    measured; the threads not taken are CPU the training job keeps."""
    threads, best = 1, seconds_with(1)
    while threads < most:
        more = min(2 * threads, most)
        seconds = seconds_with(more)
        if seconds > best * (1 - THREAD_GAIN):
            break
        threads, best = more, seconds
    return threads, best


# The producers of iterations still open: stopped when the interpreter exits. Python lets daemon
# threads run on into its finalization and ends them when they next take the GIL, with a forced
# unwind that aborts the process ("terminate called without an active exception", exit 134) if
# it passes C++ code that released the GIL (numpy's unique and sorts do): a script that exits
# with a batch still being made ahead (a peek with next(iter(loader)), a break out of the loop
# with the iterator kept) crashed at exit about one time in three.
_PRODUCERS: set = set()


@atexit.register
def _stop_producers() -> None:
    for stop, wake, _ in list(_PRODUCERS):
        stop.set()
        wake()
    for _, _, thread in list(_PRODUCERS):
        thread.join(timeout=10)


class Loader(Resumable):
    """Batches of a packed dataset (or TokenWindows / PackedDocuments) at memory bandwidth.

    Iterating it again starts the next epoch; `state_dict()` / `load_state_dict()` resume
    exactly (see `loaders.sampler.EpochPlan`).

    Args:
        dataset: an MMapDataset, a dataset dir, or a TokenWindows / PackedDocuments view.
        batch_size: samples per batch on this rank.
        shuffle: False means order="sequential" unless `order` is given.
        seed: with the epoch, fixes the order.
        drop_last: drop the last partial global batch (else pad by repeating, as
            DistributedSampler does, so every rank gets the same number of batches).
        num_threads: gather threads (default: measured at the start of the first two passes,
            see `fewest_threads`: the fewest, up to the cores this process may use, past which
            more make it less than 10% faster, the larger of the two; `num_threads` then says
            how many).
        pin_memory: None = pinned when CUDA is available.
        device: hand batches over already on this device (see `loaders.to_device`).
        order: "random", "sequential" or "block" (near-sequential, for data larger than RAM).
        rank, world_size: default from torch.distributed, else RANK / WORLD_SIZE.
        columns: the columns to gather (default all).
        num_buffers: batch buffers in the ring, >= 2: the batch the caller holds and
            num_buffers - 1 gathered ahead (more are allocated only while the caller keeps
            batches; see `loaders.ring`).
    """

    def __init__(self, dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 num_threads: int | None = None, pin_memory: bool | None = None, device=None,
                 order: Order | None = None, rank: int | None = None, world_size: int | None = None,
                 columns: list[str] | None = None, num_buffers: int = 3):
        self.source = as_source(dataset, columns)
        self._plan = EpochPlan(len(self.source), batch_size, shuffle=shuffle, order=order, seed=seed,
                               drop_last=drop_last, rank=rank, world_size=world_size, source=self.source.source_id)
        self._measure_threads = num_threads is None  # chosen at the first batches of two passes (see _gathered)
        self._most_threads = self.num_threads = num_threads or default_threads()
        self._looks = 0  # passes whose first batch was timed
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.device = device
        if num_buffers < 2:
            raise ValueError("num_buffers must be >= 2")
        self.num_buffers = num_buffers
        self._ring: Ring | None = None
        self._inline: bool | None = None  # batches made in the caller's thread (see _gathered)
        self._pool = copy_pool(self.num_threads)

    @property
    def batch_size(self) -> int:
        return self._plan.batch_size

    @property
    def rank(self) -> int:
        return self._plan.rank

    @property
    def world_size(self) -> int:
        return self._plan.world_size

    def __len__(self) -> int:
        """Batches left in the current epoch."""
        return self._plan.num_batches()

    def __iter__(self):
        p = self._plan.start()
        batches = self._gathered(p)
        if self.device is not None:
            from .cuda import to_device

            batches = to_device(batches, self.device)
        return self._hand_over(p, batches)

    def _gathered(self, p: Pass):
        """The batches of pass `p`. The first is made here. The Loader's first pass then times
        gathers (buffers allocated, pages mapped; with each thread count it tries when
        `num_threads` was not given, see `_first_timings`): when one took less than
        INLINE_BELOW_S (token windows, small batches), every pass makes its batches here, on
        demand, since handing a batch over from a thread costs more than making it; otherwise a
        producer thread makes them up to num_buffers - 1 ahead. The batches are the same either
        way. A thread count the Loader chose itself is chosen again at the second pass, keeping
        the larger: one look is one moment of the machine, and another process busy then (a
        compile, a checkpoint write) makes more threads look useless."""
        plan = self._plan
        if self._ring is None:
            memory = "pinned" if self.pin_memory else "ring"
            self._ring = Ring(lambda: self.source.alloc(plan.batch_size, memory), self.num_buffers)
        ring = self._ring
        stop = threading.Event()
        waiting_for = [-1]  # the batch the consumer is blocked on, if any

        def make(b: int, needed):
            buffers = ring.take(needed, stop)
            if buffers is None:
                return None
            try:
                ids = plan.batch_ids(p, b)
                batch = self.source.gather(ids, buffers, self._pool, self.num_threads)
                if b == 0 and self._looks < (2 if self._measure_threads and not self._inline else 1):
                    seconds = self._first_timings(p, buffers)
                    if self._inline is None:
                        self._inline = seconds < INLINE_BELOW_S
                    self._looks += 1
                    batch = self.source.gather(ids, buffers, self._pool, self.num_threads)  # they wrote other batches there
                return batch
            finally:
                ring.filled(buffers)

        if p.num_batches == 0:
            return
        first = make(0, lambda: True)  # the caller waits for it
        if self._inline:
            yield first
            del first
            for b in range(1, p.num_batches):
                yield make(b, lambda: True)
            return
        ready: queue.SimpleQueue = queue.SimpleQueue()
        ahead = threading.Semaphore(self.num_buffers - 1)  # batches the producer may make before they are asked for

        def produce():
            try:
                for b in range(1, p.num_batches):
                    while not ahead.acquire(timeout=0.1):
                        if stop.is_set():
                            return
                    batch = make(b, lambda: waiting_for[0] == b)
                    if batch is None:
                        return
                    ready.put(batch)
                    del batch
                ready.put(None)
            except BaseException as exc:  # re-raised in the consumer
                ready.put(exc)

        producer = threading.Thread(target=produce, daemon=True, name="mmpack-loader")
        producer.start()
        running = (stop, ring.wake, producer)
        _PRODUCERS.add(running)
        try:
            yield first
            del first
            ahead.release()  # the caller asks for the next batch: one more may be made
            for b in range(1, p.num_batches + 1):  # the batches, then the end (or an error)
                try:
                    item = ready.get_nowait()
                except queue.Empty:
                    waiting_for[0] = b
                    ring.wake()
                    item = ready.get()
                    waiting_for[0] = -1
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
                del item
                ahead.release()
        finally:
            stop.set()
            ring.wake()
            producer.join()
            _PRODUCERS.discard(running)

    def _first_timings(self, p: Pass, buffers) -> float:
        """Seconds of a warm gather of one of the pass's batches into `buffers`, with the threads
        given; without them, with the thread count chosen here by timing such gathers
        (`fewest_threads`, the best of three for each count), which becomes `num_threads` and
        the pool's size. Each try takes another batch of the pass and gathers it twice, timing
        the second: a fresh process's first touches of the maps are page faults, serial work that
        hid the second thread's gain on the 2-core machine (one thread looked as fast as two,
        which are 20% faster once the pages are mapped, as they stay for the rest of training)."""
        full = max(1, p.num_batches - 1)  # batches of the whole batch size (the last may be short)
        batches = itertools.count(1)

        def seconds_with(threads: int, tries: int, pool) -> float:
            best = float("inf")
            for _ in range(tries):
                ids = self._plan.batch_ids(p, next(batches) % full)
                self.source.gather(ids, buffers, pool, threads)  # its pages mapped
                started = time.perf_counter()
                self.source.gather(ids, buffers, pool, threads)
                best = min(best, time.perf_counter() - started)
            return best

        if not self._measure_threads:
            return seconds_with(self.num_threads, 1, self._pool)
        most = self._most_threads
        pool = self._pool if self.num_threads == most else copy_pool(most)
        threads, seconds = fewest_threads(lambda n: seconds_with(n, 3, pool), most)
        if self._looks:  # the second look: only ever more threads
            threads = max(threads, self.num_threads)
        if threads != self.num_threads:
            # the old pool is not shut down: an earlier pass's iterator, if still open, may be
            # handing it work (it takes the new one from its next batch); its threads end once it
            # is dropped
            self.num_threads = threads
            self._pool = pool if threads == most else copy_pool(threads)
        return seconds

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


class EpochDataset(torch.utils.data.IterableDataset):
    """What the datasets a DataLoader iterates (`BatchedDataset`, `MMapIterableDataset`) share
    around their `_plan`: set_epoch, and the batches of a pass that each worker makes."""

    _plan: EpochPlan
    _epoch_given = False

    def set_epoch(self, epoch: int) -> None:
        self._plan.set_epoch(epoch)
        self._epoch_given = True

    def _worker_pass(self):
        """(pass, batch number) of this worker's share of the next pass: worker w makes batches
        w, w+k, ..., which DataLoader takes round-robin, so the order is the same for any k. At
        the pass's end the plan moves on (in-process, or in a persistent worker's copy)."""
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if info is not None and info.id == 0:
            warn_if_epochs_repeat(self._plan, self._epoch_given)
        p = self._plan.start()
        for b in worker_batches(p.num_batches, worker, workers):
            yield p, b
        self._plan.taken(p, p.num_batches)


class BatchedDataset(EpochDataset):
    """Whole batches for a DataLoader, no per-sample collate, in the same order for any number of
    workers.

    `loaders.StatefulDataLoader(ds.batched(256), num_workers=k)` advances epochs by itself and
    resumes (`state_dict`). A plain `DataLoader(ds.batched(256), batch_size=None, num_workers=k)`
    works too, but its worker processes cannot tell the dataset object you hold that an epoch
    went by: call `set_epoch(epoch)` at the top of every epoch, as with DistributedSampler.
    """

    def __init__(self, dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 order: Order | None = None, rank: int | None = None, world_size: int | None = None,
                 columns: list[str] | None = None):
        self.source = as_source(dataset, columns)
        self._plan = EpochPlan(len(self.source), batch_size, shuffle=shuffle, order=order, seed=seed,
                               drop_last=drop_last, rank=rank, world_size=world_size, source=self.source.source_id)

    def __len__(self) -> int:
        return self._plan.num_batches()

    def make(self, p: Pass, b: int):
        """Batch b of pass p in fresh memory: shared memory in a DataLoader worker, so DataLoader
        hands it to the main process by descriptor, without a copy (as default_collate does)."""
        memory = "shared" if torch.utils.data.get_worker_info() else "plain"
        ids = self._plan.batch_ids(p, b)
        return self.source.gather(ids, self.source.alloc(len(ids), memory))

    def __iter__(self):
        for p, b in self._worker_pass():
            yield self.make(p, b)


def warn_if_epochs_repeat(plan: EpochPlan, epoch_given: bool) -> None:
    """In a plain DataLoader's worker, a shuffled dataset that was never given an epoch may be
    repeating epoch 0's order (non-persistent workers start from the object in the main process,
    which no worker can advance)."""
    if not epoch_given and plan.epoch == 0 and plan.cursor == 0 and plan.order != "sequential":
        warnings.warn("epochs advance in DataLoader worker processes only through set_epoch(epoch) "
                      "(call it at the top of every epoch) or loaders.StatefulDataLoader; without either, "
                      "every epoch repeats epoch 0's order", stacklevel=3)
