"""How the bench measures: the memcpy limit, timed passes, memory of the whole process tree
(RSS and PSS from /proc/PID/smaps_rollup), CPU seconds, page-cache eviction for cold runs, the
raw GET rate of a dataset in object storage (what `bench remote` and the doctor's link probe
set a reader against). How
long a loop waits for data is the doctor's measure (`bench.doctor.stall`)."""

from __future__ import annotations

import bisect
import itertools
import os
import resource
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def timed_pass(loader) -> tuple[int, float, float]:
    """(samples, seconds, seconds to the first batch) of one pass of a loader of labelled batches."""
    start = time.perf_counter()
    first, n = None, 0
    for batch in loader:
        n += len(batch["label"])
        first = first or time.perf_counter() - start
    return n, time.perf_counter() - start, first or 0.0


def steady_batch_s(loader, passes: int = 5) -> float:
    """The median time between a loader's batches after each pass's first, over `passes` passes,
    its last batch left out where it is short: what a long epoch pays a batch, without a pass's
    start (a producer thread started, the first batch not made ahead), which a pass of a few
    batches repeats often (a bench's small dataset; a training epoch runs thousands)."""
    gaps = []
    for _ in range(passes):
        last, sizes, times = time.perf_counter(), [], []
        for batch in loader:
            now = time.perf_counter()
            sizes.append(len(batch["label"]))
            times.append(now - last)
            last = now
        full = [t for k, (t, n) in enumerate(zip(times, sizes)) if k and n == max(sizes)]
        gaps += full
    return statistics.median(gaps) if gaps else float("nan")


