"""Where shard tasks run: in a pool of worker processes (a local build, even with one worker),
or as Ray tasks. The build process never decodes or tokenizes: a decoder or tokenizer that
kills its process costs the item it was on (found as below), not the build.

Each runner takes the same (context, [(task, records)]) jobs and returns `ShardResult`s; the
shard function is `packer.shards.run_shard`, except that a pool splits fixed-size image shards
into pieces (`packer.pieces`: the same bytes); its processes are `packer.workers`. How they
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
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from itertools import islice

from . import format as fmt
from .errors import ConfigError, SourceError
from .internals import pool_broken, pool_manager, pool_processes
from .plan import ShardTask
from .sources import prefetch
from .system import gc_frozen
from .writer import add_disk_wait, partial_dir
from .pieces import finish_pieces, in_pieces, open_pieces, piece_bounds, run_piece
from .shards import ShardContext, ShardResult, probe, read_busy, run_shard
from .workers import init_worker

Jobs = Iterable[tuple]
Advance = Callable[[int], None]
POLL_S = 0.1


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
        mp.set_forkserver_preload(["packer._one_blas_thread", "packer.pieces", "packer.workers"])
    return mp


def start_server() -> None:
    """Start the forkserver now, so that its imports (a fifth of a second of one core) overlap
    the scan and plan rather than delay the pool's first worker. Returns at once."""
    _context("forkserver")
    from multiprocessing import forkserver

    forkserver.ensure_running()


def run_pool(ctx: ShardContext, jobs: Jobs, advance: Advance, workers: int, rayon_threads: int) -> list[ShardResult]:
    """The jobs in a pool of `workers` processes; this process only hands out work and
    finishes shards, so a decoder that kills its process costs a worker, never the build."""
    method = start_method(ctx.tokenizer is not None)
    mp = _context(method)
    # a queue that processes of either context may take: a pool made again after a crash starts
    # from the forkserver, and a queue made in the fork context may not go there
    progress = _context("spawn" if method == "spawn" else "forkserver").Queue()

    def drain() -> None:
        while True:
            try:
                items, waited = progress.get_nowait()
                advance(items)
                add_disk_wait(waited)
            except queue_mod.Empty:
                break

    pool = _Pool(mp, workers, initargs=(progress, rayon_threads, os.getpid(), ctx.staging))
    if method == "fork":
        _fork_now(pool.executor)
    try:
        results = (_run_pieces if in_pieces(ctx) else _run_shards)(pool, ctx, iter(jobs), workers, drain, advance)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results


def _fork_now(pool: ProcessPoolExecutor) -> None:
    """Fork the pool's workers now, while this process still runs one thread: a fork pool
    starts all of them at its first submit, before its own threads. The objects this process
    holds (the scan of a million files) are frozen out of the workers' garbage collector, whose
    passes would otherwise write to every one of them and copy their pages into each worker."""
    with gc_frozen():
        pool.submit(int)


class _Pool:
    """A process pool that can be made again after one of its processes died (a decoder that
    segfaults or aborts breaks the whole ProcessPoolExecutor)."""

    def __init__(self, mp, workers: int, initargs: tuple):
        self.mp, self.workers, self.initargs = mp, workers, initargs
        self.executor = self._new()
        # processes started later start from a forkserver: this process runs threads by then
        self.mp = _context("forkserver") if mp.get_start_method() == "fork" else mp

    def _new(self, workers: int | None = None) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(workers or self.workers, mp_context=self.mp, initializer=init_worker,
                                   initargs=self.initargs)

    def submit(self, fn, *args, **kwargs) -> Future:
        """The call's future; one failed with BrokenProcessPool when the pool broke since the
        last look (its caller then recovers that call with the others)."""
        try:
            return self.executor.submit(fn, *args, **kwargs)
        except BrokenProcessPool as exc:
            failed: Future = Future()
            failed.set_exception(exc)
            return failed

    def renew(self) -> None:
        """A new pool in place of a broken one, once every process of the old one is gone."""
        _stop_broken(self.executor)
        self.executor = self._new()

    def crashes(self, fn, *args) -> bool:
        """Whether fn(*args) kills the process it runs in: tried alone, in a process of its own."""
        one = self._new(1)
        try:
            one.submit(fn, *args).result()
        except BrokenProcessPool:
            return True
        except Exception:  # noqa: BLE001 - an ordinary failure: the record's own skip, later
            return False
        finally:
            one.shutdown(wait=True)
        return False

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if pool_broken(self.executor):  # else its manager thread could block the exit too
            _stop_broken(self.executor)
        else:
            self.executor.shutdown(wait=wait, cancel_futures=cancel_futures)


