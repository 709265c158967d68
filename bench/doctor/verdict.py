"""The verdict on a watched loop (data-bound or compute-bound, and why) and the fixes to try, from
the report's figures; and the report said in a few lines, as `bench doctor` prints it."""

from __future__ import annotations

from . import chat
from .codec import from_json, to_json
from .headline import said
from .report import (ChatPackedRun, Confirmed, Failure, Fix, LoaderAlternatives, OptimizerSteps, Probes, Replay,
                     Report, Run, SampleCost, Trials)

DATA_BOUND = 0.10  # waiting more than this share of the loop: the data is what the step waits for
AHEAD_OF_MODEL = 3.0  # a data-bound loader this much faster alone than the model: not its rate that waits
EPOCH_STARTS = 0.5  # of the waiting at epochs' first batches: said to wait there, not in the steps
NAMED_GAIN = 1.1  # a measured fix is named where it makes the data at least this much faster: below, runs spread
PACK_WORTH_MS = 0.05  # a sample's work under this: packing has nothing to do once


def decide(r: Report) -> tuple[str, list[Fix]]:
    """The verdict on a watched loop, and the fixes to try: the largest gain first; unmeasured,
    unestimated ones last."""
    seen = _waited(r) + _rates_said(r)
    fixes = [fix for fix in [_copies_fix(r)] if fix]
    # the GPU's own clock decides where there is one: a script that queues its steps ahead waits
    # on the host while its GPU still works
    events = r.loop.cuda_events
    bound = events.gap_share if events else r.loop.wait_share
    if bound <= DATA_BOUND:
        return f"compute-bound: {seen}: the data is not what the step waits for", fixes
    cost = _cost(r)
    if cost:
        fixes += _dataloader_fixes(r, cost)
        fixes += [fix for fix in [_pin_fix(r, cost, fixes)] if fix]
    alt = (r.trials or Trials()).loader_alternatives
    if alt:
        fixes += _loader_fixes(alt, _alone(r))
    if (r.loop.epoch_start_share or 0.0) >= EPOCH_STARTS * r.loop.wait_share:
        return _epoch_starts(r, seen, fixes)
    fixes.sort(key=lambda f: -(f.gain or 0.0))
    return f"data-bound: {seen}{_why(r, cost, alt)}", fixes


def _epoch_starts(r: Report, seen: str, fixes: list[Fix]) -> tuple[str, list[Fix]]:
    """A data-bound loop that does at least EPOCH_STARTS of its waiting at each epoch's first batch
    (DataLoader workers started again, an iterator set up): said so, with persistent workers
    among the fixes (measured where they were), all ranked by their measured gain."""
    starts, cost = r.loop.epoch_starts, _cost(r)
    if cost and cost.num_workers and not any(f.fix == "persistent_workers=True" for f in fixes):
        fixes = fixes + [Fix(fix="persistent_workers=True", expected="its workers start once, not at every epoch",
                             how="estimated from the waits at the epochs' starts", args={"persistent_workers": True})]
    fixes.sort(key=lambda f: -(f.gain or 0.0))  # the largest measured gain first, whatever it fixes
    return (f"data-bound at epoch starts: {100 * r.loop.epoch_start_share:.0f}% of the loop waiting for the first "
            f"batch of each epoch ({starts.n} epoch start(s), p50 {starts.p50_ms:.0f} ms); in all, {seen}", fixes)


def decide_json(r: dict) -> tuple[str, list[dict]]:
    """`decide` on a report in its JSON form (one read back, or a partial one): the fixes as JSON."""
    said, fixes = decide(from_json(Report, r))
    return said, to_json(fixes)


def nothing_iterated(run: Run) -> str:
    """The verdict where no loader was iterated: the script failed, or ran its loops elsewhere."""
    children = run.processes.started if run.processes else None
    return "no DataLoader or Loader was iterated" + (
        f" (the script failed: {run.error})" if run.error else
        f" in the script's own process; it started {children} process(es), which the doctor does not watch "
        "(torch.multiprocessing.spawn, a launcher): run it under torchrun (bench doctor -- torchrun ...), watch one "
        "rank's loop in the script's process, or "
        "bench.doctor.watch() inside it" if children else "")


