"""Where shard tasks run: in this process, in a pool of worker processes, or as Ray tasks.

Each runner takes the same (context, [(task, records)]) jobs and returns `ShardResult`s; the
shard function is `packer.shards.run_shard` everywhere. Pool workers are started with
forkserver (spawn off Linux), never fork: `tokenizers` used before a fork can deadlock the
child (huggingface/tokenizers#187), and fork would also copy the parent's whole heap. At most
two jobs per worker are queued, so memory stays bounded by the shard, not the corpus.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_mod
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from .errors import ConfigError
from .shards import ShardContext, ShardResult, init_worker, run_shard, set_progress_sink

Jobs = Iterable[tuple]
Advance = Callable[[int], None]
POLL_S = 0.1


def run_here(ctx: ShardContext, jobs: Jobs, advance: Advance) -> list[ShardResult]:
    set_progress_sink(advance)
    try:
        return [run_shard(ctx, task, records) for task, records in jobs]
    finally:
        set_progress_sink(None)


def _start_method() -> str:
    return "forkserver" if sys.platform.startswith("linux") else "spawn"


def run_pool(ctx: ShardContext, jobs: Jobs, advance: Advance, workers: int, rayon_threads: int) -> list[ShardResult]:
    mp = multiprocessing.get_context(_start_method())
    if _start_method() == "forkserver":
        # the server imports numpy, Pillow and tokenizers' module once (never runs a tokenizer,
        # so forking from it is safe); each worker then starts in milliseconds, not a second
        mp.set_forkserver_preload(["packer.shards"])
    progress = mp.Queue()
    results: list[ShardResult] = []
    jobs = iter(jobs)

    def drain() -> None:
        while True:
            try:
                advance(progress.get_nowait())
            except queue_mod.Empty:
                return

    busy = mp.Value("i", 0)  # workers inside a shard: sizes each one's decode lanes (packer.shards)
    pool = ProcessPoolExecutor(workers, mp_context=mp, initializer=init_worker,
                               initargs=(progress, rayon_threads, busy, workers))
    try:
        pending = {pool.submit(run_shard, ctx, *job) for job in _take(jobs, 2 * workers)}
        while pending:
            done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            drain()
            for future in done:
                results.append(future.result())  # re-raises a worker's error here
                pending |= {pool.submit(run_shard, ctx, *job) for job in _take(jobs, 1)}
        drain()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return results


def _take(it: Iterator, n: int) -> list:
    out = []
    for item in it:
        out.append(item)
        if len(out) == n:
            break
    return out


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
    pending = [remote.remote(ctx, *job) for job in _take(jobs, 2 * cpus)]
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:  # the task's own error, unwrapped
                raise (exc.cause or exc) from None
            results.append(result)
            advance(result.items)
            pending += [remote.remote(ctx, *job) for job in _take(jobs, 1)]
    return results
