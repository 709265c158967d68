"""Where a local build's shard tasks run: in a pool of worker processes (even with one worker;
`packer.builder.ray_tasks` runs them as Ray tasks instead). The build process never decodes or tokenizes: a decoder or tokenizer that
kills its process costs the item it was on (found as below), not the build.

Both take the same (context, [(task, records)]) jobs and return `ShardResult`s. The pool
runs units (`Unit`: a shard's row range; a fixed-size image shard in pieces, `packer.builder.pieces`,
the same bytes; any other shard whole, `packer.builder.shard.run_shard`) under one scheduler with one
recovery (`_Scheduler`); its processes are `packer.builder.workers`. How they
start (`start_method`): a build without a tokenizer forks them from this process when it runs
a single thread, before any thread of the pool starts; any other build uses forkserver (spawn
off Linux), never fork: `tokenizers` used before a fork can deadlock the child
(huggingface/tokenizers#187), as can any lock another thread holds. At most two units per worker
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
from dataclasses import dataclass, field, replace

from packer.dataset import format as fmt
from packer.errors import SourceError
from packer.internals import pool_broken, pool_manager, pool_processes
from packer.builder.plan import ShardTask
from packer.builder.scan import prefetch
from packer.system import gc_frozen, single_threaded
from packer.dataset.writer import add_disk_wait, partial_dir
from packer.builder.pieces import finish_pieces, in_pieces, open_pieces, piece_bounds, run_piece
from packer.builder.shard import ShardContext, ShardResult, probe, read_busy, run_shard
from packer.builder.workers import init_worker

Jobs = Iterable[tuple]
Advance = Callable[[int], None]
POLL_S = 0.1


def start_method(tokenizer: bool) -> str:
    """How a pool started now would start its workers. "fork" on Linux for a build that uses
    no tokenizer, from a process that runs one thread (/proc/self/task): no lock can be held
    by a thread the child lacks, whatever libraries are loaded, and a worker starts in a
    millisecond with this process's imports, where a forkserver first imports them again in a
    process of its own, CPU taken from the decoding lanes. Otherwise
    "forkserver" ("spawn" off Linux)."""
    if not sys.platform.startswith("linux"):
        return "spawn"
    if not tokenizer and single_threaded():
        return "fork"
    return "forkserver"


def _context(method: str):
    mp = multiprocessing.get_context(method)
    if method == "forkserver":
        # the server imports numpy, Pillow and tokenizers' module once (never runs a tokenizer,
        # so forking from it is safe); each worker then starts in milliseconds, not a second.
        # _one_blas_thread first: it keeps OpenBLAS's spinning threads out of the server
        mp.set_forkserver_preload(["packer._one_blas_thread", "packer.builder.pieces", "packer.builder.workers"])
    return mp


def start_server() -> None:
    """Start the forkserver now, so that its imports overlap the scan and plan rather than delay
    the pool's first worker. Returns at once."""
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
        results = _Scheduler(pool, ctx, iter(jobs), workers, drain, advance).run()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    # a worker's last progress (its shard's disk wait) goes through a queue's feeder thread and
    # can arrive after the result it came with; a worker flushes that queue before it exits
    drain()
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
    does the join (builds with crashing decoders hung so on CPython 3.11).
    The private names are read in `packer.internals`: without them this is a plain shutdown."""
    manager, processes = pool_manager(executor), pool_processes(executor)
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.kill()
    if manager is not None:
        manager.join()


RETRIES = 3  # worker deaths that no one item explains, before the build gives up


@dataclass(frozen=True)
class Unit:
    """The work a pool worker runs: a shard's row range. A fixed-size image shard is cut into
    pieces of rows (`packer.builder.pieces`: each decodes into its slots of the shard's image file, and
    this process finishes the shard once all are back); any other shard is one unit, its whole
    range, which the worker packs and closes itself (`run_shard`). `crashed`: the places of
    items (slots; documents for text) that killed a process, skipped untried."""

    index: int
    first: int = 0
    stop: int | None = None  # None: the whole shard
    crashed: frozenset[int] = frozenset()

    @property
    def whole(self) -> bool:
        return self.stop is None


@dataclass
class _Open:
    """A shard whose units are out (or about to go)."""

    task: ShardTask
    records: list
    last: bool  # the build's last shard: its pieces start their writeback as they finish
    units_left: int = 1
    skips: dict = field(default_factory=dict)  # slot -> Skip, from the pieces back so far
    digests: dict = field(default_factory=dict)  # slot -> the checksum digest of its image row
    flattened: int = 0  # its images whose transparency was dropped, from the pieces back so far


class _Scheduler:
    """The one scheduler of a local build: units (`Unit`) to the pool, at most two per worker in
    flight; a shard in pieces finished on a thread of this process once its pieces are back (a
    finish mostly waits for its fsync, and no decoding process should wait with it). The one
    recovery: when a worker dies, every unit of the broken pool runs again in a new pool, less
    the item that killed it, found among the items its process was on (`read_busy`) by trying
    them in processes of their own, halving them (`_crasher`); deaths count for the whole pool,
    never against the work that was only running beside the culprit, and after RETRIES that no
    one item explains, the build stops naming what the workers were on."""

    def __init__(self, pool: _Pool, ctx: ShardContext, jobs: Iterator, workers: int, drain, advance):
        self.pool, self.ctx, self.workers, self.drain, self.advance = pool, ctx, workers, drain, advance
        self.jobs = _with_last(jobs)
        self.sliced = in_pieces(ctx)
        self.units: deque[Unit] = deque()  # of the shards opened so far, not yet submitted
        self.open: dict[int, _Open] = {}  # by shard index
        self.started: set[int] = set()  # shards this run started (a failure removes their partial dirs)
        self.pending: dict[Future, Unit | None] = {}  # None: a finish
        self.results: list[ShardResult] = []
        self.unexplained: list[str] = []  # what the workers were on, at each death no one item explains
        self.finisher = ThreadPoolExecutor(1, thread_name_prefix="mmpack-finish") if self.sliced else None
        self.finish_failed = False  # set on the finisher thread, read there too

    def run(self) -> list[ShardResult]:
        try:
            self._refill()
            while self.pending:
                done, _ = wait(self.pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
                self.drain()
                if any(self.pending[f] is not None and isinstance(f.exception(), BrokenProcessPool) for f in done):
                    self._recover()
                    continue
                for future in done:
                    self._collect(future)
                self._refill()
        except BaseException:  # a unit, an open or a finish failed (a full disk): no half-filled shard
            # stays behind, be it in pieces, half opened or waiting for its finish (cancelled here);
            # a shard whose finish ran has no partial dir left (it was renamed whole, or removed)
            self.pool.shutdown(wait=True, cancel_futures=True)
            if self.finisher is not None:
                self.finisher.shutdown(wait=True, cancel_futures=True)
            for index in self.started:
                shutil.rmtree(partial_dir(self.ctx.staging, index), ignore_errors=True)
            raise
        if self.finisher is not None:
            self.finisher.shutdown(wait=True)
        self.drain()
        return self.results

    def _refill(self) -> None:
        while sum(unit is not None for unit in self.pending.values()) < 2 * self.workers:  # units in flight
            if not self.units and not self._open_next():
                return
            self._submit(self.units.popleft())

    def _open_next(self) -> bool:
        """Open the next shard: its units queued, or, finished by another run of this build
        meanwhile, its result taken as it is."""
        for (task, records), last in self.jobs:
            self.started.add(task.index)
            if not self.sliced:
                self.open[task.index] = _Open(task, records, last)
                self.units.append(Unit(task.index))
                return True
            done = open_pieces(self.ctx, task)
            if done is not None:
                self.results.append(done)
                self.advance(done.items)
                continue
            bounds = piece_bounds(len(records), last=last, lanes=self.workers)
            self.open[task.index] = _Open(task, records, last, len(bounds))
            self.units.extend(Unit(task.index, first, stop) for first, stop in bounds)
            return True
        return False

    def _submit(self, unit: Unit) -> None:
        shard = self.open[unit.index]
        if unit.whole:
            future = self.pool.submit(run_shard, self.ctx, shard.task, shard.records, unit.crashed)
        else:
            records = [record for _, record in shard.records[unit.first:unit.stop]]  # no spans: less to pickle
            prefetch(records)  # read while the pieces before it decode
            future = self.pool.submit(run_piece, self.ctx, unit.index, unit.first, records, writeback=shard.last,
                                      crashed=tuple(sorted(unit.crashed)))
        self.pending[future] = unit

    def _collect(self, future: Future) -> None:
        unit = self.pending.pop(future)
        if unit is None and isinstance(future.exception(), _Dropped):
            return  # the finish that failed before it raises its own error
        value = future.result()  # re-raises a worker's error here
        if unit is None or unit.whole:  # a shard finished here, or in its worker
            if unit is not None:
                del self.open[unit.index]
            self.results.append(value)
            return
        shard = self.open[unit.index]
        shard.units_left -= 1
        skips, digests, flat = value
        shard.skips.update(skips)
        shard.digests.update(digests)
        shard.flattened += flat
        if shard.units_left == 0:
            del self.open[unit.index]
            self.pending[self.finisher.submit(self._finish, shard)] = None

    def _finish(self, shard: _Open) -> ShardResult:
        """On the finisher thread: a finish queued behind one that failed does not start, so a
        failed build drops the shards after it whatever the timing (the run's cleanup cancels
        only the finishes the thread has not taken yet)."""
        if self.finish_failed:
            raise _Dropped()
        try:
            return finish_pieces(self.ctx, shard.task, shard.records, shard.skips, shard.digests, shard.flattened)
        except BaseException:
            self.finish_failed = True
            raise

    def _recover(self) -> None:
        """The pool broke: every unit it had runs again in a new pool, less the item that killed
        its process, where one item alone does."""
        wait(self.pending)  # every other unit of the broken pool fails too
        broken = [self.pending.pop(f) for f in list(self.pending)
                  if self.pending[f] is not None and isinstance(f.exception(), BrokenProcessPool)]
        self.pool.renew()
        found, on = False, []
        for unit in broken:
            crashed = unit.crashed
            busy = read_busy(self.ctx.staging, unit.index, None if unit.whole else unit.first)
            if busy is not None:  # queued, or not yet on an item: not what died
                on.append(f"{fmt.shard_dir_name(unit.index)} items {busy[0]}..{busy[1] - 1}")
                item = _crasher(self.pool, self.ctx, self.open[unit.index].records, *busy, crashed)
                if item is not None:
                    crashed, found = crashed | {item}, True
            self._submit(replace(unit, crashed=crashed))
        if not found:  # counted for the whole pool, never for one unit
            self.unexplained.append(", ".join(on))
            if len(self.unexplained) >= RETRIES:
                raise _unexplained(self.ctx, self.unexplained)


class _Dropped(Exception):
    """A shard's finish not started: one before it failed."""