def from_steps(s: OptimizerSteps) -> str:
    """The verdict on a loop that iterated no DataLoader or Loader, seen from its optimizer's
    steps and its stack: data-bound where a function it calls outside the model's forward,
    backward and step holds more than DATA_BOUND of it."""
    if not s.samples:
        return (f"too short to judge: {s.steps} optimizer step(s) and no DataLoader or Loader iterated, over less "
                "time than the stack is sampled in; watch more steps (--steps)")
    top, events = (s.functions or [None])[0], s.cuda_events
    how = (f"{s.steps} optimizer steps, p50 {s.iteration.p50_ms or 0:.1f} ms an iteration, "
           f"{100 * (s.model_share or 0):.0f}% of it in the model's forward, backward and step; no DataLoader or "
           "Loader was iterated: seen from the optimizer's steps and the training thread's stack"
           + (f"; the GPU's stream idle {100 * events.gap_share:.0f}% of the loop between a step and the next "
              "forward (CUDA events)" if events else ""))
    if events and events.gap_share <= DATA_BOUND:  # the GPU's clock decides: a host queued ahead waits in a sync
        return f"compute-bound: the GPU is never short of work between steps ({how})"
    if top is None or top.share <= DATA_BOUND:
        return f"compute-bound: no function outside the model holds the loop ({how})"
    return (f"data-bound: {100 * top.share:.0f}% of the loop in {top.function}, outside the model's work ({how}); "
            "if it makes the batches, make them once (packer build, then loaders.Loader) or ahead of the step "
            "(a DataLoader with workers)")


def _confirmed(c: Confirmed) -> str:
    """A fix applied in a run of its own, said with the loop's figures before and after."""
    if c.error:
        return f"in your run with it, the script stopped early: {c.error}"
    faster = f", {c.speedup:.1f}x steps/s" if c.speedup else ""
    waits_less = c.wait_share < c.wait_share_before
    steps_faster = (c.speedup or 0) > NAMED_GAIN
    if waits_less and (steps_faster or c.wait_share < DATA_BOUND <= c.wait_share_before):
        word = "confirmed"
    elif not waits_less and not steps_faster:
        word = "not confirmed"
    else:  # the wait and the rate disagree: the step itself changed between the runs
        word = "unclear (the wait and the step rate moved apart: other load on the machine between the runs?)"
    return f"{word} in your run: {100 * c.wait_share_before:.0f}% -> {100 * c.wait_share:.0f}% of the loop waiting{faster}"


def _replay_line(p: Replay) -> str:
    if not p.steps_per_s:
        return "replay: the loop had too few batches after the kept ones to time (more --steps)"
    cost = f": the data costs you {100 * p.data_cost:.0f}% of the run" if p.data_cost is not None else ""
    moved = p.step_p50_ms and p.yours_step_p50_ms and p.yours_step_p50_ms > 1.25 * p.step_p50_ms
    caveat = (f" (the step itself took {p.yours_step_p50_ms:.1f} ms in your run against {p.step_p50_ms:.1f} in the "
              "replay: other load on the machine, or work the step does on its batch, is part of that)" if moved else "")
    return (f"replay (its first {p.kept} batches served again, already where the script moves them): "
            f"{p.steps_per_s:,.1f} steps/s, yours {p.yours_steps_per_s or 0:,.1f} over the same steps{cost}{caveat}")


def _steps_line(s: OptimizerSteps) -> str:
    named = ", ".join(f"{f.function} {100 * f.share:.0f}%" for f in s.functions[:3]) or "none"
    return (f"optimizer: {s.steps} steps, p50 {s.iteration.p50_ms or 0:.1f} ms an iteration; the model "
            f"{100 * (s.model_share or 0):.0f}% of the loop, the loop's own lines {100 * (s.loop_share or 0):.0f}% "
            f"(waiting for a loader's next batch among them), outside both: {named}")


