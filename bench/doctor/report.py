"""The doctor's report as typed parts: the run, the loop's waits and steps, the probes, the
trials, the verdict and its fixes. `write_report` is the one writer of its JSON file and
`read_report` the one reader; the keys are those of bench/results/doctor-*.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .codec import flat, from_json, omitted, to_json
from .headline import Headline

# -- figures of the loop ----------------------------------------------------------------------
@dataclass(kw_only=True)
class Stats:
    """Durations of one kind (waits, steps, the GPU's gaps): only `n` where there are none."""

    n: int
    total_s: float | None = omitted()
    p50_ms: float | None = omitted()
    p95_ms: float | None = omitted()

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        if not values:
            return cls(n=0)
        ordered = sorted(values)
        return cls(n=len(values), total_s=sum(values), p50_ms=1e3 * ordered[len(ordered) // 2],
                   p95_ms=1e3 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))])


def share(wait: float, work: float) -> float:
    """The share of the loop spent waiting for the next batch."""
    return wait / (wait + work) if wait + work > 0 else 0.0


@dataclass(kw_only=True)
class StepTime:
    """One step of the loop: the wait for its batch, then the work on it."""

    wait_ms: float
    step_ms: float


@dataclass(kw_only=True)
class ProcessFigures:
    """CPU and disk of the script's process and of the workers it started while watched."""

    worker_processes: int
    workers_at_once: int
    cpu_s_workers: float
    started: int
    worker_cpu_busy: float | None  # CPU seconds a second of each worker alive at once
    cpu_s_main_total: float
    read_bytes: int


@dataclass(kw_only=True)
class GpuUtil:
    """NVML's utilisation over the loop (`util_*`) and over the whole run (`run_*`)."""

    samples: int
    util_mean_pct: float | None
    util_p50_pct: float | None
    run_samples: int
    run_util_mean_pct: float | None
    readings: list[list[float]]  # (seconds into the loop, %)


@dataclass(kw_only=True)
class CudaEvents:
    """The loop on the GPU's clock: `gap_share` the share its stream sat idle between steps."""

    steps: int
    step: Stats
    gap: Stats
    gap_share: float


@dataclass(kw_only=True)
class CopyFigures:
    """Host-to-GPU copies made in the loop."""

    copies: int
    bytes: int
    bytes_per_batch: float
    pinned_share: float | None
    blocked_s: float


# -- probes and trials ------------------------------------------------------------------------
@dataclass(kw_only=True)
class Failure:
    """A probe or trial that raised: said in the report, not raised."""

    error: str
    samples_per_s: ClassVar[None] = None  # a measure that failed has no rate

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        return cls(error=f"{type(exc).__name__}: {exc}"[:200])


@dataclass(kw_only=True)
class Ceiling:
    """A loader alone: `batches` timed after its first, with nothing done between them."""

    batches: int
    samples_per_s: float | None
    first_batch_s: float


Measured = Ceiling | Failure


@dataclass(kw_only=True)
class SampleCost:
    """A DataLoader's work per sample in the doctor's process: one item, and the collate."""

    getitem_ms: float
    collate_ms_per_sample: float
    iterable: bool
    num_workers: int
    pin_memory: bool
    batch_size: int | None
    dataset: str


class _Trial:
    """A loader measured alone with a setting changed: the setting's keys, then the measure's."""

    measured: Measured

    @property
    def samples_per_s(self) -> float | None:
        return self.measured.samples_per_s


@dataclass(kw_only=True)
class SweepRun(_Trial):
    """The script's DataLoader with `num_workers` (and `prefetch_factor` where not the default)."""

    num_workers: int
    prefetch_factor: int | None
    measured: Measured = flat()


@dataclass(kw_only=True)
class PersistentRun(_Trial):
    """The script's DataLoader with persistent_workers=True."""

    num_workers: int
    measured: Measured = flat()


@dataclass(kw_only=True)
class ThreadsRun(_Trial):
    """A Loader with a gather thread per core."""

    num_threads: int
    measured: Measured = flat()


