"""`Loader`: whole batches gathered ahead by a producer thread into reusable (pinned) buffers
(`ds.batched(...)`, in `loaders.batched`, gives the same batches to a DataLoader).

Order, rank share, cursor and resume state come from `loaders.order.sampler`; the gather from the
source (`loaders.batch.gather`, `TokenWindows`, `PackedDocuments`). A batch's tensors are views of a
buffer of the ring (`loaders.batch.ring`), which is refilled only once nothing the caller holds refers
to it: batches are safe to keep.
"""

from __future__ import annotations

import collections
import functools
import itertools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from packer.system import available_cores, local_ranks

from loaders.batch import native
from loaders.batch.ring import Ring
from loaders.lookahead import Lookahead
from loaders.source import as_source, bind, gather
from loaders.cuda import to_device
from loaders.device_decode import choose, decoded_on
from loaders.order.orders import WINDOW
from loaders.order.sampler import Order, Pass, check_int
from loaders.resumable import Resumable
from loaders.producer import made_ahead, stop_all
from loaders.views.dataset import MMapDataset


# A batch of fewer bytes than this is made in the caller's thread, on demand: handing a batch
# over from a producer thread (a queue put, a wake-up, a GIL switch) costs more than gathering
# such a batch does (token windows, small batches). Larger ones are made ahead.
INLINE_BELOW_BYTES = 1 << 20
# Gather threads a Loader takes by default: past this many the copies are bound by the memory
# bus, not by cores, on the hosts GPUs sit in (see docs/design.md), and the cores not taken are
# the training job's.
MAX_DEFAULT_THREADS = 16
# With num_threads="auto", a thread count is doubled while that makes the gather at least this much faster.
THREAD_GAIN = 0.10
TIMED_AMONG = 64  # num_threads="auto" times batches among a pass's first ones
_NEVER = threading.Event()  # the stop of a batch made inline: none


def _measured(batches, padding, figures):
    """`batches`, each one's padding measured as it passes (on the host) into `figures`."""
    for batch in batches:
        figures.append(padding.measure(batch))
        yield batch


