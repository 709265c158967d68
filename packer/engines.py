"""Where shard tasks run: in this process, in a pool of worker processes, or as Ray tasks.

Each runner takes the same (context, [(task, records)]) jobs and returns `ShardResult`s; the
shard function is `packer.shards.run_shard`, except that a pool splits fixed-size image shards
into pieces (`open_pieces` / `run_piece` / `finish_pieces`, the same bytes). How pool workers
start (`start_method`): a build without a tokenizer forks them from this process when it runs
a single thread, before any thread of the pool starts; any other build uses forkserver (spawn
off Linux), never fork: `tokenizers` used before a fork can deadlock the child
(huggingface/tokenizers#187), as can any lock another thread holds. At most two jobs per worker
are queued, so memory stays bounded by the shard, not the corpus."""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_mod
import shutil
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import islice

from .errors import ConfigError
from .plan import ShardTask
from .sources import prefetch
from .system import gc_frozen
from .writer import partial_dir
from .shards import (ShardContext, ShardResult, fill_shard, finish_pieces, in_pieces, init_worker,
                     open_pieces, piece_bounds, run_piece, run_shard, set_progress_sink)

Jobs = Iterable[tuple]
Advance = Callable[[int], None]
POLL_S = 0.1


def run_here(ctx: ShardContext, jobs: Jobs, advance: Advance) -> list[ShardResult]:
    """Shard after shard in this process; each shard is closed (its fsync waited for) on a
    thread while the next one fills, at most one close in flight."""
    set_progress_sink(advance)
    results: list[ShardResult] = []
    closing: Future | None = None
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="mmpack-finish") as finisher:
            for task, records in jobs:
                filled = fill_shard(ctx, task, records)
                if closing is not None:
                    try:
                        results.append(closing.result())  # re-raises its error (a full disk) here
                    except BaseException:
                        filled.abort()
                        raise
                closing = finisher.submit(filled.close)
            if closing is not None:
                results.append(closing.result())
        return results
    finally:
        set_progress_sink(None)


def start_method(tokenizer: bool) -> str:
    """How a pool started now would start its workers. "fork" on Linux for a build that uses
    no tokenizer, from a process that runs one thread (/proc/self/task): no lock can be held
    by a thread the child lacks, whatever libraries are loaded, and a worker starts in a
    millisecond with this process's imports, where a forkserver first imports them again in a
    process of its own (0.12 s of a core, taken from the decoding lanes on 2 cores). Otherwise
    "forkserver" ("spawn" off Linux)."""
    if not sys.platform.startswith("linux"):
        return "spawn"
    if not tokenizer and _single_threaded():
        return "fork"
    return "forkserver"


def _single_threaded() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _context(method: str):
    mp = multiprocessing.get_context(method)
    if method == "forkserver":
        # the server imports numpy, Pillow and tokenizers' module once (never runs a tokenizer,
        # so forking from it is safe); each worker then starts in milliseconds, not a second.
        # _one_blas_thread first: it keeps OpenBLAS's spinning threads out of the server
        mp.set_forkserver_preload(["packer._one_blas_thread", "packer.shards"])
    return mp


def start_server() -> None:
    """Start the forkserver now, so that its imports (a fifth of a second of one core) overlap
    the scan and plan rather than delay the pool's first worker. Returns at once."""
    _context("forkserver")
    from multiprocessing import forkserver

    forkserver.ensure_running()


def run_pool(ctx: ShardContext, jobs: Jobs, advance: Advance, workers: int, rayon_threads: int) -> list[ShardResult]:
    method = start_method(ctx.tokenizer is not None)
    mp = _context(method)
    progress, here = mp.Queue(), queue_mod.SimpleQueue()  # from the workers, from this process

    def drain() -> None:
        for q in (progress, here):
            while True:
                try:
                    advance(q.get_nowait())
                except queue_mod.Empty:
                    break

    pieces = in_pieces(ctx)
    procs = workers - 1 if pieces else workers
    pool = ProcessPoolExecutor(procs, mp_context=mp, initializer=init_worker, initargs=(progress, rayon_threads))
    if method == "fork":
        _fork_now(pool)
    if pieces:  # this process is the last worker: it decodes from the start, while the pool starts
        # (first in the list: ties go to it, so the first piece starts here at once; a forkserver
        # pool's first submit then starts its processes, which takes tens of ms)
        pool = _Spread([(ThreadPoolExecutor(1, thread_name_prefix="mmpack-piece"), 1), (pool, procs)])
        set_progress_sink(here.put)  # no pickling, no feeder thread
    try:
        results = (_run_pieces if pieces else _run_shards)(pool, ctx, iter(jobs), workers, drain, advance)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        set_progress_sink(None)
    pool.shutdown(wait=True)
    return results


def _fork_now(pool: ProcessPoolExecutor) -> None:
    """Fork the pool's workers now, while this process still runs one thread: a fork pool
    starts all of them at its first submit, before its own threads. The objects this process
    holds (the scan of a million files) are frozen out of the workers' garbage collector, whose
    passes would otherwise write to every one of them and copy their pages into each worker."""
    with gc_frozen():
        pool.submit(int)


