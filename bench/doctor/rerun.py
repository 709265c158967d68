"""The script run again, changed only inside the watched process, to confirm what the first run
predicted:

- **A fix confirmed.** A fix that is a loader's argument (`num_workers`, `persistent_workers`,
  `prefetch_factor`, `pin_memory`; a Loader's `num_threads`, `bucket_by`) is applied where the
  script builds the loader it iterated most (its class and batch size), by binding the script's
  own call to `__init__` and changing those arguments, and the loop's wait share and step rate
  are compared with the first run's. The user's files are never touched.
- **The ceiling with a loader that costs nothing (`--replay K`).** The loader's first K batches
  are kept and then served again and again, each tensor's copy to the device made once and
  given again (`Tensor.to`/`.cuda` of a kept tensor): the step rate of the same script with its
  data already there. The distance to the first run's rate is what the data costs the run.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from contextlib import contextmanager

from .report import Confirmed, Replay, Report

OVERRIDE_ENV = "MMPACK_DOCTOR_OVERRIDE"
REPLAY_ENV = "MMPACK_DOCTOR_REPLAY"


# -- in the parent: which runs, and what they showed ------------------------------------------
def steps_per_s(r: Report) -> float | None:
    """Iterations a second of a run's loop (its first batch aside): from the loader's waits and
    steps, else the optimizer's iterations."""
    if r.loop and r.loop.per_step:
        return rate(r.loop.per_step)
    if r.steps and r.steps.iteration.n and r.steps.iteration.total_s:
        return r.steps.iteration.n / r.steps.iteration.total_s
    return None


def override_env(r: Report, args: dict) -> dict:
    """The environment that makes the child build the loader `r` watched most with `args`."""
    return {OVERRIDE_ENV: json.dumps({"loader": r.loop.loader, "batch_size": r.loop.batch_size, "args": args})}


def confirmed(before: Report, after: Report) -> Confirmed | None:
    """The loop's wait and step rate without and with a fix (None: the rerun iterated no loop)."""
    if not (after.loop and after.loop.per_step):
        return None
    rate, rate_before = steps_per_s(after), steps_per_s(before)
    return Confirmed(wait_share_before=before.loop.wait_share, wait_share=after.loop.wait_share,
                     steps_per_s_before=rate_before, steps_per_s=rate,
                     speedup=rate / rate_before if rate and rate_before else None, error=after.run.error if after.run else None)


def replayed(before: Report, again: Report, asked: int) -> Replay | None:
    """The replay run's step rate over its served batches against the first run's over the same
    steps (both past the first `kept`: warm-up left out of both), with each run's step p50."""
    kept = (again.loop.kept if again.loop else None) or asked
    if not (again.loop and len(again.loop.per_step) > kept and before.loop and len(before.loop.per_step) > kept):
        return None
    served, yours = again.loop.per_step[kept:], before.loop.per_step[kept:]  # per_step starts at the second batch
    ceiling, mine = rate(served), rate(yours)
    return Replay(kept=kept, steps=len(served), steps_per_s=ceiling, yours_steps_per_s=mine,
                  data_cost=max(0.0, 1 - mine / ceiling) if ceiling and mine else None,
                  step_p50_ms=_p50([s.step_ms for s in served]), yours_step_p50_ms=_p50([s.step_ms for s in yours]))


def rate(steps) -> float | None:
    """Steps a second over `steps` (each a wait and a step, in ms)."""
    total_ms = sum(s.wait_ms + s.step_ms for s in steps)
    return 1e3 * len(steps) / total_ms if total_ms > 0 else None


def _p50(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


# -- in the child: the changes, applied while the script runs ---------------------------------
@contextmanager
def overridden(classes):
    """`__init__` of each of `classes` with the arguments of OVERRIDE_ENV, for the loader it names
    (its class, its batch size): the script's call bound to the signature, those arguments set."""
    spec = json.loads(os.environ[OVERRIDE_ENV]) if os.environ.get(OVERRIDE_ENV) else None
    if spec is None:
        yield
        return
    saved = {cls: cls.__dict__["__init__"] for cls in classes}

    def wrap(original):
        signature = inspect.signature(original)

        def __init__(self, *args, **kwargs):
            if type(self).__name__ == spec["loader"]:
                bound = signature.bind(self, *args, **kwargs)
                size = bound.arguments.get("batch_size", signature.parameters["batch_size"].default)
                if spec["batch_size"] is None or size == spec["batch_size"]:
                    bound.arguments.update(spec["args"])
                    args, kwargs = bound.args[1:], bound.kwargs
            original(self, *args, **kwargs)
        return __init__

    for cls, original in saved.items():
        cls.__init__ = wrap(original)
    try:
        yield
    finally:
        for cls, original in saved.items():
            cls.__init__ = original


def replay_count() -> int | None:
    got = os.environ.get(REPLAY_ENV)
    return int(got) if got else None


class Kept:
    """A replay's batches: the first `count` a loader hands over, then those again in turn, each
    a shallow copy (a script that pops a key of its dict batch leaves the kept one whole); and
    each kept tensor's copy to a device, made once (`device_copy`)."""

    def __init__(self, count: int):
        self.count, self.batches, self.served = count, [], 0
        self.tensors: dict[int, dict] = {}  # id of a kept tensor -> its copies by the call's arguments

    def keep(self, batch) -> None:
        import torch

        self.batches.append(batch)
        for t in _tensors(batch):
            if isinstance(t, torch.Tensor):
                self.tensors.setdefault(id(t), {})

    def full(self) -> bool:
        return len(self.batches) >= self.count

    def next(self):
        batch = self.batches[self.served % len(self.batches)]
        self.served += 1
        return copy.copy(batch) if isinstance(batch, (dict, list)) else batch

    def device_copy(self, tensor, args, kwargs, make):
        """A kept tensor's copy for `args`, made once; anything else made as asked."""
        copies = self.tensors.get(id(tensor))
        if copies is None:
            return make()
        try:
            key = (args, tuple(sorted(kwargs.items())))
            hash(key)
        except TypeError:
            return make()
        if key in copies:
            return copies[key]
        out = make()
        if out is not tensor and out.device != tensor.device:  # a copy to the device; a conversion in place stays the step's
            copies[key] = out
        return out


def _tensors(batch):
    if isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)
    else:
        yield batch