@dataclass(kw_only=True)
class PackedRun(_Trial):
    """`files` of the script's image folder packed at `image_size`, read by a Loader."""

    files: int
    image_size: int
    root: str | None = omitted()  # the folder (ImageFolder's root): the build command names it
    measured: Measured = flat()


@dataclass(kw_only=True)
class ChatPackedRun(_Trial):
    """The first `conversations` of a chat Dataset's file packed (`chat.packed`), read by
    Loader(PackedDocuments(seq_len)) in `rows`: its rate in conversations/s, the script's samples."""

    conversations: int
    seq_len: int
    rows: int
    batch_size: int  # the script's, as the Loader's
    command: str  # `packer build` of the whole file
    out: str
    measured: Measured = flat()


@dataclass(kw_only=True)
class LoaderAlternatives:
    """A `loaders.Loader` as it is, and measured as it could be set."""

    num_threads: int
    more_threads: ThreadsRun | None = omitted()
    padding: float | None = omitted()  # the share of its canvas that is padding
    bucketed: Measured | None = omitted()


# -- the report -------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Confirmed:
    """A fix applied in a second run of the script (`rerun`): the loop's wait and rate without and with it."""

    wait_share_before: float
    wait_share: float
    steps_per_s_before: float | None
    steps_per_s: float | None
    speedup: float | None
    error: str | None = omitted()  # the rerun's own failure, where it had one


@dataclass(kw_only=True)
class Replay:
    """The script with its loader's first `kept` batches served again and again (`--replay`)."""

    kept: int
    steps: int
    steps_per_s: float | None
    yours_steps_per_s: float | None
    data_cost: float | None  # the share of the run the data costs: 1 - yours / replay
    step_p50_ms: float | None = omitted()  # the step alone in each run: where they differ, the load moved
    yours_step_p50_ms: float | None = omitted()


@dataclass(kw_only=True)
class Fix:
    """Something to try: what, what it should give, and how the doctor knows (measured or estimated)."""

    fix: str
    expected: str
    how: str
    gain: float | None = omitted()  # the data rate it gives over the loader's now
    args: dict | None = omitted()  # the loader's arguments that make it, where it is one (`rerun`)
    confirmed: Confirmed | None = omitted()  # the same script run again with them


@dataclass(kw_only=True)
class Rate:
    """One bar of the plot's second panel."""

    what: str
    samples_per_s: float


@dataclass(kw_only=True)
class Run:
    """The run around the loop: the machine, the script's failure, its processes, the GPU."""

    cuda: bool | None = None
    cpu_s_main: float | None = None
    error: str | None = None
    cores: int | None = None
    processes: ProcessFigures | None = None
    gpu: GpuUtil | None = None


@dataclass(kw_only=True)
class PaddingShare:
    """The padding in the batches the loop took: of a ragged column (`{name}_lengths` beside it,
    as mmpack's batches hold; an `attention_mask`), its real elements against the elements its
    tensors hold (samples x the batch's longest)."""

    column: str
    real: int
    padded: int
    share: float


@dataclass(kw_only=True)
class RemoteTraffic:
    """What the loop's loader brought over the link for its datasets in object storage, on this
    node (every process: DataLoader workers too): bytes, GET requests, shards downloaded and
    shards found in the node's cache."""

    urls: list[str]
    bytes: int
    gets: int
    shard_downloads: int  # misses: whole shards fetched
    shard_hits: int
    bytes_per_s: float | None = omitted()  # over the loop
    gpus_on_node: int | None = omitted()  # the ranks on this node (LOCAL_WORLD_SIZE), who share its link
    link_bytes_per_s: float | None = omitted()  # plain GETs of the dataset's files after the loop (`probes.link_rate`)


