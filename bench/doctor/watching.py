"""The watch over a loop: each next() a wait, each gap between batches a step, per loader, with
the run's processes, GPU and copies beside; `watch()` for a loop in this process. Its figures go
to `diagnosis.diagnose` for the report."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

from .codec import to_json
from .diagnosis import diagnose
from .gpu import Copies, CudaMarks, Nvml
from .hooks import loader_classes, patched
from .probes import batch_len, caches, padding_of
from .processes import Processes
from .rerun import Kept
from .report import Loop, PaddingShare, RemoteTraffic, Report, Run, Stats, StepTime, share
from .steps import Steps


class Stop(BaseException):
    """Raised in the script at the step limit: a BaseException, so its own `except Exception`
    does not swallow it."""


class Watch:
    """The waits and steps of the loaders iterated while it is active."""

    def __init__(self, steps: int | None = None, *, processes: bool = True, replay: int | None = None):
        self.steps, self.by_loader = steps, {}
        self.kept = Kept(replay) if replay else None  # a replay's batches (`rerun`): the loop's ceiling
        self.started = time.perf_counter()
        self.cpu_started = time.process_time()
        self.error: str | None = None
        self.processes = Processes() if processes and Path("/proc/self/stat").exists() else None
        self.nvml = Nvml.start() if processes else None
        self.copies = Copies(self.kept)
        self.optimizer = Steps(on_step=self._stepped)
        self.progress = _nothing  # called at each ask, batch and optimizer step (the child's watchdog)
        self.stopped = False  # the step limit reached: the loop's end is the doctor's own

    def _stepped(self) -> None:
        """After an optimizer's step: a loop that iterates no loader stops at the step limit."""
        self.progress()
        if self.steps is not None and not self.by_loader and len(self.optimizer.times) >= self.steps:
            self.stopped = True
            raise Stop

    def iterate(self, loader, it):
        """`it` (the loader's iterator), timed: each next() is a wait, each gap between a batch
        handed over and the next asked for is a step."""
        rec = self.by_loader.setdefault(id(loader), {"loader": loader, "waits": [], "steps": [], "samples": 0,
                                                     "cuda": CudaMarks(), "remote": _node_traffic(loader)})
        last = None
        rec.setdefault("starts", []).append(len(rec["waits"]))  # this pass's first wait: an epoch's start
        while True:
            asked = time.perf_counter()
            self.progress()
            rec["cuda"].mark("end")
            if last is not None:
                rec["steps"].append(asked - last)
                rec["last_asked_at"] = asked
            if self.steps is not None and self.batches() >= self.steps:
                self.stopped = True
                raise Stop
            try:
                batch = self._next(it)
            except StopIteration:
                return
            last = time.perf_counter()
            self.progress()
            rec.setdefault("first_batch_at", last)  # the loop's window, for the GPU's samples
            rec["cuda"].mark("start")
            self.copies.active = True
            rec["waits"].append(last - asked)
            rec["samples"] += batch_len(batch)
            _count_padding(rec, loader, batch)
            yield batch

    def _next(self, it):
        """The loader's next batch; in a replay, its first ones kept, then served again and again."""
        kept = self.kept
        if kept is None:
            return next(it)
        if not kept.full():
            try:
                batch = next(it)
            except StopIteration:
                if not kept.batches:
                    raise
                kept.count = len(kept.batches)  # an epoch shorter than the batches asked for
            else:
                kept.keep(batch)
                return batch
        return kept.next()

    def batches(self) -> int:
        return sum(len(r["waits"]) for r in self.by_loader.values())

    def main(self) -> dict | None:
        """The record of the loader iterated most."""
        return max(self.by_loader.values(), key=lambda r: len(r["waits"]), default=None)

    def report(self, *, ceiling: bool = True) -> dict:
        """`diagnose`'s report in its JSON form, as `bench doctor --json` writes it."""
        return to_json(self.diagnose(ceiling=ceiling))

    def diagnose(self, *, ceiling: bool = True, probes: bool = True) -> Report:
        """The report on what was watched; `ceiling`: with the loader measured alone after it;
        `probes`: with any run of the loader after the loop (none where it hung)."""
        main = self.main()
        wall = time.perf_counter() - self.started
        loop_s = sum(main["waits"]) + sum(main["steps"]) if main else wall  # before the measures that follow
        run = Run(cuda=_cuda(), cpu_s_main=time.process_time() - self.cpu_started, error=self.error,
                  cores=os.cpu_count(), processes=self.processes.report(loop_s) if self.processes else None,
                  gpu=self.nvml.report(*_window(main)) if self.nvml else None)
        return diagnose(main["loader"] if main else None, loop=self._loop(main) if main else None, run=run,
                        batches=self.batches(), wall_s=wall, measure=ceiling, steps=self.optimizer.figures(),
                        probes=probes)

    def _loop(self, main: dict) -> Loop:
        """The loop's figures. The first wait is the loader's start-up, left out; the first wait
        of each later pass is an epoch's start (workers started again, a first batch made),
        counted in the waiting and also apart, so that waiting mostly there is said so."""
        starts = set(main.get("starts", [0]))
        waits = main["waits"][1:]
        again = [w for i, w in enumerate(main["waits"]) if i in starts and i > 0]
        steps = main["steps"]
        work, batches = sum(steps), len(main["waits"])
        per_batch = main["samples"] / batches if batches else 0
        return Loop(loader=type(main["loader"]).__name__, wait=Stats.of(waits), step=Stats.of(steps),
                    cuda_events=main["cuda"].report(), copies=self.copies.report(batches),
                    first_batch_s=main["waits"][0] if main["waits"] else None, wait_share=share(sum(waits), work),
                    epoch_starts=Stats.of(again) if again else None,
                    epoch_start_share=share(sum(again), sum(waits) - sum(again) + work) if again else None,
                    samples=main["samples"], model_samples_per_s=per_batch * len(steps) / work if work > 0 else None,
                    per_step=[StepTime(wait_ms=1e3 * a, step_ms=1e3 * b) for a, b in zip(waits, steps)],
                    batch_size=getattr(main["loader"], "batch_size", None),
                    kept=len(self.kept.batches) if self.kept is not None else None,
                    remote=_remote(main["remote"], _node_traffic(main["loader"]), sum(waits) + work),
                    padding=_padding(main))


