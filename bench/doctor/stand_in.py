"""A loop with a stand-in step (a sleep, a spin, or a real step), timed by the doctor's watch:
what `bench loaders --step-ms` and `bench sweep` report for each loader."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from .codec import to_json
from .report import Stats, share
from .watching import Watch


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
    waited = share(wait, worked)
    return {"steps": len(pairs), "step_ms": step_ms, "mode": "model" if step else mode, "wait_s": wait,
            "step_s": worked, "wait_share": waited, "wait": to_json(Stats.of([a for a, _ in pairs])),
            "gpu_util_pct": 100 * (1 - waited) if pairs else None}


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
