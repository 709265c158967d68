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
import functools
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

from packer.errors import ConfigError

from .gather import Memory
from .ring import Ring
from .sampler import EpochPlan, Order, Pass, Resumable, check_int, worker_batches


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
    if not all(hasattr(dataset, name) for name in ("alloc", "gather", "source_id", "__len__")):
        raise ConfigError(f"a Loader reads an MMapDataset, a dataset dir, TokenWindows or PackedDocuments, not "
                          f"{type(dataset).__name__}; for other datasets use torch.utils.data.DataLoader")
    if columns is not None:
        raise ConfigError("columns= applies to an MMapDataset only")
    return dataset


# A batch of fewer bytes than this is made in the caller's thread, on demand: handing a batch
# over from a producer thread costs about 0.1 ms (a queue put, a wake-up, a GIL switch), more
# than gathering such a batch does (token windows, small batches). Larger ones are made ahead.
INLINE_BELOW_BYTES = 1 << 20
# Gather threads a Loader takes by default: past this many the copies are bound by the memory
# bus, not by cores (see docs/design.md), and the cores not taken are the training job's.
MAX_DEFAULT_THREADS = 8
# With num_threads="auto", a thread count is doubled while that makes the gather at least this much faster.
THREAD_GAIN = 0.10


def default_threads() -> int:
    """The gather threads of a Loader not told how many: the cores this process may use, shared
    by the ranks on the node (LOCAL_WORLD_SIZE, as torchrun sets it), at most MAX_DEFAULT_THREADS.
    A pure function of the machine: the first epoch runs as fast as the last."""
    from packer.system import available_cores

    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(1, min(MAX_DEFAULT_THREADS, available_cores() // local_ranks))


def copy_pool(threads: int):
    """The copiers of a Loader's gathers: a pool of C threads (`loaders.native`), or, where the
    native copies were not built, Python threads for numpy's; None for one thread."""
    from . import native

    if threads <= 1:
        return None
    return native.Pool(threads) if native.LIB is not None else ThreadPoolExecutor(threads)


def fewest_threads(seconds_with, most: int) -> tuple[int, float]:
    """(threads, seconds): the fewest threads, doubling from 1 up to `most`, past which doubling
    them again makes `seconds_with(threads)` less than THREAD_GAIN faster (num_threads="auto").
    The threads not taken are CPU the training job keeps."""
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
_STOPPED = object()  # what a producer stopped before the pass's end (close(), exit) hands over last


def _stop(producers) -> None:
    for stop, wake, _ in list(producers):
        stop.set()
        wake()
    for _, _, thread in list(producers):
        thread.join(timeout=10)


atexit.register(_stop, _PRODUCERS)


class Loader(Resumable):
    """Batches of a packed dataset (or TokenWindows / PackedDocuments) at memory bandwidth.

    Every iteration is a pass over an epoch from its beginning (the next epoch after a pass that
    ended, or was left early by a peek with `next(iter(loader))` or a `break`: a new order, as a
    shuffled DataLoader's next iterator; `set_epoch(e)` names it), except the first after
    `load_state_dict()`, which goes on exactly where the state was saved (see
    `loaders.sampler.EpochPlan`).

    Args:
        dataset: an MMapDataset, a dataset dir, or a TokenWindows / PackedDocuments view.
        batch_size: samples per batch on this rank.
        shuffle: False means order="sequential" unless `order` is given.
        seed: with the epoch, fixes the order (an int in [0, 2**64)).
        drop_last: drop the last partial global batch (else pad by repeating, as
            DistributedSampler does, so every rank gets the same number of batches).
        num_threads: gather threads; default `default_threads()`: the cores this process may
            use, divided among the node's ranks (LOCAL_WORLD_SIZE), at most 8. "auto": timed
            at the first pass (`fewest_threads`: the fewest past which doubling gains under 10%).
        pin_memory: None = pinned when CUDA is available.
        device: hand batches over already on this device (see `loaders.to_device`).
        order: "random", "sequential" or "block" (near-sequential, for data larger than RAM).
        rank, world_size: default from torch.distributed, else RANK / WORLD_SIZE.
        columns: the columns to gather (default all).
        num_buffers: batch buffers in the ring, >= 2: the batch the caller holds and
            num_buffers - 1 gathered ahead (more are allocated only while the caller keeps
            batches; see `loaders.ring`).

    `close()` (or leaving a `with Loader(...) as loader:` block) stops its open iterations and
    frees its buffers and threads at once; iterating it again makes new ones.
    """

    def __init__(self, dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 num_threads: int | str | None = None, pin_memory: bool | None = None, device=None,
                 order: Order | None = None, rank: int | None = None, world_size: int | None = None,
                 columns: list[str] | None = None, num_buffers: int = 3):
        self.source = as_source(dataset, columns)
        self._plan = EpochPlan(len(self.source), batch_size, shuffle=shuffle, order=order, seed=seed,
                               drop_last=drop_last, rank=rank, world_size=world_size, source=self.source.source_id)
        self._timed = num_threads == "auto"  # chosen by timing at the first pass (see _time_threads)
        if num_threads is None or self._timed:
            self.num_threads = default_threads()
        else:
            self.num_threads = check_int("num_threads", num_threads, 1, 1 << 12)
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.device = device
        self.num_buffers = check_int("num_buffers", num_buffers, 2, 1 << 12)
        self._ring: Ring | None = None
        self._pool = None
        self._pool_threads = 0  # the size of _pool (0: none made yet)
        self._running: set = set()  # this Loader's producers (see _PRODUCERS)

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
        """Batches of the next pass: the whole epoch, or its rest after `load_state_dict`."""
        return self._plan.num_batches()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self):
        p = self._plan.start()
        batches = self._gathered(p)
        if self.device is not None:
            from .cuda import to_device

            batches = to_device(batches, self.device)
        return self._hand_over(p, batches)

    def _pool_of(self, threads: int):
        """The copy pool of `threads` threads, made on first use (and again after close)."""
        if self._pool_threads != threads:
            # an old pool is not shut down: an earlier pass's iterator, if still open, may be
            # handing it work; its threads end once it is dropped
            self._pool, self._pool_threads = copy_pool(threads), threads
        return self._pool

    def _gathered(self, p: Pass):
        """The batches of pass `p`. A batch of fewer than INLINE_BELOW_BYTES is made here, on
        demand; larger ones by a producer thread, up to num_buffers - 1 ahead. The batches are
        the same either way."""
        plan, source = self._plan, self.source
        if self._ring is None:
            memory = "pinned" if self.pin_memory else "ring"
            # the ring holds the source's alloc, not this Loader: no cycle keeps a dropped
            # Loader's buffers (hundreds of MB of canvases) until the garbage collector runs
            self._ring = Ring(functools.partial(source.alloc, plan.batch_size, memory), self.num_buffers)
        ring = self._ring
        if self._timed:
            self._time_threads(p, ring)
        pool, threads = self._pool_of(self.num_threads), self.num_threads
        stop = threading.Event()
        waiting_for = [-1]  # the batch the consumer is blocked on, if any

        def make(b: int, needed):
            buffers = ring.take(needed, stop)
            if buffers is None:
                return None
            try:
                return source.gather(plan.batch_ids(p, b), buffers, pool, threads)
            finally:
                ring.filled(buffers)

        if p.num_batches == 0:
            return
        if ring.batch_bytes < INLINE_BELOW_BYTES:
            for b in range(p.num_batches):
                yield make(b, lambda: True)
            return
        ready: queue.SimpleQueue = queue.SimpleQueue()
        ahead = threading.Semaphore(self.num_buffers - 1)  # batches the producer may make before they are asked for
        first = make(0, lambda: True)  # the caller waits for it

        def produce():
            try:
                for b in range(1, p.num_batches):
                    while not ahead.acquire(timeout=0.1):
                        if stop.is_set():
                            ready.put(_STOPPED)
                            return
                    batch = make(b, lambda: waiting_for[0] == b)  # noqa: B023 - called within make, this b
                    if batch is None:
                        ready.put(_STOPPED)
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
        self._running.add(running)
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
                if item is _STOPPED:
                    raise ConfigError("this Loader was closed while the pass was open; iterate it again for a new pass")
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
            self._running.discard(running)

    def _time_threads(self, p: Pass, ring: Ring) -> None:
        """num_threads="auto": the thread count chosen by timing gathers of the pass's batches at
        1, 2, 4, ... threads (`fewest_threads`, the best of three for each count), once. Each try
        gathers a batch twice and times the second: a fresh process's first touches of the maps
        are page faults, serial work that would hide what more threads gain."""
        self._timed = False
        if p.num_batches == 0:
            return
        full = max(1, p.num_batches - 1)  # batches of the whole batch size (the last may be short)
        batches = itertools.count(1)
        pool = copy_pool(self.num_threads)
        stop = threading.Event()
        buffers = ring.take(lambda: True, stop)

        def seconds_with(threads: int) -> float:
            best = float("inf")
            for _ in range(3):
                ids = self._plan.batch_ids(p, next(batches) % full)
                self.source.gather(ids, buffers, pool, threads)  # its pages mapped
                started = time.perf_counter()
                self.source.gather(ids, buffers, pool, threads)
                best = min(best, time.perf_counter() - started)
            return best

        try:
            threads, _ = fewest_threads(seconds_with, self.num_threads)
        finally:
            ring.filled(buffers)
        if threads == self.num_threads:
            self._pool, self._pool_threads = pool, threads
        self.num_threads = threads

    def close(self) -> None:
        """Stop this Loader's open iterations and free its buffers and copy threads now."""
        _stop(self._running)
        self._running.clear()
        if self._pool is not None:
            self._pool.shutdown()
        self._pool, self._pool_threads, self._ring = None, 0, None


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