def _nothing() -> None:
    pass


def _count_padding(rec: dict, loader, batch) -> None:
    """Add a batch's real and padded elements to the loader's record, where it says them."""
    got = padding_of(loader, batch)
    if got is not None:
        column, real, padded = got
        _, real_before, padded_before = rec.get("padding", (column, 0, 0))
        rec["padding"] = (column, real_before + real, padded_before + padded)


def _padding(rec: dict) -> PaddingShare | None:
    if "padding" not in rec:
        return None
    column, real, padded = rec["padding"]
    return PaddingShare(column=column, real=real, padded=padded, share=1 - real / padded if padded else 0.0)


def _node_traffic(loader) -> dict:
    return {url: cache.here().traffic.node() for url, cache in caches(loader).items()}


def _remote(before: dict, after: dict, loop_s: float) -> RemoteTraffic | None:
    """What came over the link between the two counts (None: no dataset in object storage),
    and its rate over the loop's `loop_s`, for the node and per GPU on it."""
    if not after:
        return None
    from packer.remote.traffic import FIELDS

    sums = {k: sum(after[u][k] - before.get(u, {}).get(k, 0) for u in after) for k in FIELDS}
    return RemoteTraffic(urls=sorted(after), **sums, bytes_per_s=sums["bytes"] / loop_s if loop_s > 0 else None,
                         gpus_on_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _window(main: dict | None) -> tuple[float | None, float | None]:
    """The watched loop's first batch and last ask (perf_counter); None where it has none."""
    return (main.get("first_batch_at"), main.get("last_asked_at")) if main else (None, None)


@contextmanager
def watch(loader=None, *, steps: int | None = None):
    """Watch the loaders iterated inside the block (`loader`: only to name what is watched);
    `w.report()` afterwards gives the same report as `bench doctor`."""
    w = Watch(steps)
    with patched(w, loader_classes()):
        try:
            yield w
        except Stop:
            pass