def text(r: Report) -> str:
    """The verdict, the fixes numbered, and the loop's figures in a line."""
    lines = [r.verdict]
    if r.headline:
        lines.append(said(r.headline))
    if r.run and r.run.error:
        lines.append(f"the script stopped early: {r.run.error} (the report covers what ran)")
    for i, f in enumerate(r.fixes or [], 1):
        lines.append(f"  {i}. {f.fix}: {f.expected} ({f.how})" + (f"\n     {_confirmed(f.confirmed)}" if f.confirmed else ""))
    if r.replay:
        lines.append(_replay_line(r.replay))
    if r.note:
        lines.append(f"note: {r.note}")
    if r.ranks:
        lines += [f"rank {f.rank}: {f.batches} batches, wait {f.wait_ms:.1f} ms and step {f.step_ms:.1f} ms a step "
                  f"({100 * (f.wait_share or 0):.0f}% waiting), {f.steps_per_s or 0:,.1f} steps/s"
                  + (f"; stopped: {f.error}" if f.error else "") for f in r.ranks.ranks]
    if r.loop:
        lines.append(f"{r.batches} batches of {r.loop.loader}: step p50 {r.loop.step.p50_ms or 0:.1f} ms, "
                     f"wait p50 {r.loop.wait.p50_ms or 0:.1f} ms; first batch after {r.loop.first_batch_s:.2f} s")
    if r.loop and r.loop.padding:
        lines.append(_padding_line(r.loop))
    if r.steps and r.steps.samples:
        lines.append(_steps_line(r.steps))
    for what, got in (("one sample", (r.probes or Probes()).per_sample), ("the loader alone", _alone_run(r))):
        if isinstance(got, Failure):
            lines.append(f"{what} not measured: {got.error}")
    if r.loop and r.loop.remote:
        t = r.loop.remote
        gpus = t.gpus_on_node or 1
        rate = (f"; {t.bytes_per_s / 1e9:.2f} GB/s over the loop, {t.bytes_per_s / gpus / 1e9:.2f} per GPU of the "
                f"node's {gpus}" if t.bytes_per_s is not None else "")
        link = f", the link {t.link_bytes_per_s / 1e9:.2f} GB/s to plain GETs" if t.link_bytes_per_s else ""
        lines.append(f"object storage ({', '.join(t.urls)}): {t.bytes / 1e6:,.1f} MB in {t.gets:,} GETs, "
                     f"{t.shard_downloads:,} shards downloaded (misses), {t.shard_hits:,} found in the node's cache "
                     f"(hits){rate}{link}")
    return "\n".join(lines)


PADDING_HINT = 0.2  # a padding share past which the report names the loader options that plan batches by length


def _padding_line(loop) -> str:
    """The padding share of the batches the loop took, and where it is large, what cuts it."""
    p = loop.padding
    line = (f"padding: {100 * p.share:.0f}% of the {p.padded:,} {p.column} elements in the batches the loop took "
            "(the GPU computes on them too)")
    if p.share >= PADDING_HINT:
        line += ("; Loader(..., bucket_by='length') or max_tokens= batches samples of about one length "
                 "(bench loaders --padding measures both)")
    return line


def _alone_run(r: Report):
    return (r.probes or Probes()).loader_alone


def _alone(r: Report) -> float | None:
    """The loader's rate alone, after the loop."""
    measured = _alone_run(r)
    return measured.samples_per_s if measured else None


def _cost(r: Report) -> SampleCost | None:
    """A DataLoader's sample cost, where it was timed."""
    cost = (r.probes or Probes()).per_sample
    return cost if isinstance(cost, SampleCost) else None


def _work(cost: SampleCost) -> str:
    """What makes one sample: a map-style dataset's __getitem__, an iterable one's iterator."""
    return "the dataset's iterator" if cost.iterable else "__getitem__"


def _waited(r: Report) -> str:
    """How long the loop waited, as the host's clock, NVML and the GPU's clock saw it, and what it
    copied to the GPU."""
    wait, events, copies = r.loop.wait, r.loop.cuda_events, r.loop.copies
    gpu = (r.run or Run()).gpu
    busy = gpu.util_mean_pct if gpu else None
    return (f"{100 * r.loop.wait_share:.0f}% of the loop waiting for the next batch"
            + (f" (p50 {wait.p50_ms:.1f} ms, p95 {wait.p95_ms:.1f} ms)" if wait.n else "")
            + (f", the GPU busy {busy:.0f}% of the time (NVML)" if busy is not None else "")
            + (f", its stream idle {100 * events.gap_share:.0f}% of the loop between steps (CUDA events)"
               if events else "")
            + (f"; {copies.bytes_per_batch / 1e6:,.1f} MB copied to the GPU a batch, "
               f"{100 * copies.pinned_share:.0f}% of it from pinned memory" if copies else ""))


def _rates_said(r: Report) -> str:
    alone, model = _alone(r), r.loop.model_samples_per_s
    return (f"; the loader alone makes {alone:,.0f} samples/s" if alone else "") + (
        f", the model takes {model:,.0f}/s" if model else "")