def _stop_broken(executor: ProcessPoolExecutor) -> None:
    """Shut down a broken pool, killing its processes first. CPython's executor terminates the
    workers it knows of when one dies, then joins them; a worker that `submit` started from
    this thread meanwhile (it replaces the dead one) is missed, waits for work forever, and so
    does the join (CPython 3.11: 2 hung builds of 30 with crashing decoders, 0 of 30 with this).
    The private names are read in `packer.internals`: without them this is a plain shutdown."""
    manager, processes = pool_manager(executor), pool_processes(executor)
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.kill()
    if manager is not None:
        manager.join()


RETRIES = 3  # worker deaths that no one item explains, before the build gives up


def _run_shards(pool: _Pool, ctx: ShardContext, jobs: Iterator, workers: int, drain, advance) -> list[ShardResult]:
    """One task per shard, at most two per worker queued. When a worker process dies, every
    shard the broken pool had runs again in a new pool, less the item (record, or document)
    that killed it, which becomes a skip: found among the items each shard's process was on
    (`read_busy`) by trying them in processes of their own, halving them. After RETRIES deaths
    that no one item explains, the build stops naming what the workers were on."""
    results: list[ShardResult] = []
    unexplained: list[str] = []  # what the workers were on, at each death no one item explains
    crashed: dict[int, frozenset[int]] = {}  # shard -> places of the items that killed a process

    def submit(task, records) -> Future:
        return pool.submit(run_shard, ctx, task, records, crashed.get(task.index, frozenset()))

    pending = {submit(*job): job for job in islice(jobs, 2 * workers)}
    while pending:
        done, _ = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
        drain()
        if any(isinstance(f.exception(), BrokenProcessPool) for f in done):
            wait(pending)  # every other task of the broken pool fails too
            again = [pending.pop(f) for f in list(pending) if isinstance(f.exception(), BrokenProcessPool)]
            pool.renew()
            on, found = [], False
            for task, records in again:
                busy = read_busy(ctx.staging, task.index)
                if busy is None:  # queued, or not yet on an item: not what died
                    continue
                on.append(f"{fmt.shard_dir_name(task.index)} items {busy[0]}..{busy[1] - 1}")
                item = _crasher(pool, ctx, records, *busy, crashed.get(task.index, frozenset()))
                if item is not None:
                    crashed[task.index] = crashed.get(task.index, frozenset()) | {item}
                    found = True
            if not found:
                unexplained.append(", ".join(on))
                if len(unexplained) >= RETRIES:
                    raise _unexplained(ctx, unexplained)
            pending.update({submit(*job): job for job in again})
            continue
        for future in done:
            del pending[future]
            results.append(future.result())  # re-raises a worker's error here
            pending.update({submit(*job): job for job in islice(jobs, 1)})
    drain()
    return results


def _unexplained(ctx: ShardContext, unexplained: list[str]) -> SourceError:
    """The error that ends a build whose workers died RETRIES times, no one item to blame."""
    if not any(unexplained):
        return SourceError(f"{ctx.out}: worker processes die before they read anything; if a script of yours "
                           "calls packer.build(), put the call under `if __name__ == \"__main__\":` (workers that "
                           "start from a forkserver import the script again)")
    return SourceError(f"{ctx.out}: worker processes died {RETRIES} times and no one item kills a process of its "
                       "own (a crash that needs several items at once, or workers killed from outside); they were "
                       f"on {unexplained[-1] or 'nothing yet'} (inputs under {ctx.raw})")


