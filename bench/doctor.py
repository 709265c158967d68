"""`bench doctor`: whether a training script's GPU (or CPU) waits for data, why, and what to try.

    bench doctor [--steps 50] [--json R.json] [--plot R.png] -- python train.py ARGS...
    with bench.doctor.watch(loader) as w:   # a loop that is not a script
        for batch in loader: ...
    print(w.report()["verdict"])
    bench.stall(loader, step_ms=20)         # a loop with a stand-in step of 20 ms: the same figures

The script runs unmodified in a child process (nothing of mmpack imported by it), with every
`torch.utils.data.DataLoader` and mmpack `Loader` it iterates watched: how long each `next()`
blocks (waiting for data) and how long the script works between batches (the step). After
`--steps` batches, or when the script ends or fails, the loader it iterated most is measured
alone for a few batches (its ceiling without the model), and for a map-style dataset the cost of
one `__getitem__` and of the collate. A partial run still gives its report.

`stall(loader, step_ms)` times the same way a loop with a stand-in step (a sleep, as while a GPU
works; a spin, as a CPU-bound step; or a real step): what `bench loaders --step-ms` and `bench
sweep` report for each loader on the sample data.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import io
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

DATA_BOUND = 0.10  # waiting more than this share of the loop: the data is what the step waits for
REPORT_ENV = "MMPACK_DOCTOR_REPORT"
STEPS_ENV = "MMPACK_DOCTOR_STEPS"
CEILING_BATCHES = 20
CEILING_S = 30.0
PER_SAMPLE_S = 5.0  # an iterable dataset's items are timed for at most this long (a stream may be slow to start)
AHEAD_OF_MODEL = 3.0  # a data-bound loader this much faster alone than the model: not its rate that waits
NAMED_GAIN = 1.1  # a measured fix is named where it makes the data at least this much faster: below, runs spread
NVML_PERIOD_S = 1.0  # the longest period one NVML utilisation reading covers


class _Stop(BaseException):
    """Raised in the script at the step limit: a BaseException, so its own `except Exception`
    does not swallow it."""


class Processes:
    """CPU seconds and bytes read from disk of this process and of every process it started
    (DataLoader workers), sampled from /proc while the loop runs: a worker's last sample stands
    for it once it is gone. Nothing where /proc is not there."""

    def __init__(self, every_s: float = 0.2):
        self.every_s, self.seen = every_s, {}  # pid -> (cpu_s, read_bytes)
        self.at_once = 0  # the most worker processes alive in one sample: a DataLoader's per epoch
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="mmpack-doctor")
        self.base = self._sample_one(os.getpid())
        # processes already there (a notebook's, a test's servers; a DataLoader's persistent
        # workers of an earlier epoch): only what they do while watched counts
        self.before = {pid: got for pid in _descendants(os.getpid()) if (got := self._sample_one(pid)) is not None}
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.sample()

    def sample(self) -> None:
        children = _descendants(os.getpid())
        for pid in [os.getpid(), *children]:
            got = self._sample_one(pid)
            if got is not None:
                self.seen[pid] = got
        self.at_once = max(self.at_once, sum(self._working(pid) for pid in children))

    def _working(self, pid: int) -> bool:
        """Started while watched, or busy since: an idle process that was already there is no worker."""
        return pid not in self.before or self.seen.get(pid, (0.0, 0))[0] > self.before[pid][0]

    def _sample_one(self, pid: int):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(stat[11]) + int(stat[12])) / self.tick
            io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
            return cpu, int(io.get("read_bytes", 0))
        except (OSError, ValueError, IndexError):
            return None

    def report(self, wall_s: float) -> dict:
        self.stop.set()
        self.sample()
        me = os.getpid()
        base_cpu, base_read = self.base or (0.0, 0)
        zero = (0.0, 0)
        workers = {pid: (v[0] - self.before.get(pid, zero)[0], v[1] - self.before.get(pid, zero)[1])
                   for pid, v in self.seen.items() if pid != me and self._working(pid)}
        cpu = sum(v[0] for v in workers.values())
        own = self.seen.get(me, (base_cpu, base_read))
        # busy over the workers alive together, not every pid seen: a DataLoader without
        # persistent_workers starts a new set each epoch
        at_once = min(len(workers), max(self.at_once, 1))
        return {"worker_processes": len(workers), "workers_at_once": at_once, "cpu_s_workers": cpu,
                "started": sum(pid not in self.before for pid in workers),
                "worker_cpu_busy": cpu / (wall_s * at_once) if workers and wall_s > 0 else None,
                "cpu_s_main_total": own[0] - base_cpu,
                "read_bytes": own[1] - base_read + sum(v[1] for v in workers.values())}


class Nvml:
    """The GPU's utilisation as NVML gives it (what nvidia-smi shows: the share of time a kernel
    ran), sampled while the loop runs, of the first device CUDA_VISIBLE_DEVICES names (else
    device 0). NVML only, never CUDA: a CUDA call here, before the script forks its workers,
    could keep them from using CUDA. `None` from `start()` where there is no NVML (no NVIDIA
    driver, or no `pip install nvidia-ml-py`)."""

    def __init__(self, nvml, handle, every_s: float):
        self.nvml, self.handle, self.every_s, self.samples = nvml, handle, every_s, []
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="mmpack-doctor-nvml").start()

    @classmethod
    def start(cls, every_s: float = 0.2) -> Nvml | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first)) if first.isdigit() else \
                pynvml.nvmlDeviceGetHandleByUUID(first)
            pynvml.nvmlDeviceGetUtilizationRates(handle)
            return cls(pynvml, handle, every_s)
        except Exception:  # noqa: BLE001 - no NVML here: the report says so
            return None

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                self.samples.append((time.perf_counter(), self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))
            except Exception:  # noqa: BLE001 - a sample missed is not the script's failure
                pass

    def report(self, start: float | None = None, end: float | None = None) -> dict:
        """Over the watched loop, from `start` to `end` (perf_counter), not the script's start-up
        (imports, data set-up, the model's first kernels), which would dilute the figure; the
        whole run's mean beside it. A reading covers NVML's own sample period before it (1/6 s
        to 1 s, by the product): the readings of the loop's first second, which still hold the
        idle time before it, are left out where later ones exist."""
        self.stop.set()
        every = [u for _, u in self.samples]
        whole = start is None or end is None  # no loop to bound it
        inside = [(t, u) for t, u in self.samples if whole or start < t <= end]
        settled = [u for t, u in inside if whole or t > start + NVML_PERIOD_S]
        ordered = sorted(settled or [u for _, u in inside])
        return {"samples": len(ordered), "util_mean_pct": sum(ordered) / len(ordered) if ordered else None,
                "util_p50_pct": ordered[len(ordered) // 2] if ordered else None,
                "run_samples": len(every), "run_util_mean_pct": sum(every) / len(every) if every else None,
                "readings": [[round(t - (start or 0.0), 2), u] for t, u in inside]}  # (s into the loop, %)


def _cuda_started() -> bool:
    """Whether the script has started CUDA itself: only then may the doctor make CUDA calls (its
    own first one, before the script forks its workers, could keep them from using CUDA)."""
    import torch

    return torch.cuda.is_initialized()


class CudaMarks:
    """The loop on the GPU's own clock: a CUDA event on the current stream where each batch is
    handed over ("start") and where the next is asked for ("end"). A stream runs its work in
    order, so from a step's end to the next batch's hand-over it has only what was queued before
    to do: where that is nothing, the GPU waited for the data (or for what `next()` queued, such
    as copies). That gap holds whatever the host's clock says of a script that queues its steps
    ahead. An epoch's end is marked "end" again where the next epoch's first batch is asked for:
    what the script did between (an evaluation pass, a checkpoint) is neither step nor wait, as on
    the host's clock. Recorded only once the script has started CUDA; at most MOST events."""

    MOST = 20_000

    def __init__(self):
        self.marks: list = []

    def mark(self, kind: str) -> None:
        if len(self.marks) < self.MOST and _cuda_started():
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((kind, event))

    def report(self) -> dict | None:
        """The GPU's time from each hand-over to the next ask (`busy`) and from each ask to the
        next hand-over (`gap`: a later epoch's first batch too); `gap_share` the gaps' share of both;
        `step` from one hand-over to the next within an epoch."""
        if not self.marks:
            return None
        import torch

        kinds = [k for k, _ in self.marks]
        steps, gaps, busy = [], [], []
        try:
            torch.cuda.synchronize()
            for i in range(len(kinds) - 1):
                a, b = self.marks[i][1], self.marks[i + 1][1]
                if kinds[i:i + 2] == ["start", "end"]:
                    busy.append(a.elapsed_time(b) / 1e3)
                elif kinds[i:i + 2] == ["end", "start"] and i:  # the first: the loader's start-up, as on the host
                    gaps.append(a.elapsed_time(b) / 1e3)
                    if kinds[i - 1] == "start":
                        steps.append(self.marks[i - 1][1].elapsed_time(b) / 1e3)
        except RuntimeError:  # events of two devices (a script that switched), a CUDA error: no figure
            return None
        if not steps:
            return None
        return {"steps": len(steps), "step": _stats(steps), "gap": _stats(gaps),
                "gap_share": _share(sum(gaps), sum(busy))}


class Copies:
    """Host-to-device copies made with `Tensor.to` or `Tensor.cuda` while watched: how many, their
    bytes, how many of those from pinned memory, and the host's time blocked in the calls (a copy
    from pageable memory blocks until it is done; a `non_blocking` one from pinned memory does
    not). No CUDA call: a copy is known by the result's device."""

    def __init__(self):
        self.copies = self.bytes = self.pinned_bytes = 0
        self.blocked_s = 0.0
        self.active = False  # from the loop's first batch on: not the model's move to the GPU

    def wrap(self, original):
        copies = self

        def method(tensor, *args, **kwargs):
            started = time.perf_counter()
            out = original(tensor, *args, **kwargs)
            if copies.active and out is not tensor and out.device.type == "cuda" and tensor.device.type == "cpu":
                copies.blocked_s += time.perf_counter() - started
                copies.copies += 1
                copies.bytes += tensor.nbytes
                copies.pinned_bytes += tensor.nbytes if tensor.is_pinned() else 0
            return out
        return method

    def report(self, batches: int) -> dict | None:
        if not self.copies:
            return None
        return {"copies": self.copies, "bytes": self.bytes, "bytes_per_batch": self.bytes / max(batches, 1),
                "pinned_share": self.pinned_bytes / self.bytes if self.bytes else None, "blocked_s": self.blocked_s}


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                children = []
            out += children
            todo += children
    return out


class Watch:
    """The waits and steps of the loaders iterated while it is active."""

    def __init__(self, steps: int | None = None, *, processes: bool = True):
        self.steps, self.by_loader = steps, {}
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()
        self.error: str | None = None
        self.processes = Processes() if processes and Path("/proc/self/stat").exists() else None
        self.nvml = Nvml.start() if processes else None
        self.copies = Copies()

    def iterate(self, loader, it):
        """`it` (the loader's iterator), timed: each next() is a wait, each gap between a batch
        handed over and the next asked for is a step."""
        rec = self.by_loader.setdefault(id(loader), {"loader": loader, "waits": [], "steps": [], "samples": 0,
                                                     "cuda": CudaMarks()})
        last = None
        while True:
            asked = time.perf_counter()
            rec["cuda"].mark("end")
            if last is not None:
                rec["steps"].append(asked - last)
                rec["last_asked_at"] = asked
            if self.steps is not None and self.batches() >= self.steps:
                raise _Stop
            try:
                batch = next(it)
            except StopIteration:
                return
            last = time.perf_counter()
            rec.setdefault("first_batch_at", last)  # the loop's window, for the GPU's samples
            rec["cuda"].mark("start")
            self.copies.active = True
            rec["waits"].append(last - asked)
            rec["samples"] += _batch_len(batch)
            yield batch

    def batches(self) -> int:
        return sum(len(r["waits"]) for r in self.by_loader.values())

    def main(self) -> dict | None:
        return max(self.by_loader.values(), key=lambda r: len(r["waits"]), default=None)

    def report(self, *, ceiling: bool = True) -> dict:
        return _report(self, ceiling=ceiling)


def _batch_len(batch) -> int:
    import torch

    first = batch
    while isinstance(first, (list, tuple, dict)) and first:
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return len(first) if isinstance(first, torch.Tensor) and first.dim() else 1


@contextmanager
def _patched(watch: Watch, classes):
    """`__iter__` of every one of `classes` and of each subclass with its own (torchdata's
    StatefulDataLoader, accelerate's, one the script defines while watched) returns a watched
    iterator while active. Only the class of the loader iterated watches: a subclass's
    `__iter__` that calls `super().__iter__()` is one wait a batch, not two."""
    saved = {}

    def wrap(original):
        def __iter__(self):
            it = original(self)
            return watch.iterate(self, it) if type(self).__iter__ is __iter__ else it
        return __iter__

    def patch(cls) -> None:
        if cls not in saved:
            saved[cls] = cls.__dict__.get("__iter__")
            cls.__iter__ = wrap(cls.__iter__)

    def patch_subclass(cls, **kwargs) -> None:
        if "__iter__" in cls.__dict__:
            patch(cls)

    import torch

    tensor_methods = {name: torch.Tensor.__dict__.get(name) for name in ("to", "cuda")}
    hooked = [cls for cls in classes if "__init_subclass__" not in cls.__dict__]
    for cls in classes:
        patch(cls)
        for sub in _subclasses(cls):
            patch_subclass(sub)
    for cls in hooked:
        cls.__init_subclass__ = classmethod(patch_subclass)
    for name in tensor_methods:
        setattr(torch.Tensor, name, watch.copies.wrap(getattr(torch.Tensor, name)))
    try:
        yield
    finally:
        for cls in hooked:
            del cls.__init_subclass__
        for cls, original in saved.items():
            if original is None:
                del cls.__iter__
            else:
                cls.__iter__ = original
        for name, original in tensor_methods.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


def _subclasses(cls) -> list:
    found, todo = [], list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        if sub not in found:
            found.append(sub)
            todo += sub.__subclasses__()
    return found


def _loader_classes() -> list:
    import torch

    classes = [torch.utils.data.DataLoader]
    try:
        from loaders import Loader

        classes.append(Loader)
    except ImportError:  # the script's environment may lack mmpack's loaders: DataLoader alone
        pass
    return classes


@contextmanager
def watch(loader=None, *, steps: int | None = None):
    """Watch the loaders iterated inside the block (`loader`: only to name what is watched);
    `w.report()` afterwards gives the same report as `bench doctor`."""
    w = Watch(steps)
    with _patched(w, _loader_classes()):
        try:
            yield w
        except _Stop:
            pass


# -- the report ---------------------------------------------------------------------------
def _stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(values), "total_s": sum(values), "p50_ms": 1e3 * ordered[len(ordered) // 2],
            "p95_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]}


def _share(wait: float, work: float) -> float:
    """The share of the loop spent waiting for the next batch."""
    return wait / (wait + work) if wait + work > 0 else 0.0


def _ceiling(loader, batches: int = CEILING_BATCHES, limit_s: float = CEILING_S) -> dict:
    """The loader alone: a fresh iterator, its first batch apart (workers starting), the next
    batches timed with nothing done between them, over as many epochs as it takes (each new
    epoch's start-up counted, as training meets it). At least `batches`, and three times what a
    DataLoader's workers make ahead: those are made while the first one is, and would arrive as
    if at no cost (16 workers on an epoch of 8 batches: every batch at once, a rate no loader
    keeps). Stopped past `limit_s` once `batches` are in."""
    ahead = (getattr(loader, "num_workers", 0) or 0) * (getattr(loader, "prefetch_factor", None) or 2)
    want = max(batches, 3 * ahead)
    try:
        it = iter(loader)
        first = time.perf_counter()
        next(it)
        started, samples, n = time.perf_counter(), 0, 0
        while n < want and not (n >= batches and time.perf_counter() - started > limit_s):
            batch = next(it, None)
            if batch is None:
                it = iter(loader)
                batch = next(it, None)
                if batch is None:
                    break
            samples += _batch_len(batch)
            n += 1
        seconds = time.perf_counter() - started
        return {"batches": n, "samples_per_s": samples / seconds if seconds > 0 and n else None,
                "first_batch_s": started - first}
    except Exception as exc:  # noqa: BLE001 - a loader that cannot be iterated again: said, not raised
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def _per_sample(loader) -> dict | None:
    """For a DataLoader: one sample's work (a map-style dataset's __getitem__, an iterable one's
    next item, up to PER_SAMPLE_S of them) and the collate of a batch, in this process (what each
    worker pays per sample)."""
    import torch

    if not isinstance(loader, torch.utils.data.DataLoader):
        return None
    ds = loader.dataset
    iterable = isinstance(ds, torch.utils.data.IterableDataset)
    if not iterable and not hasattr(ds, "__getitem__"):
        return None
    try:
        started = time.perf_counter()
        if iterable:  # the whole stream, as one worker sees it without get_worker_info()
            items = []
            for item in ds:
                items.append(item)
                if len(items) >= 64 or time.perf_counter() - started > PER_SAMPLE_S:
                    break
        else:
            items = [ds[i] for i in range(min(len(ds), 64))]
        n = len(items)
        item_s = (time.perf_counter() - started) / max(n, 1)
        collate = loader.collate_fn
        size = min(loader.batch_size or 1, n)
        started = time.perf_counter()
        if collate is not None and size:
            collate(items[:size])
        collate_s = (time.perf_counter() - started) / max(size, 1)
        return {"getitem_ms": 1e3 * item_s, "collate_ms_per_sample": 1e3 * collate_s, "iterable": iterable,
                "num_workers": loader.num_workers, "pin_memory": bool(loader.pin_memory),
                "batch_size": loader.batch_size, "dataset": type(ds).__name__}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def _workers_sweep(loader, share: float) -> list[dict] | None:
    """A data-bound DataLoader: the same dataset alone with 1, 2, 4, ... workers up to the cores,
    then the best count with prefetch_factor=4, so the fixes it suggests come with measured rates."""
    import torch

    cores = os.cpu_count() or 1
    if share <= DATA_BOUND or not isinstance(loader, torch.utils.data.DataLoader) or loader.num_workers >= cores \
            or loader.batch_size is None or isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return None

    def alone(workers: int, prefetch: int | None = None) -> dict:
        return {"num_workers": workers, "prefetch_factor": prefetch,
                **_ceiling(_clone(loader, num_workers=workers, prefetch_factor=prefetch))}
    counts = sorted({min(2 ** k, cores) for k in range(cores.bit_length() + 1)} | {cores})
    runs = [alone(n) for n in counts if n > loader.num_workers]
    best = _best(runs)
    if best is not None:
        runs.append(alone(best["num_workers"], 4))
    return runs


def _clone(loader, **changes):
    """The script's DataLoader again over its dataset, shuffled, with `changes` (the measured fixes):
    pinned as the script's is, so a fix is not credited with the pinning it leaves out."""
    import torch

    args = {"batch_size": loader.batch_size, "shuffle": True, "num_workers": loader.num_workers,
            "pin_memory": loader.pin_memory,
            "collate_fn": loader.collate_fn, "drop_last": loader.drop_last, "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context, "prefetch_factor": loader.prefetch_factor}
    return torch.utils.data.DataLoader(loader.dataset, **{**args, **changes})


def _persistent(loader) -> dict | None:
    """A DataLoader whose workers start again every epoch (no `persistent_workers`): the same
    loader alone with persistent_workers=True, over as many epochs as `_ceiling` takes (as the
    loader's own ceiling is), so that fix comes with a measured rate. On epochs long against
    the workers' start-up the two agree, and no fix is named."""
    import torch

    if not isinstance(loader, torch.utils.data.DataLoader) or not loader.num_workers or loader.persistent_workers \
            or loader.batch_size is None or isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return None
    clone = _clone(loader, persistent_workers=True)
    try:
        return {"num_workers": loader.num_workers, **_ceiling(clone)}
    finally:
        del clone  # its workers end with it


BUCKET_PADDING = 0.3  # a keep-aspect Loader's canvas this much padding: grouping by aspect is measured


def _loader_alternatives(loader) -> dict | None:
    """A data-bound `loaders.Loader`, measured alone as it could be set: with a gather thread per
    core where it has fewer, and, where its batches are keep-aspect canvases mostly of padding,
    grouped by aspect (`bucket_by="aspect"`: a smaller canvas to gather and to copy)."""
    try:
        from loaders import Loader
        from packer.system import available_cores
    except ImportError:
        return None
    if not isinstance(loader, Loader):
        return None
    out: dict = {"num_threads": loader.num_threads}
    cores = available_cores()
    if loader.num_threads < cores:
        before, loader.num_threads = loader.num_threads, cores
        try:
            out["more_threads"] = {"num_threads": cores, **_ceiling(loader)}
        finally:
            loader.num_threads = before
    try:
        batch = next(iter(loader))
        sizes, canvas = batch["image_size"].cpu(), batch["image"].shape
    except Exception:  # noqa: BLE001 - not an image canvas (tokens, fixed-size images): nothing to group
        return out
    out["padding"] = 1 - float(sizes.prod(1).sum()) / (canvas[0] * canvas[1] * canvas[2])
    if out["padding"] > BUCKET_PADDING and hasattr(loader.source, "shapes_of"):
        try:
            with Loader(loader.source, loader.batch_size, seed=0, bucket_by="aspect", device=loader.device,
                        num_threads=loader.num_threads) as grouped:
                out["bucketed"] = _ceiling(grouped)
        except Exception as exc:  # noqa: BLE001 - a fix it could not measure is said, not raised
            out["bucketed"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return out


def _best(runs: list[dict] | None) -> dict | None:
    """The fastest of the sweep's runs at the default prefetch_factor."""
    rated = [r for r in runs or [] if r.get("samples_per_s") and r.get("prefetch_factor") is None]
    return max(rated, key=lambda r: r["samples_per_s"], default=None)


PACK_SAMPLE = 512  # files of an image folder packed to measure what packing gives


def _packed(loader) -> dict | None:
    """For a DataLoader over an image folder (ImageFolder's `root` and `samples`): up to
    PACK_SAMPLE of its files packed with `packer build` at the size its samples have, then
    `loaders.Loader` over them alone, so the "pack the data" fix comes with a measured rate."""
    import torch

    samples = getattr(getattr(loader, "dataset", None), "samples", None)
    if not isinstance(loader, torch.utils.data.DataLoader) or not isinstance(samples, list) or not samples:
        return None
    try:
        first = loader.dataset[0]
        image = first.get("image") if isinstance(first, dict) else first[0]
        side = max(int(d) for d in image.shape if int(d) > 4)  # HWC or CHW: the larger spatial side
        with tempfile.TemporaryDirectory(prefix="mmpack-doctor-") as tmp:
            raw, out = Path(tmp) / "raw", Path(tmp) / "out"
            step = max(len(samples) // PACK_SAMPLE, 1)
            for i, (path, _) in enumerate(samples[::step][:PACK_SAMPLE]):
                link = raw / Path(path).parent.name / f"{i:06d}{Path(path).suffix}"
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(Path(path).resolve())
            from packer.cli import main as packer

            with contextlib.redirect_stdout(io.StringIO()):  # the script's output is the user's, not ours
                built = packer(["build", str(raw), str(out), "--image-size", str(side), "-q"])
            if built != 0:
                return {"error": "packer build of a sample of the folder failed"}
            from loaders import Loader, MMapDataset

            ds = MMapDataset(out)
            with Loader(ds, loader.batch_size or 64, seed=0, columns=["image", "label"]) as packed:
                return {"files": len(ds), "image_size": side, **_ceiling(packed)}
    except Exception as exc:  # noqa: BLE001 - a fix it could not measure is said, not raised
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _report(w: Watch, *, ceiling: bool) -> dict:
    main = w.main()
    wall = time.perf_counter() - w.started
    loop = sum(main["waits"]) + sum(main["steps"]) if main else wall  # the watched loop, before the measures below
    out = {"batches": w.batches(), "wall_s": wall, "cuda": _cuda(),
           "cpu_s_main": time.process_time() - w.cpu_started, "error": w.error, "cores": os.cpu_count(),
           "processes": w.processes.report(loop) if w.processes else None,
           "gpu": w.nvml.report(*_window(main)) if w.nvml else None}
    if main is None:
        children = (out["processes"] or {}).get("started")
        out["verdict"] = "no DataLoader or Loader was iterated" + (
            f" (the script failed: {w.error})" if w.error else
            f" in the script's own process; it started {children} process(es), which the doctor does not watch "
            "(torch.multiprocessing.spawn, a launcher): watch one rank's loop in the script's process, or "
            "bench.doctor.watch() inside it" if children else "")
        return out
    waits, steps = main["waits"][1:], main["steps"]  # the first wait is the loader's start-up
    wait, work = sum(waits), sum(steps)
    share = _share(wait, work)
    batches = len(main["waits"])
    per_batch = main["samples"] / batches if batches else 0
    model_rate = per_batch * len(steps) / work if work > 0 else None
    loader = main["loader"]
    out.update({"loader": type(loader).__name__, "wait": _stats(waits), "step": _stats(steps),
                "cuda_events": main["cuda"].report(), "copies": w.copies.report(batches),
                "first_batch_s": main["waits"][0] if main["waits"] else None, "wait_share": share,
                "samples": main["samples"], "model_samples_per_s": model_rate,
                "per_step": [{"wait_ms": 1e3 * a, "step_ms": 1e3 * b} for a, b in zip(main["waits"][1:], steps)],
                "per_sample": _per_sample(loader)})
    out["loader_alone"] = _ceiling(loader) if ceiling else None
    out["workers_sweep"] = _workers_sweep(loader, share) if ceiling else None
    out["more_workers"] = _best(out["workers_sweep"])
    out["packed"] = _packed(loader) if ceiling and share > DATA_BOUND else None
    out["persistent"] = _persistent(loader) if ceiling and share > DATA_BOUND else None
    out["loader_alternatives"] = _loader_alternatives(loader) if ceiling and share > DATA_BOUND else None
    out["verdict"], out["fixes"] = _verdict(out)
    out["rates"] = _rates(out)
    return out


def _window(main: dict | None) -> tuple[float | None, float | None]:
    """The watched loop's first batch and last ask (perf_counter); None where it has none."""
    return (main.get("first_batch_at"), main.get("last_asked_at")) if main else (None, None)


def _rates(r: dict) -> list[dict]:
    """Samples/s of the model (its steps alone) against the loader's ceiling and what each
    measured fix made alone: the plot's second panel."""
    wider, packed = r.get("more_workers") or {}, r.get("packed") or {}
    named = [("the model (its steps)", r.get("model_samples_per_s")),
             ("the loader alone", (r.get("loader_alone") or {}).get("samples_per_s")),
             (f"num_workers={wider.get('num_workers')} alone", wider.get("samples_per_s")),
             ("persistent_workers alone", (r.get("persistent") or {}).get("samples_per_s")),
             ("more gather threads alone", ((r.get("loader_alternatives") or {}).get("more_threads") or {}).get(
                 "samples_per_s")),
             ('bucket_by="aspect" alone', ((r.get("loader_alternatives") or {}).get("bucketed") or {}).get(
                 "samples_per_s")),
             ("packed, Loader alone", packed.get("samples_per_s"))]
    return [{"what": what, "samples_per_s": rate} for what, rate in named if rate]


def _verdict(r: dict) -> tuple[str, list[dict]]:
    """The verdict on a watched loop, and the fixes to try: the largest gain first; unmeasured,
    unestimated ones last."""
    alone = (r.get("loader_alone") or {}).get("samples_per_s")
    seen = _waited(r) + _rates_said(r, alone)
    fixes = [fix for fix in [_copies_fix(r)] if fix]
    # the GPU's own clock decides where there is one: a script that queues its steps ahead waits
    # on the host while its GPU still works
    events = r.get("cuda_events") or {}
    bound = events["gap_share"] if events else r["wait_share"]
    if bound <= DATA_BOUND:
        return f"compute-bound: {seen}: the data is not what the step waits for", fixes
    ps = r.get("per_sample") or {}
    if "getitem_ms" in ps:
        fixes += _dataloader_fixes(r, ps, alone)
        fixes += [fix for fix in [_pin_fix(r, ps, fixes)] if fix]
    alt = r.get("loader_alternatives") or {}
    if alt:
        fixes += _loader_fixes(alt, alone)
    fixes.sort(key=lambda f: -f.get("gain", 0.0))
    return f"data-bound: {seen}{_why(r, ps, alt, alone)}", fixes


def _waited(r: dict) -> str:
    """How long the loop waited, as the host's clock, NVML and the GPU's clock saw it, and what it
    copied to the GPU."""
    wait, events, copies = r["wait"], r.get("cuda_events") or {}, r.get("copies") or {}
    gpu = (r.get("gpu") or {}).get("util_mean_pct")
    return (f"{100 * r['wait_share']:.0f}% of the loop waiting for the next batch"
            + (f" (p50 {wait['p50_ms']:.1f} ms, p95 {wait['p95_ms']:.1f} ms)" if wait.get("n") else "")
            + (f", the GPU busy {gpu:.0f}% of the time (NVML)" if gpu is not None else "")
            + (f", its stream idle {100 * events['gap_share']:.0f}% of the loop between steps (CUDA events)"
               if events else "")
            + (f"; {copies['bytes_per_batch'] / 1e6:,.1f} MB copied to the GPU a batch, "
               f"{100 * copies['pinned_share']:.0f}% of it from pinned memory" if copies else ""))


def _rates_said(r: dict, alone: float | None) -> str:
    model = r.get("model_samples_per_s")
    return (f"; the loader alone makes {alone:,.0f} samples/s" if alone else "") + (
        f", the model takes {model:,.0f}/s" if model else "")


def _copies_fix(r: dict) -> dict | None:
    """Copies from pageable memory that blocked the loop a twentieth of its steps' time or more."""
    copies = r.get("copies") or {}
    if not (copies and copies["pinned_share"] < 0.5
            and copies["blocked_s"] > 0.05 * (r.get("step") or {}).get("total_s", 0)):
        return None
    return {"fix": "pin_memory=True and .to(device, non_blocking=True)",
            "expected": f"the {copies['blocked_s']:.2f} s the loop spent blocked in copies from pageable memory, "
                        "overlapped", "how": "estimated from the copies seen"}


def _work(ps: dict) -> str:
    """What makes one sample: a map-style dataset's __getitem__, an iterable one's iterator."""
    return "the dataset's iterator" if ps.get("iterable") else "__getitem__"


def _dataloader_fixes(r: dict, ps: dict, alone: float | None) -> list[dict]:
    """A DataLoader's fixes: more workers, packing, persistent workers, a deeper prefetch."""
    fixes = [_workers_fix(r, ps, alone), _pack_fix(r, ps, alone), _persistent_fix(r, alone), _prefetch_fix(r, alone)]
    return [fix for fix in fixes if fix]


def _workers_fix(r: dict, ps: dict, alone: float | None) -> dict | None:
    """More workers: measured where the sweep ran (named only where faster), else estimated."""
    workers, cores = ps["num_workers"], r.get("cores") or 1
    wider = (r.get("more_workers") or {}).get("samples_per_s")
    if wider and alone:
        if wider <= NAMED_GAIN * alone:
            return None
        return {"fix": f"num_workers={r['more_workers']['num_workers']} (now {workers})",
                "expected": f"{wider / alone:.1f}x the data rate ({wider:,.0f} samples/s alone)",
                "how": "measured: the same loader with 1, 2, 4, ... workers up to the cores, alone; the best",
                "gain": wider / alone}
    if workers >= cores:
        return None
    # not measured for an iterable dataset: more workers may each yield all of it
    gain = min(cores / max(workers, 1), 1 / max(1 - r["wait_share"], 1e-3))
    return {"fix": f"num_workers={cores} (now {workers})", "expected": f"up to {gain:.1f}x the data rate",
            "how": "estimated: the per-sample work spread over more processes" + (
                "; each worker must take its own part of the stream (get_worker_info())" if ps.get("iterable") else ""),
            "gain": gain}


def _pack_fix(r: dict, ps: dict, alone: float | None) -> dict:
    """Packing the data: measured on a sample of its files where that ran, else estimated."""
    fix = "pack the data once (packer build RAW OUT) and read it with loaders.Loader"
    packed = (r.get("packed") or {}).get("samples_per_s")
    if packed and alone:
        return {"fix": fix, "expected": f"{packed / alone:.1f}x the data rate ({packed:,.0f} samples/s alone)",
                "how": f"measured: {r['packed']['files']} of its files packed at {r['packed']['image_size']} px, "
                       "then Loader alone", "gain": packed / alone}
    work = _work(ps)
    return {"fix": fix, "expected": f"no decode per sample: the {ps['getitem_ms']:.2f} ms a sample {work} takes, gone",
            "how": f"estimated from {work} timed here; bench loaders measures it on sample data"}


def _persistent_fix(r: dict, alone: float | None) -> dict | None:
    steady = (r.get("persistent") or {}).get("samples_per_s")
    if not (steady and alone and steady > NAMED_GAIN * alone):
        return None
    return {"fix": "persistent_workers=True", "expected": f"{steady / alone:.1f}x the data rate "
            f"({steady:,.0f} samples/s alone): its workers start once, not every epoch",
            "how": "measured: the same loader so, alone, over as many epochs", "gain": steady / alone}


def _prefetch_fix(r: dict, alone: float | None) -> dict | None:
    """A deeper prefetch, named where it beats both the loader alone and the most workers."""
    deeper = next((x for x in r.get("workers_sweep") or [] if x.get("prefetch_factor") and x.get("samples_per_s")),
                  None)
    wider = (r.get("more_workers") or {}).get("samples_per_s") or 0
    if not (deeper and alone and deeper["samples_per_s"] > NAMED_GAIN * max(alone, wider)):
        return None
    return {"fix": f"prefetch_factor=4 with num_workers={deeper['num_workers']}",
            "expected": f"{deeper['samples_per_s'] / alone:.1f}x the data rate",
            "how": "measured: the same loader so, alone", "gain": deeper["samples_per_s"] / alone}


def _pin_fix(r: dict, ps: dict, fixes: list[dict]) -> dict | None:
    """Pinned memory where there is a GPU to copy to and no fix named pins already."""
    if ps.get("pin_memory") or not r.get("cuda") or any(f["fix"].startswith("pin_memory") for f in fixes):
        return None
    return {"fix": "pin_memory=True", "expected": "faster host-to-GPU copies", "how": "estimated"}


def _loader_fixes(alt: dict, alone: float | None) -> list[dict]:
    """The fixes a Loader's measured alternatives show, where they beat it alone by 10% or more."""
    fixes = []
    more = (alt.get("more_threads") or {}).get("samples_per_s")
    if more and alone and more > NAMED_GAIN * alone:
        fixes.append({"fix": f"num_threads={alt['more_threads']['num_threads']} (now {alt['num_threads']})",
                      "expected": f"{more / alone:.1f}x the data rate ({more:,.0f} samples/s alone)",
                      "how": "measured: the same Loader so, alone", "gain": more / alone})
    grouped = (alt.get("bucketed") or {}).get("samples_per_s")
    if grouped and alone and grouped > NAMED_GAIN * alone:
        fixes.append({"fix": 'bucket_by="aspect"', "expected": f"{grouped / alone:.1f}x the data rate "
                      f"({grouped:,.0f} samples/s alone): batches of one aspect, a canvas of less padding",
                      "how": "measured: a Loader so over the same dataset, alone", "gain": grouped / alone})
    return fixes


def _why(r: dict, ps: dict, alt: dict, alone: float | None) -> str:
    """Why the data is late: the sample's cost (a DataLoader) or the Loader's set-up, its workers'
    CPU, and whether the loader's rate alone is even the cause."""
    why = (f"; {_work(ps)} takes {ps['getitem_ms']:.2f} ms a sample and the collate "
           f"{ps['collate_ms_per_sample']:.2f} ms, on {ps['num_workers']} worker(s)") if "getitem_ms" in ps else ""
    if alt:
        why = f"; a Loader with {alt['num_threads']} gather thread(s)" + (
            f", {100 * alt['padding']:.0f}% of its canvas padding" if "padding" in alt else "")
    busy = (r.get("processes") or {}).get("worker_cpu_busy")
    if busy is not None and "getitem_ms" in ps:  # a DataLoader's workers, not a script's other child processes
        why += f" at {100 * busy:.0f}% CPU each"
    return why + _ahead(r, alone)


def _ahead(r: dict, alone: float | None) -> str:
    """A loader far faster alone than the model: the wait is what runs beside the step, not its rate."""
    model = r.get("model_samples_per_s")
    if not (alone and model and alone > AHEAD_OF_MODEL * model):
        return ""
    return (f"; alone it makes {alone / model:.0f}x what the model takes, so the wait is not its rate but "
            f"what changes beside the step: the {r.get('cores') or 1} core(s) it shares with the step, "
            "epoch starts, the hand-over of each batch")


def text(r: dict) -> str:
    lines = [r["verdict"]]
    if r.get("error"):
        lines.append(f"the script stopped early: {r['error']} (the report covers what ran)")
    for i, f in enumerate(r.get("fixes") or [], 1):
        lines.append(f"  {i}. {f['fix']}: {f['expected']} ({f['how']})")
    if "step" in r:
        lines.append(f"{r['batches']} batches of {r['loader']}: step p50 {r['step'].get('p50_ms', 0):.1f} ms, "
                     f"wait p50 {r['wait'].get('p50_ms', 0):.1f} ms; first batch after {r['first_batch_s']:.2f} s")
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    from .report import _plt

    plt = _plt()
    steps = r.get("per_step") or []
    rates = r.get("rates") or []
    fig, axes = plt.subplots(1, 2, figsize=(14, 4), gridspec_kw={"width_ratios": [2, 1]})
    ax, side = axes
    x = range(1, len(steps) + 1)
    work = [s["step_ms"] for s in steps]
    ax.bar(x, work, color="#4c72b0", label="working (the step)")
    ax.bar(x, [s["wait_ms"] for s in steps], bottom=work, color="#dd8452", label="waiting for the batch")
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("each step: working and waiting", fontsize=10)
    totals = sorted(w + s["wait_ms"] for w, s in zip(work, steps))
    if totals and totals[-1] > 0:
        # a step or two far above the rest (the first, with its warm-up) would flatten every other
        # bar: the scale is the 99th percentile's, and a bar above it says its height in ms
        p99 = totals[(99 * (len(totals) - 1)) // 100]
        top = totals[-1] if totals[-1] <= 3 * p99 else p99
        ax.set_ylim(0, 1.25 * top)  # head room: the legend above the bars, not over them
        for i, (w, s) in enumerate(zip(work, steps), 1):
            if w + s["wait_ms"] > 1.25 * top:
                ax.annotate(f"{w + s['wait_ms']:,.0f} ms", (i + 0.8, 1.12 * top), ha="left", va="center", fontsize=8)
    ax.legend(loc="upper right", ncol=2)
    side.barh([x["what"] for x in rates][::-1], [x["samples_per_s"] for x in rates][::-1],
              color=["#888" if x["what"].startswith("the model") else "#4c72b0" for x in rates][::-1])
    side.set_xlabel("samples/s")
    side.xaxis.set_major_formatter(lambda v, _: f"{v / 1e3:g}k" if v else "0")
    side.set_title("the model against the loader's ceiling", fontsize=10)
    fig.suptitle(textwrap.fill(r["verdict"].split(";")[0], 150, max_lines=2), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- a loop with a stand-in step ----------------------------------------------------------------
def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _epochs(w: Watch, loader: Iterable, again: bool):
    """`loader`'s batches, watched; `again`: epoch after epoch as training takes them (not an
    iterator's, nor a loader's that gives none)."""
    while True:
        got = False
        for batch in w.iterate(loader, iter(loader)):
            got = True
            yield batch
        if not (again and got) or isinstance(loader, Iterator):
            return


def stall(loader: Iterable, step_ms: float, *, steps: int | None = None, mode: str = "sleep",
          step: Callable[[object], None] | None = None, warmup: int = 2) -> dict:
    """`loader` (any iterable: ours, a DataLoader, a peer's) run as a training loop, with a step
    of `step_ms` per batch, timed as the doctor times a script: each `next()` a wait, each gap
    between batches a step; `steps` of them after `warmup` batches (workers starting), else one
    pass. Mode "sleep" frees the CPU during the step, as while a GPU works; "busy" spins a core,
    a CPU-bound step; `step(batch)` runs a real one. `wait_share`: waiting over waiting and
    working; `gpu_util_pct`: the utilisation nvidia-smi would show were the step the GPU's work."""
    work = step or (lambda _: _busy(step_ms / 1000) if mode == "busy" else time.sleep(step_ms / 1000))
    w = Watch(processes=False)
    taken = 0
    for batch in _epochs(w, loader, again=steps is not None):
        if steps is not None and taken == warmup + steps:
            break  # asking for this batch timed the last step
        if taken >= warmup:  # the warm-up batches are taken as they come: worker start-up is not a stall
            work(batch)
        taken += 1
    rec = w.main() or {"waits": [], "steps": []}
    pairs = list(zip(rec["waits"], rec["steps"]))[warmup:]  # the last batch of a pass ended has its step too
    wait, worked = sum(a for a, _ in pairs), sum(b for _, b in pairs)
    share = _share(wait, worked)
    return {"steps": len(pairs), "step_ms": step_ms, "mode": "model" if step else mode, "wait_s": wait,
            "step_s": worked, "wait_share": share, "wait": _stats([a for a, _ in pairs]),
            "gpu_util_pct": 100 * (1 - share) if pairs else None}


# -- running a script -------------------------------------------------------------------------
def child_main(argv: list[str]) -> None:
    """In the child: run the script (`SCRIPT ARGS`, `-m MODULE ARGS` or `-c CODE ARGS`) as
    __main__, as `python` would, with its loaders watched, then write the report."""
    steps = int(os.environ[STEPS_ENV]) if os.environ.get(STEPS_ENV) else None
    w = Watch(steps)
    with _patched(w, _loader_classes()):
        try:
            _run_main(argv)
        except _Stop:
            pass
        except SystemExit as exc:
            if exc.code not in (None, 0):
                w.error = f"exit {exc.code}"
        except BaseException as exc:  # noqa: BLE001 - the script's failure is part of the report
            w.error = f"{type(exc).__name__}: {exc}"[:300]
    r = w.report()
    Path(os.environ[REPORT_ENV]).write_text(json.dumps(r, default=str))


def _run_main(argv: list[str]) -> None:
    """`argv` run as `python ARGV` runs it: sys.argv, sys.path[0] and the __main__ module as that
    interpreter sets them. The script's module stays __main__ after it ends, as it does in python:
    the loader measured alone afterwards pickles the script's classes for its workers (spawn,
    forkserver) by their names in __main__."""
    if argv[0] == "-m":  # sys.path[0] is the working directory, argv[0] the module's file
        _path_first(os.getcwd())
        spec = importlib.util.find_spec(argv[1])
        if spec is not None and spec.submodule_search_locations is not None:  # a package: its __main__
            spec = importlib.util.find_spec(f"{argv[1]}.__main__")
        if spec is None or spec.loader is None or spec.origin is None:
            raise ImportError(f"No module named {argv[1]}")
        sys.argv = [spec.origin, *argv[2:]]
        _exec_as_main(spec.loader.get_code(spec.name), spec.origin, spec)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        _exec_as_main(compile(argv[1], "<string>", "exec"), None, None)
    else:  # not the working directory: the script's own folder comes first on the path
        sys.argv = argv
        _path_first(str(Path(argv[0]).resolve().parent))
        if os.path.isfile(argv[0]) and not zipfile.is_zipfile(argv[0]):
            path = os.path.abspath(argv[0])  # __main__.__file__ is absolute from Python 3.9 on
            with io.open_code(path) as f:
                _exec_as_main(compile(f.read(), path, "exec"), path, None)
        else:  # a folder or zip with a __main__.py
            runpy.run_path(argv[0], run_name="__main__")


def _exec_as_main(code, file: str | None, spec) -> None:
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=file, __spec__=spec, __loader__=spec.loader if spec else None, __cached__=None,
                         __package__=spec.parent if spec else None, __builtins__=builtins)
    if file is None:
        del main.__file__
    sys.modules["__main__"] = main
    exec(code, main.__dict__)  # noqa: S102 - the user's own script, as python runs it


def _path_first(folder: str) -> None:
    """sys.path[0] as python sets it for what it runs: the child's own, from `-c`, is "" (the
    working directory); in safe-path mode (-P, -I) there is none, and none is added."""
    if sys.path[:1] == [""]:
        sys.path[0] = folder


# python's own options: those that take a value (-W default, -Wdefault), those that end the options
_OPTION_VALUE, _OPTION_TARGET = "WX", "mc"
LAUNCHERS = ("torchrun", "accelerate", "deepspeed", "mpirun", "srun", "lightning", "composer")


def python_command(command: list[str]) -> tuple[str, list[str], list[str]]:
    """(interpreter, its options, what it runs) of `python [OPTIONS] SCRIPT|-m MODULE|-c CODE ARGS`
    (`SCRIPT.py ARGS` alone: this Python). The options (-u, -O, -W ..., -X ...) go to the child's
    interpreter; what it runs is `SCRIPT ARGS`, `-m MODULE ARGS` or `-c CODE ARGS`."""
    usage = "give the training command after --, e.g. -- python train.py ARGS (or -- python -m pkg.train ARGS)"
    if not command:
        raise SystemExit(f"bench doctor: {usage}")
    if command[0].endswith(".py"):
        return sys.executable, [], command
    name = Path(command[0]).name
    if name in LAUNCHERS:
        raise SystemExit(f"bench doctor: {name} starts several processes and the doctor watches one: run one rank's "
                         "script, e.g. -- python train.py ARGS")
    version = name[len("python"):]
    if name != Path(sys.executable).name and not (name.startswith("python") and version.replace(".", "").isdigit()
                                                   or name == "python"):
        raise SystemExit(f"bench doctor: {command[0]} is not a Python interpreter: {usage}")
    options, rest = [], command[1:]
    while rest and rest[0].startswith("-") and rest[0] != "-":
        arg = rest.pop(0)
        if arg.startswith("--"):  # --check-hash-based-pycs MODE; the others take no value
            options += [arg, rest.pop(0)] if arg == "--check-hash-based-pycs" and rest else [arg]
            continue
        for i, flag in enumerate(arg[1:], 1):
            if flag in _OPTION_VALUE + _OPTION_TARGET:
                if i > 1:  # the flags before it: -uW ignore is -u -W ignore
                    options.append(arg[:i])
                value = arg[i + 1:] or (rest.pop(0) if rest else None)
                if value is None:
                    raise SystemExit(f"bench doctor: python's -{flag} needs a value: {usage}")
                if flag in _OPTION_TARGET:
                    return command[0], options, [f"-{flag}", value, *rest]
                options += [f"-{flag}", value]
                break
        else:
            options.append(arg)
    if not rest or rest[0] == "-":
        raise SystemExit(f"bench doctor: a script from standard input cannot be watched: {usage}")
    return command[0], options, rest


def _interpreter(given: str) -> tuple[str, str | None]:
    """(the Python to run the script with, a note): the one given where it can import this
    doctor and torch (the script's own environment), else this one, said."""
    found = shutil.which(given)
    if found is None:
        raise SystemExit(f"bench doctor: {given}: no such interpreter")
    if os.path.abspath(found) == os.path.abspath(sys.executable):
        return sys.executable, None
    probe = subprocess.run([found, "-c", "import sys, importlib.util as u; "  # found, not imported: torch takes seconds
                            "sys.exit(not (u.find_spec('torch') and u.find_spec('bench.doctor')))"], capture_output=True)
    if probe.returncode == 0:
        return found, None
    return sys.executable, (f"{found} cannot import mmpack's bench and torch (pip install them there): "
                            f"the script runs with {sys.executable}")


def run(command: list[str], *, steps: int | None) -> dict:
    """`command` (`python [OPTIONS] script.py ARGS`, `python -m MODULE ARGS`) in a child process
    with its loaders watched."""
    given, options, target = python_command(command)
    python, note = _interpreter(given)
    if note:
        print(f"bench doctor: {note}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="mmpack-doctor-") as tmp:
        out = Path(tmp) / "report.json"
        env = {**os.environ, REPORT_ENV: str(out), STEPS_ENV: str(steps or "")}
        started = time.perf_counter()
        proc = subprocess.run([python, *options, "-c", "import sys; from bench.doctor import child_main; "
                               "child_main(sys.argv[1:])", *target], env=env)
        if not out.exists():
            return {"verdict": f"the script ended (exit {proc.returncode}) before a report could be made",
                    "exit_code": proc.returncode, "wall_s": time.perf_counter() - started}
        r = json.loads(out.read_text())
    r.update(command=command, exit_code=proc.returncode, python=python)
    if note:
        r["note"] = note
    return r