def _copies_fix(r: Report) -> Fix | None:
    """Copies from pageable memory that blocked the loop a twentieth of its steps' time or more."""
    copies, steps_s = r.loop.copies, r.loop.step.total_s if r.loop.step else None
    if not (copies and copies.pinned_share < 0.5 and copies.blocked_s > 0.05 * (steps_s or 0)):
        return None
    return Fix(fix="pin_memory=True and .to(device, non_blocking=True)",
               expected=f"the {copies.blocked_s:.2f} s the loop spent blocked in copies from pageable memory, "
                        "overlapped", how="estimated from the copies seen")


def _dataloader_fixes(r: Report, cost: SampleCost) -> list[Fix]:
    """A DataLoader's fixes: more workers, packing, persistent workers, a deeper prefetch."""
    fixes = [_workers_fix(r, cost), _pack_fix(r, cost), _persistent_fix(r), _prefetch_fix(r)]
    return [fix for fix in fixes if fix]


def _workers_fix(r: Report, cost: SampleCost) -> Fix | None:
    """More workers: measured where the sweep ran (named only where faster), else estimated."""
    workers, cores, alone = cost.num_workers, (r.run or Run()).cores or 1, _alone(r)
    wider = (r.trials or Trials()).more_workers
    if wider and wider.samples_per_s and alone:
        rate = wider.samples_per_s
        if rate <= NAMED_GAIN * alone:
            return None
        return Fix(fix=f"num_workers={wider.num_workers} (now {workers})",
                   expected=f"{rate / alone:.1f}x the data rate ({rate:,.0f} samples/s alone)",
                   how="measured: the same loader with 1, 2, 4, ... workers up to the cores, alone; the best",
                   gain=rate / alone, args={"num_workers": wider.num_workers})
    if workers >= cores:
        return None
    # not measured for an iterable dataset: more workers may each yield all of it
    gain = min(cores / max(workers, 1), 1 / max(1 - r.loop.wait_share, 1e-3))
    return Fix(fix=f"num_workers={cores} (now {workers})", expected=f"up to {gain:.1f}x the data rate",
               how="estimated: the per-sample work spread over more processes" + (
                   "; each worker must take its own part of the stream (get_worker_info())" if cost.iterable else ""),
               gain=gain, args=None if cost.iterable else {"num_workers": cores})


def _pack_fix(r: Report, cost: SampleCost) -> Fix | None:
    """Packing the data: measured on a sample of its files where that ran, else estimated."""
    fix, alone = "pack the data once (packer build RAW OUT) and read it with loaders.Loader", _alone(r)
    packed = (r.trials or Trials()).packed
    if isinstance(packed, ChatPackedRun) and packed.samples_per_s and alone:
        return chat.pack_fix(packed, alone)
    if packed and packed.samples_per_s and alone:
        rate = packed.samples_per_s
        if packed.root:  # the exact command, and the two lines of the script that change
            out = f"{packed.root.rstrip('/')}-packed"
            fix = (f"pack the data once: packer build {packed.root} {out} --image-size {packed.image_size}; then in "
                   f"the script, from loaders import Loader and loader = Loader({out!r}, batch_size={cost.batch_size}) "
                   "in place of the DataLoader")
        return Fix(fix=fix, expected=f"{rate / alone:.1f}x the data rate ({rate:,.0f} samples/s alone)",
                   how=f"measured: {packed.files} of its files packed at {packed.image_size} px, then Loader alone",
                   gain=rate / alone)
    work = _work(cost)
    if cost.getitem_ms < PACK_WORTH_MS:  # nothing per sample to do once: packing gives nothing here
        return None
    return Fix(fix=fix, expected=f"no work per {_item(cost)}: the {cost.getitem_ms:.2f} ms {_item(cost, 'a')} {work} "
               "takes, done once", how=f"estimated from {work} timed here; bench loaders measures it on sample data")


def _item(cost: SampleCost, article: str = "") -> str:
    """What one call of the dataset gives: a sample, or with batch_size=None a whole batch."""
    word = "sample" if cost.batch_size is not None else "item (a batch: batch_size=None)"
    return f"{article} {word}".strip() if article else word


