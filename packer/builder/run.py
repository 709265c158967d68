"""`packer build`: RAW --scan--> records --plan--> shard tasks --run--> whole shards in
OUT/<generation> --commit--> manifest, published last (`packer.dataset.outdir`).

The shard is the unit of work (`packer.builder.shard.run_shard`): run in a pool of worker processes
(never in this one), or as Ray tasks, the bytes are the same. Each finished shard leaves a
sidecar in staging, so a killed build started again with the same arguments reuses what is whole
(sizes and checksums checked) and redoes the rest; a build with other arguments or changed inputs
is refused unless --overwrite. `--part i/N` runs a share of the shards into a shared OUT and
`commit` publishes once all are there. A dir without a manifest never opens as a dataset.
Memory: one sample (or three tokenizer batches of 64 documents) per worker, and at most two queued
tasks per worker.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from packer.builder import append, inputs, staging
from packer.builder.config import BuildConfig
from packer.builder.images import pixel_limit
from packer.builder.pieces import in_pieces, piece_bounds
from packer.builder.plan import Plan, plan, records_of
from packer.builder.publish import commit_staged
from packer.builder.scan import Scan, scan
from packer.builder.shard import ShardContext, ShardResult, reusable
from packer.builder.workers import wait_for_old_workers
from packer.dataset import codec
from packer.dataset import format as fmt
from packer.dataset import outdir
from packer.dataset.reader import DatasetReader
from packer.dataset.writer import take_disk_wait
from packer.errors import ConfigError, MmpackError, SourceError
from packer.system import available_cores, gc_frozen, gc_paused

Progress = Callable[[int, int], None]


@dataclass
class Prepared:
    """A build planned and its staging claimed; what running and committing shards need."""

    config: BuildConfig
    found: Scan
    plan: Plan
    ctx: ShardContext
    base: fmt.Manifest | None  # the dataset being appended to
    published: fmt.Manifest | None = None  # this very build, published by a killed earlier run


@dataclass(frozen=True)
class PartReport:
    part: tuple[int, int] | None
    shards: int  # shards of this part
    built: int
    reused: int
    items: int
    total_shards: int


def build(config: BuildConfig, *, on_progress: Progress | None = None) -> fmt.Manifest:
    """Build (or resume, or append to) the dataset dir `config.out`; returns the published
    manifest. With `config.part` use `build_part` and `commit` instead."""
    if config.part is not None:
        raise ConfigError("build(): a config with part= runs through build_part() and commit()")
    started = time.time()
    with outdir.locked(config.out):
        prep = _prepare(config)
        if prep.published is not None:  # published by a run that was killed before it cleaned up
            outdir.publish(config.out, prep.published)
            return prep.published
        try:
            _, cores, disk_wait = _run(prep, prep.plan.tasks, on_progress)
            return commit_staged(config.out, seconds=time.time() - started, workers=_workers_used(config), cores=cores,
                           max_skipped=config.max_skipped, disk_wait=disk_wait)
        except MmpackError:
            staging.discard(config)
            raise


def build_part(config: BuildConfig, *, on_progress: Progress | None = None) -> PartReport:
    """Build share i of N of the planned shards into a shared OUT; publishes nothing."""
    with outdir.locked(config.out, shared=True):
        prep = _prepare(config)
        i, n = config.part or (0, 1)
        tasks = prep.plan.tasks
        mine = tasks[len(tasks) * i // n: len(tasks) * (i + 1) // n]
        results, _, _ = _run(prep, mine, on_progress)
    return PartReport(config.part, len(mine), sum(not r.reused for r in results), sum(r.reused for r in results),
                      sum(r.items for r in results), len(tasks))


def _start_pool_server(config: BuildConfig) -> None:
    """A local build runs its shards in a pool: where its workers come from a forkserver (a
    text build; an image build from a process that runs other threads), the server starts
    while this process scans RAW, so that its imports are not waited for."""
    if config.engine == "local":
        from packer.builder.pool import start_method, start_server

        if start_method(tokenizer=config.tokenizer is not None) == "forkserver":
            start_server()


def _workers_used(config: BuildConfig) -> int | str:
    return "ray" if config.engine == "ray" else config.num_workers


# -- prepare: scan, plan, fingerprint, claim the staging --------------------------------------
def _prepare(config: BuildConfig) -> Prepared:
    outdir.check_out(config.out, append=config.append, overwrite=config.overwrite, deferred=True)
    _start_pool_server(config)
    with gc_paused():  # a few objects per input file, none in a cycle
        return _scan_and_plan(config)


def _scan_and_plan(config: BuildConfig) -> Prepared:
    existing = DatasetReader(config.out) if config.append else None
    base = existing.manifest if existing else None
    found = scan(config.raw, config.kind or (base.kind if base else None), base.classes if base else None,
                 options=config.form_options(), form=config.input)
    if existing is not None:
        append.check_unchanged(config, existing, found)
        found = append.only_new(found, existing)
    audio = config.audio_spec(found.kind)
    tok = config.tokenizer_for(found.kind, found.why, transcribed=found.fields is not None)
    tokenizer = tok[1] if tok else None
    template = config.template_for(found.kind)
    params = config.params(found.kind, tokenizer, template)
    if config.fields and not found.extras and found.records:
        raise ConfigError(f"--fields: RAW {config.raw} is {found.why}, whose records have no fields to keep (a "
                          "manifest's, a Parquet row's, a tar sample's .json, a Common Voice row's)")
    columns = config.columns(found.kind, tokenizer, labeled=found.classes is not None and found.form != "coco",
                             chat=dict(found.fields) if found.kind == "chat" else None, extras=found.extras)
    if base is not None:
        append.check_compatible(config, base, params, columns, tokenizer)
        append.check_classes(config, base, found)
    itemsize = np.dtype(tokenizer.dtype).itemsize if tokenizer else 2
    first = max((s.index for s in base.shards), default=-1) + 1 if base else 0
    the_plan = plan(found, image_size=config.image_size, max_side=config.side_cap, token_itemsize=itemsize,
                    shard_rows=config.shard_rows, shard_bytes=config.shard_bytes, first_index=first,
                    text_key=_record_key(config, found), max_doc_bytes=config.max_doc_bytes, audio=audio,
                    image_share=codec.JPEG_SHARE if codec.parse_store(config.store)[0] == codec.JPEG else 1.0)
    skipped = (*found.skipped, *the_plan.skipped)
    if config.strict and skipped:
        raise SourceError(f"{config.raw / skipped[0].key}: {skipped[0].reason} (--strict)")
    if not the_plan.tasks and base is None:
        first_skip = f" (first: {skipped[0].key}: {skipped[0].reason})" if skipped else ""
        raise SourceError(f"{config.raw}: nothing to pack, all {len(skipped)} records skipped{first_skip}")
    digest = staging.inputs_digest(found)
    base_sha = hashlib.sha256(base.to_json().encode()).hexdigest() if base else None
    fingerprint = staging.fingerprint(params, digest, the_plan.digest(), base_sha)
    doc = {
        "fingerprint": fingerprint, "params": params, "inputs": digest, "records": len(found.records),
        "kind": found.kind, "columns": [asdict(c) for c in columns],
        "classes": list(found.classes) if found.classes is not None else None,
        "tokenizer": asdict(tokenizer) if tokenizer else None, "audio": audio.manifest() if audio else None,
        "skipped": [asdict(s) for s in skipped], "shards": [t.index for t in the_plan.tasks],
        "items": the_plan.items, "base": base_sha, "layout": found.why,
        "input": {"form": found.form, "fields": dict(found.fields), "not_packed": list(found.ignored),
                  **({"notes": dict(found.notes)} if found.notes else {})}
        if found.form != "folder" else ({"form": "folder", "not_packed": list(found.ignored)} if found.ignored else None),
    }
    published = staging.claim(config, doc)
    if published is None and not (outdir.staging_dir(config.out) / inputs.STAGED).is_file():
        inputs.write(outdir.staging_dir(config.out), found,
                     (existing.root, base.inputs) if base is not None and base.inputs else None)
    ctx = ShardContext(config, doc["generation"], fingerprint, found.kind, columns, tokenizer, found.form,
                       dict(found.fields) if found.fields else None, audio=audio,
                       max_image_pixels=pixel_limit(config.max_pixels), chat=template)
    return Prepared(config, found, the_plan, ctx, base, published)


def _record_key(config: BuildConfig, found: Scan) -> str:
    """The field every record of a text or chat build has (checked while planning): --text-key,
    or a chat build's messages field (a pair's "chosen")."""
    if found.kind != "chat":
        return config.text_key
    return found.fields.get("messages") or "chosen"


# -- run: the shard tasks, here, in a pool, or on Ray --------------------------------------------
def parallelism(workers: int, units: int) -> tuple[int, int]:
    """(processes, tokenizer threads per process) of a local build of `units` pool tasks (shards,
    or pieces of fixed-size image shards) with --workers N: one process per task up to N; in a
    pool each process's tokenizers (Rust) threads get cores // N so the workers do not
    oversubscribe; a build in one process leaves them at every core."""
    procs = max(1, min(workers, units))
    cores = available_cores()
    return procs, cores if procs == 1 else max(1, cores // procs)


def pool_tasks(ctx: ShardContext, items: list[int], workers: int) -> int:
    """Tasks a pool of `workers` gets for shards of these item counts: pieces of image shards,
    else shards."""
    if not in_pieces(ctx):
        return len(items)
    return sum(len(piece_bounds(n, last=k == len(items) - 1, lanes=workers)) for k, n in enumerate(items))


def _run(prep: Prepared, tasks, on_progress: Progress | None) -> tuple[list[ShardResult], int | None, float | None]:
    """The shard results of `tasks` in order (reused or built); the cores the build kept busy:
    one per process decoding images, every tokenizer thread for text, at most the cores there are;
    and the share of the workers' time spent waiting on the disk (writes, fsyncs; with the build
    process's own fsyncs of image shards). Both None on Ray."""
    total = sum(t.items for t in tasks)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if on_progress:
            on_progress(min(done, total), total)

    if prep.config.engine == "local":
        wait_for_old_workers(prep.ctx.staging)
    results: dict[int, ShardResult] = {}
    todo = []
    for task in tasks:
        kept = reusable(prep.ctx, task.index)
        if kept is not None:
            results[task.index] = kept
            advance(kept.items)
        else:
            todo.append(task)
    jobs = ((task, list(records_of(prep.found, task))) for task in todo)
    workers = prep.config.num_workers
    workers, threads = parallelism(workers, pool_tasks(prep.ctx, [t.items for t in todo], workers))
    cores = min(workers * (threads if prep.ctx.tokenizer is not None else 1), available_cores())
    take_disk_wait()  # from here on, this build's
    started = time.perf_counter()
    with gc_frozen():  # the scan's objects: a collector's pass over them, here or in a fork, finds nothing
        if prep.config.engine == "ray":
            from packer.builder.ray_tasks import run_ray

            ran, cores = run_ray(prep.ctx, jobs, advance, prep.config.ray_address), None
        else:  # worker processes only, even one: a decoder or tokenizer that kills its process costs its item
            from packer.builder.pool import run_pool

            ran = run_pool(prep.ctx, jobs, advance, workers, threads)
    waited = take_disk_wait() / max(1e-9, (time.perf_counter() - started) * workers) if todo else 0.0
    results.update((r.shard.index, r) for r in ran)
    return [results[t.index] for t in tasks], cores, None if cores is None else min(1.0, waited)