def _unexplained(ctx: ShardContext, unexplained: list[str]) -> SourceError:
    """The error that ends a build whose workers died RETRIES times, no one item to blame."""
    if not any(unexplained):
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        if main is not None and not os.path.isfile(main):  # `python - < script`: nothing to import again
            return SourceError(f"{ctx.out}: worker processes die before they read anything: they import this "
                               f"process's __main__ again, and {main} is no file; call packer.build() from a script "
                               "file (under `if __name__ == \"__main__\":`), or run `packer build`")
        return SourceError(f"{ctx.out}: worker processes die before they read anything; if a script of yours "
                           "calls packer.build(), put the call under `if __name__ == \"__main__\":` (workers that "
                           "start from a forkserver import the script again)")
    return SourceError(f"{ctx.out}: worker processes died {RETRIES} times and no one item kills a process of its "
                       "own (a crash that needs several items at once, or workers killed from outside); they were "
                       f"on {unexplained[-1] or 'nothing yet'} (inputs under {ctx.config.raw})")


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


_END = object()


def _with_last(items: Iterator) -> Iterator[tuple]:
    """(item, is it the last one) for each item."""
    ahead = next(items, _END)
    while ahead is not _END:
        item, ahead = ahead, next(items, _END)
        yield item, ahead is _END