def _persistent_fix(r: Report) -> Fix | None:
    steady, alone = (r.trials or Trials()).persistent, _alone(r)
    rate = steady.samples_per_s if steady else None
    if not (rate and alone and rate > NAMED_GAIN * alone):
        return None
    return Fix(fix="persistent_workers=True", expected=f"{rate / alone:.1f}x the data rate "
               f"({rate:,.0f} samples/s alone): its workers start once, not every epoch",
               how="measured: the same loader so, alone, over as many epochs", gain=rate / alone,
               args={"persistent_workers": True})


def _prefetch_fix(r: Report) -> Fix | None:
    """A deeper prefetch, named where it beats both the loader alone and the most workers."""
    trials, alone = r.trials or Trials(), _alone(r)
    deeper = next((x for x in trials.workers_sweep or [] if x.prefetch_factor and x.samples_per_s), None)
    wider = (trials.more_workers.samples_per_s if trials.more_workers else None) or 0
    if not (deeper and alone and deeper.samples_per_s > NAMED_GAIN * max(alone, wider)):
        return None
    return Fix(fix=f"prefetch_factor={deeper.prefetch_factor} with num_workers={deeper.num_workers}",
               expected=f"{deeper.samples_per_s / alone:.1f}x the data rate",
               how="measured: the same loader so, alone", gain=deeper.samples_per_s / alone,
               args={"prefetch_factor": deeper.prefetch_factor, "num_workers": deeper.num_workers})


def _pin_fix(r: Report, cost: SampleCost, fixes: list[Fix]) -> Fix | None:
    """Pinned memory where there is a GPU to copy to and no fix named pins already."""
    if cost.pin_memory or not (r.run or Run()).cuda or any(f.fix.startswith("pin_memory") for f in fixes):
        return None
    return Fix(fix="pin_memory=True", expected="faster host-to-GPU copies", how="estimated", args={"pin_memory": True})


def _loader_fixes(alt: LoaderAlternatives, alone: float | None) -> list[Fix]:
    """The fixes a Loader's measured alternatives show, where they beat it alone by 10% or more."""
    fixes = []
    more = alt.more_threads.samples_per_s if alt.more_threads else None
    if more and alone and more > NAMED_GAIN * alone:
        fixes.append(Fix(fix=f"num_threads={alt.more_threads.num_threads} (now {alt.num_threads})",
                         expected=f"{more / alone:.1f}x the data rate ({more:,.0f} samples/s alone)",
                         how="measured: the same Loader so, alone", gain=more / alone,
                         args={"num_threads": alt.more_threads.num_threads}))
    grouped = alt.bucketed.samples_per_s if alt.bucketed else None
    if grouped and alone and grouped > NAMED_GAIN * alone:
        fixes.append(Fix(fix='bucket_by="aspect"', expected=f"{grouped / alone:.1f}x the data rate "
                         f"({grouped:,.0f} samples/s alone): batches of one aspect, a canvas of less padding",
                         how="measured: a Loader so over the same dataset, alone", gain=grouped / alone,
                         args={"bucket_by": "aspect"}))
    return fixes


def _why(r: Report, cost: SampleCost | None, alt: LoaderAlternatives | None) -> str:
    """Why the data is late: the sample's cost (a DataLoader) or the Loader's set-up, its workers'
    CPU, and whether the loader's rate alone is even the cause."""
    why = (f"; {_work(cost)} takes {cost.getitem_ms:.2f} ms {_item(cost, 'a')} and the collate "
           f"{cost.collate_ms_per_sample:.2f} ms, on {cost.num_workers} worker(s)") if cost else ""
    if alt:
        why = f"; a Loader with {alt.num_threads} gather thread(s)" + (
            f", {100 * alt.padding:.0f}% of its canvas padding" if alt.padding is not None else "")
    processes = (r.run or Run()).processes
    busy = processes.worker_cpu_busy if processes else None
    if busy is not None and cost:  # a DataLoader's workers, not a script's other child processes
        why += f" at {100 * busy:.0f}% CPU each"
    return why + _ahead(r)


def _ahead(r: Report) -> str:
    """A loader far faster alone than the model: the wait is what runs beside the step, not its rate."""
    alone, model = _alone(r), r.loop.model_samples_per_s
    if not (alone and model and alone > AHEAD_OF_MODEL * model):
        return ""
    return (f"; alone it makes {alone / model:.0f}x what the model takes, so the wait is not its rate but "
            f"what changes beside the step: the {(r.run or Run()).cores or 1} core(s) it shares with the step, "
            "epoch starts, the hand-over of each batch")
