"""A watched loop's figures made a Report: the probes after the loop, the trials where it waited,
then the verdict and the rates the plot compares."""

from __future__ import annotations

import dataclasses

from .probes import ceiling, per_sample
from .report import Loop, OptimizerSteps, Probes, Rate, Report, Run, Trials
from .trials import best, loader_alternatives, packed, persistent, workers_sweep
from .verdict import DATA_BOUND, decide, from_steps, nothing_iterated


def diagnose(loader, *, loop: Loop | None, run: Run, batches: int, wall_s: float, measure: bool = True,
             steps: OptimizerSteps | None = None) -> Report:
    """The report on `loader`'s watched `loop` (None: no loader was iterated; the optimizer's
    `steps` then judge, where it stepped). `measure`: the loader is measured alone after the
    loop, and, where the loop waited, with each fix."""
    if loop is None:
        verdict = from_steps(steps) if steps and steps.steps > 1 else nothing_iterated(run)
        return Report(batches=batches, wall_s=wall_s, run=run, steps=steps, verdict=verdict)
    probes = Probes(per_sample=per_sample(loader), loader_alone=ceiling(loader) if measure else None)
    try_fixes = measure and loop.wait_share > DATA_BOUND
    sweep = workers_sweep(loader) if try_fixes else None
    trials = Trials(workers_sweep=sweep, more_workers=best(sweep), packed=packed(loader) if try_fixes else None,
                    persistent=persistent(loader) if try_fixes else None,
                    loader_alternatives=loader_alternatives(loader) if try_fixes else None)
    measured = Report(batches=batches, wall_s=wall_s, run=run, loop=loop, steps=steps, probes=probes, trials=trials,
                      verdict="")
    said, fixes = decide(measured)
    return dataclasses.replace(measured, verdict=said, fixes=fixes, rates=rates(measured))


def rates(r: Report) -> list[Rate]:
    """Samples/s of the model (its steps alone) against the loader's ceiling and what each
    measured fix made alone: the plot's second panel."""
    probes, trials = r.probes or Probes(), r.trials or Trials()
    wider, alternatives = trials.more_workers, trials.loader_alternatives

    def rate(part) -> float | None:
        return part.samples_per_s if part else None
    named = [("the model (its steps)", r.loop.model_samples_per_s),
             ("the loader alone", rate(probes.loader_alone)),
             (f"num_workers={wider.num_workers if wider else None} alone", rate(wider)),
             ("persistent_workers alone", rate(trials.persistent)),
             ("more gather threads alone", rate(alternatives and alternatives.more_threads)),
             ('bucket_by="aspect" alone', rate(alternatives and alternatives.bucketed)),
             ("packed, Loader alone", rate(trials.packed))]
    return [Rate(what=what, samples_per_s=value) for what, value in named if value]