def default_threads() -> int:
    """The gather threads of a Loader not told how many: the cores this process may use, shared
    by the ranks on the node (LOCAL_WORLD_SIZE, as torchrun sets it), at most MAX_DEFAULT_THREADS.
    A pure function of the machine: the first epoch runs as fast as the last."""
    return max(1, min(MAX_DEFAULT_THREADS, available_cores() // local_ranks()))


def copy_pool(threads: int):
    """The copiers of a Loader's gathers: a pool of C threads (`loaders.batch.native`), or, where the
    native copies were not built, Python threads for numpy's; None for one thread."""
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


class Loader(Resumable):
    """Batches of a packed dataset (or TokenWindows / PackedDocuments) at memory bandwidth.

    Every iteration is a pass over an epoch from its beginning (the next epoch after a pass that
    ended, or was left early by a peek with `next(iter(loader))` or a `break`: a new order, as a
    shuffled DataLoader's next iterator; `set_epoch(e)` names it), except the first after
    `load_state_dict()`, which goes on exactly where the state was saved (see
    `loaders.order.sampler.Epochs`).

    Args:
        dataset: an MMapDataset, a dataset dir, or a TokenWindows / PackedDocuments view.
        batch_size: samples per batch on this rank (with a budget, the most; may then be None).
        shuffle: False means order="sequential" unless `order` is given.
        seed: with the epoch, fixes the order (an int in [0, 2**64)).
        drop_last: drop the last partial global batch (else pad by repeating, as
            DistributedSampler does, so every rank gets the same number of batches).
        num_threads: gather threads; default `default_threads()`: the cores this process may
            use, divided among the node's ranks (LOCAL_WORLD_SIZE), at most MAX_DEFAULT_THREADS
            (16). "auto": timed at the first pass (`fewest_threads`: the fewest past which
            doubling gains under 10%).
        pin_memory: None = pinned when CUDA is available.
        device: hand batches over already on this device (see `loaders.to_device`).
        order: "random", "sequential" or "block" (near-sequential, for data larger than RAM or
            in object storage: blocks of 1,024 ids in a random order, the ids shuffled within
            each window of `block_window` positions; each rank keeps its blocks every epoch).
        block_window: block order's window (default 8,192): the samples a rank reads at once.
            Its shards must fit the rank's cache limit, or each epoch fetches them many times
            (a warning says so when the Loader is made); a smaller window shuffles less.
        rank, world_size: default from torch.distributed, else RANK / WORLD_SIZE.
        columns: the columns to gather (default all).
        bucket_by: "aspect": every batch's images share an aspect-ratio bucket, so a keep-aspect
            canvas is mostly image (each image still once an epoch; the batches' order random,
            deterministic and resumable with the same batch size; `loaders.order.buckets`).
            "length" (or "length:COLUMN"): every batch's samples are of about one length of the
            ragged column (tokens, audio frames), so little of a batch is padding; each sample
            once an epoch, the batches in a random order (`loaders.order.planned`).
        max_tokens: instead of a fixed batch size (or with it, as the most samples a batch
            holds), a budget: each batch holds as many samples, of about one length, as fit in
            this many padded elements (samples x its longest); a sample longer alone is a batch
            of one (counted in `padding`). Every rank gets as many batches.
        max_seconds: the budget of an audio dataset's whole clips, in seconds.
        cost: "linear", or "quadratic": the budget counts samples x longest squared (attention).
        num_buffers: batch buffers in the ring, >= 2: the batch the caller holds and
            num_buffers - 1 gathered ahead (more are allocated only while the caller keeps
            batches; see `loaders.batch.ring`).
        jpeg_decode: where a JPEG-lane dataset's images are decoded (`--store jpeg`): "auto"
            (today the gather's threads by Pillow, on any device: the card's batched decode has
            not yet been measured beside them; `device_decode.AUTO_ON_CUDA`), "threads", or
            "device" (one batched nvJPEG call on the CUDA `device`; refused without torchvision).

    `close()` (or leaving a `with Loader(...) as loader:` block) stops its open iterations and
    frees its buffers and threads at once, and unpins a remote dataset's shards (the node's
    cache may evict them); iterating it again makes new ones.
    """

    def __init__(self, dataset, batch_size: int | None = None, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, num_threads: int | str | None = None, pin_memory: bool | None = None,
                 device=None, order: Order | None = None, rank: int | None = None, world_size: int | None = None,
                 columns: list[str] | None = None, num_buffers: int = 3, bucket_by: str | None = None,
                 max_tokens: int | None = None, max_seconds: float | None = None, cost: str = "linear",
                 block_window: int = WINDOW, jpeg_decode: str = "auto"):
        if isinstance(dataset, (str, os.PathLike)):
            dataset = MMapDataset(dataset)
        self._dataset = dataset
        # the JPEG lane: decoded on the device by nvJPEG (`loaders.device_decode`), or in the gather's threads
        self.source = as_source(dataset, columns)
        self._decode = choose(jpeg_decode, device, self.source.encoded)
        if self._decode is not None:  # a source of its own that hands the lane over as bytes
            self.source = as_source(dataset, columns, device_decode=True)
        self._epochs = bind(self.source, batch_size, shuffle=shuffle, order=order, seed=seed, drop_last=drop_last,
                            rank=rank, world_size=world_size, bucket_by=bucket_by, max_tokens=max_tokens,
                            max_seconds=max_seconds, cost=cost, block_window=block_window)
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
        self._running: set = set()  # this Loader's open producers (`loaders.producer`)

    @property
    def dataset(self):
        """The dataset batched, as a DataLoader's `.dataset` (`len(loader.dataset)`: every sample,
        all ranks' together)."""
        return self._dataset

    @property
    def batch_size(self) -> int:
        return self._epochs.batch_size

    @property
    def drop_last(self) -> bool:
        return self._epochs.drop_last

    @property
    def rank(self) -> int:
        return self._epochs.rank

    @property
    def world_size(self) -> int:
        return self._epochs.world_size

    def __len__(self) -> int:
        """Batches of the next pass: the whole epoch, or its rest after `load_state_dict`."""
        return self._epochs.num_batches()

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self):
        p = self._epochs.start()
        batches = self._gathered(p)
        figures = None
        if self.device is not None:
            if self.padding is not None:  # measured on the host, before the copy: counted when handed over
                figures = collections.deque()
                batches = _measured(batches, self.padding, figures)
            batches = to_device(batches, self.device)
        if self._decode is not None:
            batches = decoded_on(batches, self.device, self._decode)
        return self._counted(p, batches, figures)

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
        epochs, source = self._epochs, self.source
        if self._ring is None:
            memory = "pinned" if self.pin_memory else "huge"
            # the ring holds the source's alloc, not this Loader: no cycle keeps a dropped
            # Loader's buffers (hundreds of MB of canvases) until the garbage collector runs
            self._ring = Ring(functools.partial(source.alloc, epochs.most_per_batch(), memory), self.num_buffers)
        ring = self._ring
        if self._timed:
            self._time_threads(p, ring)
        pool, threads = self._pool_of(self.num_threads), self.num_threads
        ahead = None
        if source.remote and epochs.has(p, 0) and not source.all_mapped():  # fetched ahead
            ahead = Lookahead(source.residency, *epochs.ahead_of(p))

        def make(b: int, needed, stop=_NEVER):
            buffers = ring.take(needed, stop)
            if buffers is None:
                return None
            try:
                if ahead is not None:
                    ahead.at(b)
                return gather(source, epochs.batch_ids(p, b), buffers, pool, threads, epoch=p.epoch)
            finally:
                ring.filled(buffers)

        try:
            if not epochs.has(p, 0):
                return
            if ring.batch_bytes < INLINE_BELOW_BYTES:
                for b in epochs.batches(p):
                    yield make(b, lambda: True)
                return
            yield from made_ahead(make, functools.partial(epochs.has, p), self.num_buffers - 1, ring.wake,
                                  self._running)
        finally:
            if ahead is not None:
                ahead.close()

    def _time_threads(self, p: Pass, ring: Ring) -> None:
        """num_threads="auto": the thread count chosen by timing gathers of the pass's batches at
        1, 2, 4, ... threads (`fewest_threads`, the best of three for each count), once. Each try
        gathers a batch twice and times the second: a fresh process's first touches of the maps
        are page faults, serial work that would hide what more threads gain."""
        self._timed = False
        if not self._epochs.has(p, 0):
            return
        # batches of the whole batch size (the last may be short), among the first few
        full = max(1, self._epochs.clip(p, TIMED_AMONG) - 1)
        batches = itertools.count(1)
        pool = copy_pool(self.num_threads)
        stop = threading.Event()
        buffers = ring.take(lambda: True, stop)

        def seconds_with(threads: int) -> float:
            best = float("inf")
            for _ in range(3):
                ids = self._epochs.batch_ids(p, next(batches) % full)
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
        """Stop this Loader's open iterations, free its buffers and copy threads, and unpin a
        remote dataset's shards, now."""
        stop_all(self._running)
        self._running.clear()
        self.source.release()  # a remote dataset's shards: unpinned, for the cache to evict
        if self._pool is not None:
            self._pool.shutdown()
        self._pool, self._pool_threads, self._ring = None, 0, None