def _crasher(pool: _Pool, ctx: ShardContext, records: list, lo: int, hi: int, known: frozenset[int]) -> int | None:
    """The place of the one item among lo..hi-1 that kills a process of its own when read,
    decoded and tokenized there (`probe`), by halving the range; None when none does alone."""
    def kills(a: int, b: int) -> bool:
        return pool.crashes(probe, ctx, records, a, b, known)

    if not kills(lo, hi):
        return None
    proven = True  # whether [lo, hi) was seen to kill
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if kills(lo, mid):
            hi, proven = mid, True
        else:
            lo, proven = mid, False
    return lo if proven or kills(lo, hi) else None


@dataclass(frozen=True)
class _Piece:
    index: int
    first: int
    stop: int
    crashed: tuple[int, ...] = ()  # slots whose decode killed its process: skipped, not decoded


def _run_pieces(pool: _Pool, ctx: ShardContext, jobs: Iterator, workers: int, drain, advance) -> list[ShardResult]:
    """Shards opened here one after another, their pieces run by any of the `workers` processes
    (at most two per worker queued). Once all pieces of a shard are back, a thread of its own in
    this process finishes the shard: a finish mostly waits for its fsync, and no decoding process
    should wait with it. A piece whose process died is run again without the record that killed
    it (found by trying the record it was decoding alone), which becomes a skip."""
    results: list[ShardResult] = []
    calls: deque = deque()  # pieces of the shards opened so far, not yet submitted
    shards: dict[int, _Opened] = {}  # by index
    jobs = _with_last(jobs)
    pending: dict = {}  # future -> _Piece, or None for a finish
    opened: set[int] = set()  # shards this run started (a failure removes their partial dirs)
    unexplained: list[str] = []  # what the workers were on, at each death no one record explains
    finisher = ThreadPoolExecutor(1, thread_name_prefix="mmpack-finish")

    def submit(piece: _Piece) -> None:
        shard = shards[piece.index]
        records = [record for _, record in shard.records[piece.first:piece.stop]]  # no spans: less to pickle
        prefetch(records)  # read while the pieces before it decode
        pending[pool.submit(run_piece, ctx, piece.index, piece.first, records, writeback=shard.last,
                            crashed=piece.crashed)] = piece

    def refill() -> None:
        while sum(piece is not None for piece in pending.values()) < 2 * workers:  # pieces in flight
            if not calls and not _open_next():
                return
            submit(calls.popleft())

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
            calls.extend(_Piece(task.index, first, stop) for first, stop in bounds)
            return True
        return False

    def recover() -> None:
        """The pool broke: every piece it had is tried again, less the records that killed it."""
        wait(pending)
        broken = [pending.pop(f) for f in list(pending) if pending[f] is not None
                  and isinstance(f.exception(), BrokenProcessPool)]
        pool.renew()
        found, on = False, []
        for piece in broken:
            crashed = set(piece.crashed)
            busy = read_busy(ctx.staging, piece.index, piece.first)  # (slot, slot + 1)
            if busy is not None:  # a piece that was decoding: its record is tried alone
                slot = busy[0]
                record = shards[piece.index].records[slot][1]
                on.append(str(ctx.raw / record.key))
                if slot not in crashed and pool.crashes(ctx.decode, record.path):
                    crashed.add(slot)
                    found = True
            submit(_Piece(piece.index, piece.first, piece.stop, tuple(sorted(crashed))))
        if not found:  # no record explains this death: counted for the whole pool, never for one piece
            unexplained.append(", ".join(on))
            if len(unexplained) >= RETRIES:
                raise _unexplained(ctx, unexplained)

    try:
        refill()
        while pending:
            done, _ = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            drain()
            if any(pending[f] is not None and isinstance(f.exception(), BrokenProcessPool) for f in done):
                recover()
                continue
            for future in done:
                piece = pending.pop(future)
                value = future.result()  # re-raises a worker's error here
                if piece is None:
                    results.append(value)
                    continue
                shard = shards[piece.index]
                shard.pieces_left -= 1
                skips, digests = value
                shard.skips.update(skips)
                shard.digests.update(digests)
                if shard.pieces_left == 0:
                    del shards[piece.index]
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