@dataclass(kw_only=True)
class Loop:
    """The loop of the loader iterated most: each next() a wait, each gap between batches a step."""

    loader: str
    wait: Stats
    step: Stats
    cuda_events: CudaEvents | None
    copies: CopyFigures | None
    first_batch_s: float | None
    wait_share: float
    samples: int
    model_samples_per_s: float | None
    per_step: list[StepTime]
    batch_size: int | None = omitted()  # the loader's, where it says (the rerun finds it by class and size)
    kept: int | None = omitted()  # a replay's batches kept (fewer where an epoch was shorter)
    remote: RemoteTraffic | None = omitted()
    epoch_starts: Stats | None = omitted()  # the first wait of each epoch after the first
    epoch_start_share: float | None = omitted()  # their share of the loop (a part of wait_share)
    padding: PaddingShare | None = omitted()  # of the batches taken, where they say their lengths


@dataclass(kw_only=True)
class GapFunction:
    """A function of the user's code and its share of the loop's time (`steps.Steps`)."""

    function: str  # "get_batch (train.py:112)"
    share: float


@dataclass(kw_only=True)
class OptimizerSteps:
    """The loop seen from its optimizer's steps: each iteration's time, and the shares of the
    training thread's stack samples between the first and last step: in the model's forward,
    backward and step; in the loop's own lines; outside both, by function."""

    steps: int
    iteration: Stats
    samples: int
    model_share: float | None
    loop_share: float | None
    outside_share: float | None
    functions: list[GapFunction]
    top_ms: list[float] | None = omitted()  # the first named function's time in each iteration
    iteration_ms: list[float] | None = omitted()  # each iteration's time (the plot's bars)
    cuda_events: CudaEvents | None = omitted()  # the GPU's clock: first forward to optimizer step


@dataclass(kw_only=True)
class RankFigures:
    """One rank of a torchrun job: its loop's wait and step, each a step's mean."""

    rank: int
    batches: int
    wait_share: float | None
    wait_ms: float
    step_ms: float
    steps_per_s: float | None
    error: str | None = omitted()


@dataclass(kw_only=True)
class Ranks:
    """A torchrun job's ranks (`ranks`): the straggler, and what it costs the others a step."""

    ranks: list[RankFigures]
    straggler: int
    held_ms_per_step: float


@dataclass(kw_only=True)
class Probes:
    """The loader after the loop: alone, and one sample's work."""

    per_sample: SampleCost | Failure | None = None
    loader_alone: Measured | None = None


@dataclass(kw_only=True)
class Trials:
    """The fixes measured for a loop that waited: each setting alone."""

    workers_sweep: list[SweepRun] | None = None
    more_workers: SweepRun | None = None
    packed: PackedRun | ChatPackedRun | Failure | None = None
    persistent: PersistentRun | None = None
    loader_alternatives: LoaderAlternatives | None = None


@dataclass(kw_only=True)
class Report:
    """What `bench doctor` found: without a loop, only the run; where the child left no report,
    only the verdict, its exit code and its time."""

    batches: int | None = omitted()  # of every loader watched
    wall_s: float
    run: Run | None = flat(optional=True)
    loop: Loop | None = flat(optional=True)
    steps: OptimizerSteps | None = omitted()  # the optimizer's steps, where the script has one
    probes: Probes | None = flat(optional=True)
    trials: Trials | None = flat(optional=True)
    verdict: str
    headline: Headline | None = omitted()  # AU, exposed data-loading time a step, how sure the verdict is
    replay: Replay | None = omitted()  # the loop's ceiling with a loader that costs nothing
    ranks: Ranks | None = omitted()  # every rank of a torchrun job; the rest of the report is the straggler's
    fixes: list[Fix] | None = omitted()
    rates: list[Rate] | None = omitted()
    command: list[str] | None = omitted()  # from here on, `run`'s: the command, how it ended, in which Python
    exit_code: int | None = omitted()
    python: str | None = omitted()
    note: str | None = omitted()


def write_report(report: Report, path: Path, *, indent: int | None = None) -> None:
    """Whole or not at all (a reader waiting for it never reads half of it)."""
    part = path.with_name(f".{path.name}.part")
    part.write_text(json.dumps(to_json(report), indent=indent, default=str))
    os.replace(part, path)


def read_report(path: Path) -> Report:
    return from_json(Report, json.loads(path.read_text()))