def memcpy_rate(nbytes: int, reps: int = 10, threads: int = 1) -> float:
    """Bytes/s of numpy copies between two pre-touched buffers of `nbytes`, split over `threads`
    threads (numpy's copy releases the GIL), the best of `reps`: a limit that noise can only
    lower, not raise."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    cuts = [nbytes * i // threads for i in range(threads + 1)]
    parts = [(dst[a:b], src[a:b]) for a, b in zip(cuts, cuts[1:])]
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(reps):
            t = time.perf_counter()
            list(pool.map(lambda part: np.copyto(*part), parts))
            best = min(best, time.perf_counter() - t)
    return nbytes / best


class MemcpyLimit:
    """The memcpy limit of each thread count, measured again between the rows of a run and kept
    at its best, so that no row can pass it by the noise of one measurement."""

    def __init__(self, nbytes: int):
        self.nbytes, self.best = nbytes, {}

    def measure(self, threads: int) -> float:
        rate = memcpy_rate(self.nbytes, threads=threads)
        self.best[threads] = max(self.best.get(threads, 0.0), rate)
        return self.best[threads]

    def __call__(self, threads: int) -> float:
        return self.best.get(threads) or self.measure(threads)


# -- memory of the process tree --------------------------------------------------------------
def rollup(pid: int) -> dict[str, float]:
    """RSS and PSS of one process in MB ({} when it is gone)."""
    fields = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if parts[0] in ("Rss:", "Pss:"):
                    fields[parts[0][:-1].lower() + "_mb"] = int(parts[1]) / 1024
    except (OSError, IndexError, ValueError):
        return {}
    return fields


def tree_pids(root: int | None = None) -> list[int]:
    """This process and all its descendants (DataLoader workers, pool workers)."""
    root = root or os.getpid()
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return pids


def tree_memory(root: int | None = None) -> dict[str, float]:
    rows = [rollup(p) for p in tree_pids(root)]
    return {"rss_mb": sum(r.get("rss_mb", 0) for r in rows), "pss_mb": sum(r.get("pss_mb", 0) for r in rows),
            "processes": len(rows)}


class PeakMemory:
    """Samples the RSS and PSS of a process tree (this process's, or `root`'s) every `every_s` in
    a thread; keeps the peaks. PSS counts a shared page-cache page once across processes, RSS
    once per process that maps it."""

    def __init__(self, every_s: float = 0.05, root: int | None = None):
        self.every_s, self.root, self.peak_rss_mb, self.peak_pss_mb = every_s, root, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            m = tree_memory(self.root)
            self.peak_rss_mb = max(self.peak_rss_mb, m["rss_mb"])
            self.peak_pss_mb = max(self.peak_pss_mb, m["pss_mb"])
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def cpu_seconds() -> float:
    """User + system CPU of this process, its reaped children (DataLoader workers are reaped
    when an epoch's iterator ends) and its live descendants (persistent workers), each of
    these with its own reaped children: a worker's time counts once, alive or reaped."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    live, tick = 0, os.sysconf("SC_CLK_TCK")
    for pid in tree_pids()[1:]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # from field 3 (state) on: utime is field 14
            live += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime in clock ticks
        except (OSError, ValueError, IndexError):
            continue
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + live / tick


def disk_write_rate(folder: Path, nbytes: int = 256 << 20, chunk: int = 8 << 20) -> float:
    """Bytes/s this file system takes from one writer, fsync included (what a build's shards
    pay): `nbytes` of incompressible data written in `chunk`s to a file in `folder`, then
    fsynced; the file is removed."""
    block = os.urandom(chunk)
    path = Path(folder) / f".mmpack-disk-rate-{os.getpid()}"
    start = time.perf_counter()
    try:
        with open(path, "wb") as f:
            for _ in range(max(1, nbytes // chunk)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        return max(1, nbytes // chunk) * chunk / (time.perf_counter() - start)
    finally:
        path.unlink(missing_ok=True)


def evict(paths: Iterable[Path]) -> int:
    """Drop these files' pages from the page cache (posix_fadvise DONTNEED; no root needed, unlike
    /proc/sys/vm/drop_caches), written to disk first: dirty pages are not dropped. Returns the
    bytes evicted."""
    total = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def files_under(*roots: Path) -> list[Path]:
    return [p for root in roots for p in Path(root).rglob("*") if p.is_file()]


def dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in files_under(root))


def share_limit(share: float, url: str, cache_dir: Path, manifest) -> int:
    """The cache limit that holds `share` of a dataset's shard bytes beside its index files (which a
    cache entry keeps whole)."""
    from packer.remote import ShardCache

    return int(share * manifest.size_bytes) + ShardCache(url, cache_dir, manifest).index_bytes


# -- timed passes ----------------------------------------------------------------------------
def measure(make_iter: Callable[[], Iterable], count_of: Callable, *, passes: int, limit: int | None = None,
            cold_files: list[Path] | None = None) -> dict:
    """Median samples/s over `passes` passes after a warm-up pass (warm page cache), time to
    first batch and CPU s per 1000 samples; then one more pass for the peak RSS/PSS of the process
    tree (sampling costs CPU, so it never overlaps a timed pass); with `cold_files` first one
    pass right after evicting them from the page cache."""
    out: dict = {}
    if cold_files:
        evict(cold_files)
        n, seconds, _ = _one_pass(make_iter, count_of, limit)
        out["cold_samples_per_s"] = n / seconds
    _one_pass(make_iter, count_of, limit)  # warm-up: page cache, worker start, allocations
    rates, firsts, samples = [], [], 0
    cpu0 = cpu_seconds()
    for _ in range(passes):  # rates with nothing else running: the memory sampler costs CPU
        n, seconds, first = _one_pass(make_iter, count_of, limit)
        rates.append(n / seconds)
        firsts.append(first)
        samples += n
    cpu = cpu_seconds() - cpu0
    with PeakMemory() as mem:  # one more pass, for memory only
        _one_pass(make_iter, count_of, limit)
    out.update(samples_per_s=statistics.median(rates), first_batch_s=statistics.median(firsts),
               peak_rss_mb=mem.peak_rss_mb, peak_pss_mb=mem.peak_pss_mb,
               cpu_s_per_1000=1000 * cpu / max(samples, 1))
    return out


def first_pass_rate(make_loader: Callable[[], Iterable], count_of: Callable, *, tries: int = 3) -> float:
    """Samples/s of the first pass of a loader made fresh (the median of `tries` loaders): what a
    job that makes a loader per epoch, or runs one short epoch, gets."""
    rates = []
    for _ in range(tries):
        n, seconds, _ = _one_pass(make_loader, count_of, None)
        rates.append(n / seconds)
    return statistics.median(rates)


class MachineLoad:
    """The 1-minute load average at the start and the end of a run, against the cores: a busy
    machine makes every rate low, and the ratios between rows measured at different moments
    unreliable."""

    def __init__(self):
        self.cores = os.cpu_count() or 1
        self.start = os.getloadavg()[0]

    def report(self) -> dict:
        end = os.getloadavg()[0]
        # the run itself keeps about one core busy: more than that beside it is another load
        busy = max(self.start, end - 1) > 0.5 * self.cores
        return {"load_avg_1m_start": round(self.start, 2), "load_avg_1m_end": round(end, 2), "cores": self.cores,
                "busy": busy}


def load_line(load: dict | None) -> str:
    """The table's line on the machine's load during the run."""
    if not load:
        return ""
    line = (f"machine load: 1-min load average {load['load_avg_1m_start']:.2f} at the start, "
            f"{load['load_avg_1m_end']:.2f} at the end, {load['cores']} cores")
    if load["busy"]:
        line += ("; the machine was busy with other work: rates are low and ratios between rows may not hold, "
                 "run again on a quiet machine")
    return line


def _one_pass(make_iter, count_of, limit) -> tuple[int, float, float]:
    start = time.perf_counter()
    first, n = None, 0
    for batch in make_iter():
        if first is None:
            first = time.perf_counter() - start
        n += count_of(batch)
        if limit and n >= limit:
            break
    return n, time.perf_counter() - start, first or 0.0


# -- two loaders compared in one run -------------------------------------------------------
def best_rate(loader, passes: int = 4) -> float:
    """Images/s of the best of `passes` passes of `loader`."""
    best = 0.0
    for _ in range(passes):
        start = time.perf_counter()
        n = sum(len(b["label"]) for b in loader)
        best = max(best, n / (time.perf_counter() - start))
    return best


def alternated(one, other, rounds: int, say=None) -> list[float]:
    """`other`'s rate over `one`'s (Loaders), each the best of 4 passes, in `rounds` rounds that
    alternate them: a shared machine's load moves both alike, where two rows timed minutes
    apart differ by more than the gap measured."""
    best_rate(one), best_rate(other)  # first maps, allocations
    shares = []
    for r in range(rounds):
        a, b = best_rate(one), best_rate(other)
        shares.append(b / a)
        if say:
            say(f"round {r}: {a:,.0f} images/s, then {b:,.0f} = {100 * b / a:.0f}%")
    return shares


def raw_get_rate(url: str, manifest, threads: int, into: Path | None = None, most_bytes: int | None = None) -> float:
    """Bytes/s of GETs of every data file of the dataset (`most_bytes`: its largest, up to about
    that much), `threads` at once, into memory, or `into` new files in that folder (then
    removed): what the node's disk lets a cold cache take."""
    import obstore as obs

    from packer.remote import client
    from packer.remote.url import Remote

    remote = Remote(url)
    store = client.store(remote)
    files = [f for s in manifest.shards for f in s.files]
    if most_bytes is not None:
        files.sort(key=lambda f: -f.size_bytes)
        ends = list(itertools.accumulate(f.size_bytes for f in files))
        files = files[:max(1, bisect.bisect_left(ends, most_bytes))]

    def get(entry) -> int:
        if into is None:
            return sum(len(chunk) for chunk in client.get(obs, store, remote.key(entry.path)))
        with open(into / entry.path.replace("/", "-"), "wb") as f:
            for chunk in client.get(obs, store, remote.key(entry.path)):
                f.write(chunk)
            return f.tell()
    if into is not None:
        into.mkdir(parents=True)
    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            nbytes = sum(pool.map(get, files))
        return nbytes / (time.perf_counter() - start)
    finally:
        if into is not None:
            shutil.rmtree(into)
