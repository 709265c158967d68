"""A watched loop's figures made a Report: the probes after the loop, the trials where it waited,
then the verdict, the headline and the rates the plot compares (`judge`: from the figures alone)."""

from __future__ import annotations

import dataclasses

from .deadline import Hung, bounded
from .headline import Headline, headline
from .probes import ceiling, link_rate, per_sample
from .report import Loop, OptimizerSteps, Probes, Rate, Report, Run, Trials
from .trials import best, loader_alternatives, packed, persistent, workers_sweep
from .verdict import DATA_BOUND, decide, from_steps, nothing_iterated


def diagnose(loader, *, loop: Loop | None, run: Run, batches: int, wall_s: float, measure: bool = True,
             steps: OptimizerSteps | None = None, probes: bool = True) -> Report:
    """The report on `loader`'s watched `loop` (None: no loader was iterated; the optimizer's
    `steps` then judge, where it stepped). `measure`: the loader is measured alone after the
    loop, and, where the loop waited, with each fix; `probes`: False runs nothing of the loader
    (the loop hung in it). Each probe and trial has the deadline (`deadline.bounded`); after
    one that hung, no other runs: it would reach the same item."""
    if loop is None:
        return judge(Report(batches=batches, wall_s=wall_s, run=run, steps=steps, verdict=""))
    hung = [not probes]

    def run_(fn, what: str, when: bool = True):
        if hung[0] or not when:
            return None
        got = bounded(fn, loader, what=what)
        hung[0] = isinstance(got, Hung)
        return got
    found = Probes(per_sample=run_(per_sample, "one sample of the dataset"),
                   loader_alone=run_(ceiling, "the loader alone", measure))
    if loop.remote is not None:
        link = run_(link_rate, "GETs of the dataset's files", measure)
        loop = dataclasses.replace(loop, remote=dataclasses.replace(
            loop.remote, link_bytes_per_s=link if isinstance(link, float) else None))
    try_fixes = measure and loop.wait_share > DATA_BOUND
    sweep = run_(workers_sweep, "the loader with more workers", try_fixes)
    trials = Trials(workers_sweep=_answer(sweep), more_workers=best(_answer(sweep)),
                    packed=run_(packed, "a sample of its files packed", try_fixes),
                    persistent=_answer(run_(persistent, "the loader with persistent workers", try_fixes)),
                    loader_alternatives=_answer(run_(loader_alternatives, "the Loader with other settings", try_fixes)))
    return judge(Report(batches=batches, wall_s=wall_s, run=run, loop=loop, steps=steps, probes=found, trials=trials,
                        verdict=""))


def judge(r: Report) -> Report:
    """`r` with its verdict, fixes, rates and headline made from its figures alone: a pure function
    of the report (tests/test_doctor_verdict.py gives it recorded ones). Without a loop, the
    optimizer's steps judge where it stepped more than once."""
    if r.loop is None:
        judged = r.steps is not None and r.steps.steps > 1
        return dataclasses.replace(r, verdict=from_steps(r.steps) if judged else nothing_iterated(r.run),
                                   headline=_from_steps(r.steps) if judged and r.steps.samples else None)
    said, fixes = decide(r)
    return dataclasses.replace(r, verdict=said, fixes=fixes, rates=rates(r), headline=_from_loop(r.loop))


def _from_loop(loop: Loop) -> Headline | None:
    """The headline of a watched loader's loop: the GPU's idle share decides where it was taken."""
    if not loop.per_step:
        return None
    idle = loop.cuda_events.gap_share if loop.cuda_events else loop.wait_share
    return headline(idle, 1.0 - idle, [s.wait_ms for s in loop.per_step],
                    [s.wait_ms + s.step_ms for s in loop.per_step], DATA_BOUND)


def _from_steps(s: OptimizerSteps) -> Headline:
    """The headline of a loop seen from its optimizer's steps: the function that holds it most."""
    top = s.functions[0].share if s.functions else 0.0
    wholes = s.iteration_ms or []
    au = 1.0 - s.cuda_events.gap_share if s.cuda_events else s.model_share or 0.0
    return headline(top, au, s.top_ms or [0.0] * len(wholes), wholes, DATA_BOUND)


def _answer(got):
    """A trial's result where it has one of its own type (a hung one: none)."""
    return None if isinstance(got, Hung) else got


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