class _Spread:
    """Executors as one: each call goes to the one with the fewest calls outstanding per worker."""

    def __init__(self, executors: list[tuple[Executor, int]]):
        self._workers = dict(executors)
        self._outstanding = dict.fromkeys(self._workers, 0)
        self._lock = threading.Lock()

    def submit(self, fn, *args, **kwargs) -> Future:
        with self._lock:
            ex = min(self._workers, key=lambda e: self._outstanding[e] / self._workers[e])
            self._outstanding[ex] += 1
        future = ex.submit(fn, *args, **kwargs)
        future.add_done_callback(lambda _: self._done(ex))
        return future

    def _done(self, ex: Executor) -> None:
        with self._lock:
            self._outstanding[ex] -= 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for ex in self._workers:
            ex.shutdown(wait=wait, cancel_futures=cancel_futures)


def _run_shards(pool, ctx: ShardContext, jobs: Iterator, workers: int, drain, advance) -> list[ShardResult]:
    """One task per shard, at most two per worker queued."""
    results: list[ShardResult] = []
    pending = {pool.submit(run_shard, ctx, *job) for job in islice(jobs, 2 * workers)}
    while pending:
        done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
        drain()
        for future in done:
            results.append(future.result())  # re-raises a worker's error here
            pending |= {pool.submit(run_shard, ctx, *job) for job in islice(jobs, 1)}
    drain()
    return results


def _run_pieces(pool, ctx: ShardContext, jobs: Iterator, workers: int, drain, advance) -> list[ShardResult]:
    """Shards opened here one after another, their pieces run by any of the `workers` lanes (at
    most two per lane queued). Once all pieces of a shard are back, a thread of its own in this process finishes
    the shard: a finish mostly waits for its fsync, and no decoding lane should wait with it."""
    results: list[ShardResult] = []
    calls: deque = deque()  # pieces of the shards opened so far, not yet submitted
    shards: dict[int, _Opened] = {}  # by index
    jobs = _with_last(jobs)
    pending: dict = {}  # future -> shard index, or None for a finish
    opened: set[int] = set()  # shards this run started (a failure removes their partial dirs)
    finisher = ThreadPoolExecutor(1, thread_name_prefix="mmpack-finish")

    def refill() -> None:
        while sum(index is not None for index in pending.values()) < 2 * workers:  # pieces in flight
            if not calls and not _open_next():
                return
            index, first, stop = calls.popleft()
            shard = shards[index]
            records = [record for _, record in shard.records[first:stop]]  # no spans: less to pickle
            prefetch(records)  # read while the pieces before it decode
            pending[pool.submit(run_piece, ctx, index, first, records, writeback=shard.last)] = index

    def _open_next() -> bool:
        for (task, records), last in jobs:
            opened.add(task.index)
            done = open_pieces(ctx, task)
            if done is not None:  # finished by another run of this build meanwhile
                results.append(done)
                advance(done.items)
                continue
            bounds = piece_bounds(len(records), last=last, lanes=workers)
            shards[task.index] = _Opened(task, records, len(bounds), last)
            calls.extend((task.index, first, stop) for first, stop in bounds)
            return True
        return False

    try:
        refill()
        while pending:
            done, _ = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            drain()
            for future in done:
                index = pending.pop(future)
                value = future.result()  # re-raises a worker's error here
                if index is None:
                    results.append(value)
                    continue
                shard = shards[index]
                shard.pieces_left -= 1
                skips, digests = value
                shard.skips.update(skips)
                shard.digests.update(digests)
                if shard.pieces_left == 0:
                    del shards[index]
                    pending[finisher.submit(finish_pieces, ctx, shard.task, shard.records, shard.skips,
                                            shard.digests)] = None
            refill()
    except BaseException:  # a piece, an open or a finish failed (a full disk): no half-filled shard
        # stays behind, be it in pieces, half opened or waiting for its finish (cancelled here);
        # a shard whose finish ran has no partial dir left (it was renamed whole, or removed)
        pool.shutdown(wait=True, cancel_futures=True)
        finisher.shutdown(wait=True, cancel_futures=True)
        for index in opened:
            shutil.rmtree(partial_dir(ctx.staging, index), ignore_errors=True)
        raise
    finisher.shutdown(wait=True)
    drain()
    return results


@dataclass
class _Opened:
    """A shard whose pieces are out (or about to go)."""

    task: ShardTask
    records: list
    pieces_left: int
    last: bool  # the build's last shard: its pieces start their writeback as they finish
    skips: dict = field(default_factory=dict)  # slot -> Skip, from the pieces back so far
    digests: dict = field(default_factory=dict)  # slot -> the checksum digest of its image row


_END = object()


def _with_last(items: Iterator) -> Iterator[tuple]:
    """(item, is it the last one) for each item."""
    ahead = next(items, _END)
    while ahead is not _END:
        item, ahead = ahead, next(items, _END)
        yield item, ahead is _END


def run_ray(ctx: ShardContext, jobs: Jobs, advance: Advance, address: str | None) -> list[ShardResult]:
    """The same shard function as Ray tasks, on the cluster at `address` (None: a local one).
    Inputs and OUT must be reachable at the same paths from every Ray node (a shared FS)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--engine ray: Ray is not installed (pip install 'mmpack[ray]')") from None
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", configure_logging=False)
    remote = ray.remote(run_shard)
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    jobs = iter(jobs)
    results: list[ShardResult] = []
    pending = [remote.remote(ctx, *job) for job in islice(jobs, 2 * cpus)]
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:  # the task's own error, unwrapped
                raise (exc.cause or exc) from None
            results.append(result)
            advance(result.items)
            pending += [remote.remote(ctx, *job) for job in islice(jobs, 1)]
    return results
