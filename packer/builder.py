"""`packer build`: RAW --scan--> records --plan--> shard tasks --run--> whole shards in
OUT/<generation> --commit--> manifest, published last (`packer.outdir`).

The shard is the unit of work (`packer.shards.run_shard`): run in a pool of worker processes
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
import json
import logging
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from . import format as fmt
from . import inputs, outdir
from .errors import ConfigError, IntegrityError, MmpackError, SourceError
from .plan import Plan, plan, records_of
from .reader import DatasetReader, check_file_sizes, load_manifest
from .pieces import in_pieces, piece_bounds
from .shards import ShardContext, ShardResult, read_sidecar, reusable, wait_for_writers
from .sources import MULTI_DOC_EXTS, Scan, printable, scan
from .workers import wait_for_old_workers
from .writer import checksum_file, take_disk_wait
from .system import available_cores, gc_frozen, gc_paused
from .text import MAX_DOC_BYTES, TokenizerSpec, file_sha256, keep_tokenizer, load_tokenizer, resolve_eos, token_dtype

log = logging.getLogger(__name__)
DEFAULT_SHARD_BYTES = 256 * 1024**2
PLAN_FILE = "plan.json"
ENGINES = ("local", "ray")
_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1024**3, "gib": 1024**3}


def parse_shard_size(text: str) -> tuple[int | None, int | None]:
    """'1000' or '1000rows' -> (rows, None); '256MB', '1GiB', '4096B' -> (None, bytes)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or (unit not in _UNITS and unit not in ("row", "rows")) or int(m.group(1)) <= 0:
        raise ConfigError(f"--shard-size: {text!r} is neither a row count (1000) nor a size (256MB)")
    if unit in ("", "row", "rows") and not text.strip().lower().endswith("b"):
        return int(m.group(1)), None
    return None, int(m.group(1)) * _UNITS[unit]


@dataclass(frozen=True)
class BuildConfig:
    """Everything a build depends on; the CLI's flags map one-to-one onto these fields."""

    raw: Path
    out: Path
    kind: str | None = None
    image_size: int | None = 224  # None: keep each image's own size
    tokenizer: Path | None = None
    text_key: str = "text"
    append_eos: str | None = None  # None, "auto" or an id
    special_tokens: bool = False
    shard_rows: int | None = None
    shard_bytes: int | None = DEFAULT_SHARD_BYTES
    overwrite: bool = False
    strict: bool = False
    workers: int | None = None  # None: every core this process may use
    engine: str = "local"  # "local": this process or a process pool; "ray": Ray tasks
    ray_address: str | None = None  # None: start or join a local Ray instance
    part: tuple[int, int] | None = None  # (i, N): build only share i (0-based) of N, no publish
    append: bool = False
    allow_changed: bool = False  # --append: keep the samples of RAW files deleted or changed since
    max_skipped: float | None = None  # fail a build that skips more than this fraction of what it found
    background: tuple[int, int, int] | None = None  # composite transparent images over this colour
    keep_aspect: bool = False  # shorter side to image_size, the whole image (no centre crop)
    max_side: int | None = None  # keep-aspect: cap of the longer side (default 2 x image_size)
    max_doc_bytes: int = MAX_DOC_BYTES  # a longer document (a .txt file, a JSONL line, a caption) is a skip

    def __post_init__(self) -> None:
        object.__setattr__(self, "raw", Path(self.raw))
        object.__setattr__(self, "out", Path(self.out))
        if self.kind is not None and self.kind not in fmt.KINDS:
            raise ConfigError(f"--kind: {self.kind!r} is not one of {', '.join(fmt.KINDS)}")
        if self.image_size is not None and not 1 <= self.image_size <= 16384:
            raise ConfigError(f"--image-size: {self.image_size} is out of range (1..16384 or 'keep')")
        if self.shard_rows is None and self.shard_bytes is None:
            raise ConfigError("--shard-size: give rows or bytes")
        if self.out.resolve() == self.raw.resolve() or self.raw.resolve() in self.out.resolve().parents:
            raise ConfigError(f"{self.out}: OUT must not lie inside RAW ({self.raw})")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--workers: {self.workers} must be at least 1")
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine: {self.engine!r} is not one of {', '.join(ENGINES)}")
        if self.part is not None and not 0 <= self.part[0] < self.part[1]:
            raise ConfigError(f"--part: {self.part[0]}/{self.part[1]} needs 0 <= i < N")
        if self.append and (self.overwrite or self.part):
            raise ConfigError("--append cannot be combined with --overwrite or --part")
        if self.background is not None and (len(self.background) != 3 or not all(
                isinstance(v, int) and 0 <= v <= 255 for v in self.background)):
            raise ConfigError(f"--background: {self.background} is not three values 0..255 (R,G,B)")
        if self.keep_aspect and self.image_size is None:
            raise ConfigError("--keep-aspect needs a number for --image-size (the shorter side), not 'keep'")
        if self.max_side is not None and not self.keep_aspect:
            raise ConfigError("--max-side caps keep-aspect images: add --keep-aspect")
        if self.max_side is not None and not self.image_size <= self.max_side <= 65535:
            raise ConfigError(f"--max-side: {self.max_side} must lie between --image-size ({self.image_size}) and 65535")
        if not 1 <= self.max_doc_bytes <= 1 << 40:
            raise ConfigError(f"--max-doc-bytes: {self.max_doc_bytes} must lie between 1 and 2**40")
        if self.max_skipped is not None and not 0 <= self.max_skipped <= 1:
            raise ConfigError(f"--max-skipped: {self.max_skipped} is not a fraction between 0 and 1")

    @property
    def side_cap(self) -> int | None:
        """The longer side's cap of a keep-aspect build (None: not one)."""
        return (self.max_side or 2 * self.image_size) if self.keep_aspect else None

    @property
    def num_workers(self) -> int:
        return self.workers or available_cores()


def parse_part(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None:
        raise ConfigError(f"--part: {text!r} is not i/N (e.g. 0/4 for the first of 4 parts)")
    return int(m.group(1)), int(m.group(2))




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
            return _commit(config.out, seconds=time.time() - started, workers=_workers_used(config), cores=cores,
                           max_skipped=config.max_skipped, disk_wait=disk_wait)
        except MmpackError:
            _discard(config)
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
        from .engines import start_method, start_server

        if start_method(tokenizer=config.tokenizer is not None) == "forkserver":
            start_server()


def _workers_used(config: BuildConfig) -> int | str:
    return "ray" if config.engine == "ray" else config.num_workers


def _discard(config: BuildConfig) -> None:
    """After a user error: drop the staging and the generation it was filling (they cannot be
    resumed into anything useful); `outdir.locked` removes an OUT it made and left empty."""
    out = config.out
    shutil.rmtree(outdir.staging_dir(out), ignore_errors=True)
    try:
        current = load_manifest(out)
    except MmpackError:
        current = None
    outdir.remove_unused(out, current)


# -- prepare: scan, plan, fingerprint, claim the staging --------------------------------------
def _prepare(config: BuildConfig) -> Prepared:
    outdir.check_out(config.out, append=config.append, overwrite=config.overwrite, deferred=True)
    _start_pool_server(config)
    with gc_paused():  # a few objects per input file, none in a cycle
        return _scan_and_plan(config)


def _scan_and_plan(config: BuildConfig) -> Prepared:
    existing = DatasetReader(config.out) if config.append else None
    base = existing.manifest if existing else None
    found = scan(config.raw, config.kind or (base.kind if base else None), base.classes if base else None)
    if existing is not None:
        _check_unchanged(config, existing, found)
        found = _only_new(found, existing)
    tokenizer = _tokenizer_for(config, found.kind, found.why)
    columns = _columns(config, found.kind, tokenizer, labeled=found.classes is not None)
    if base is not None:
        _check_compatible(config, base, found.kind, columns, tokenizer)
    itemsize = np.dtype(tokenizer[1].dtype).itemsize if tokenizer else 2
    first = max((s.index for s in base.shards), default=-1) + 1 if base else 0
    the_plan = plan(found, image_size=config.image_size, max_side=config.side_cap, token_itemsize=itemsize,
                    shard_rows=config.shard_rows, shard_bytes=config.shard_bytes, first_index=first,
                    text_key=config.text_key, max_doc_bytes=config.max_doc_bytes)
    skipped = (*found.skipped, *the_plan.skipped)
    if config.strict and skipped:
        raise SourceError(f"{config.raw / skipped[0].key}: {skipped[0].reason} (--strict)")
    if not the_plan.tasks and base is None:
        first_skip = f" (first: {skipped[0].key}: {skipped[0].reason})" if skipped else ""
        raise SourceError(f"{config.raw}: nothing to pack, all {len(skipped)} records skipped{first_skip}")
    params = _params(config, found.kind, tokenizer[1] if tokenizer else None)
    digest = _inputs_digest(found)
    base_sha = hashlib.sha256(base.to_json().encode()).hexdigest() if base else None
    fingerprint = hashlib.sha256(
        json.dumps([params, digest, the_plan.digest(), base_sha], sort_keys=True).encode()).hexdigest()
    doc = {
        "fingerprint": fingerprint, "params": params, "inputs": digest, "records": len(found.records),
        "kind": found.kind, "columns": [asdict(c) for c in columns],
        "classes": list(found.classes) if found.classes is not None else None,
        "tokenizer": asdict(tokenizer[1]) if tokenizer else None,
        "skipped": [asdict(s) for s in skipped], "shards": [t.index for t in the_plan.tasks],
        "items": the_plan.items, "base": base_sha, "layout": found.why,
    }
    published = _claim_staging(config, doc)
    if published is None and not (outdir.staging_dir(config.out) / inputs.STAGED).is_file():
        inputs.write(outdir.staging_dir(config.out), found,
                     (existing.root, base.inputs) if base is not None and base.inputs else None)
    ctx = ShardContext(config.out, doc["generation"], fingerprint, found.kind, columns, config.image_size,
                       config.text_key, tokenizer[1] if tokenizer else None, config.strict, config.raw,
                       config.background, config.side_cap, max_doc_bytes=config.max_doc_bytes)
    return Prepared(config, found, the_plan, ctx, base, published)


def _claim_staging(config: BuildConfig, doc: dict) -> fmt.Manifest | None:
    """Start, resume or refuse: staging belongs to one build, named by its fingerprint. Returns
    the dataset when it is this very build already (published by a run that may have been
    killed before it cleaned up): running a build again is not an error."""
    out = config.out
    staging = outdir.staging_dir(out)
    plan_file = staging / PLAN_FILE
    old = _read_plan(out)
    current = load_manifest(out) if (out / fmt.MANIFEST_NAME).is_file() else None
    if old is not None and old.get("fingerprint") == doc["fingerprint"] and old.get("generation"):
        doc["generation"] = old["generation"]
        if current is not None and current.generation == doc["generation"]:
            return current
    if current is not None and not (config.append or config.overwrite):
        if current.build.get("fingerprint") == doc["fingerprint"]:  # this build is the dataset already
            doc["generation"] = current.generation
            return current
        raise ConfigError(f"{out}: already exists and is not empty; pass --overwrite to rebuild it "
                          "or --append to add new records")
    if old is not None and (old.get("fingerprint") != doc["fingerprint"] or not old.get("generation")):
        if not config.overwrite:
            raise ConfigError(f"{out}: holds an unfinished build with {_difference(old, doc)}; run it again "
                              "with its own arguments to resume it, or pass --overwrite to start over")
        wait_for_writers(staging)
        shutil.rmtree(staging)
        old = None
    staging.mkdir(parents=True, exist_ok=True)
    if old is None:  # the same name for every part of this build, and another than the dataset's now
        seed = f"{doc['fingerprint']}:{current.generation if current else ''}"
        doc["generation"] = fmt.generation_name(hashlib.sha256(seed.encode()).hexdigest())
        outdir.write_atomic(plan_file, json.dumps(doc, indent=1))  # parts racing here write the same
    outdir.prepare_generation(out, doc["generation"])
    return None


def _published(out: Path, doc: dict) -> fmt.Manifest | None:
    """OUT's dataset when it is the build `doc` plans (published already), else None."""
    if not (out / fmt.MANIFEST_NAME).is_file():
        return None
    current = load_manifest(out)
    same = current.generation == doc.get("generation") and current.build.get("fingerprint") == doc.get("fingerprint")
    return current if same else None


def _read_plan(out: Path) -> dict | None:
    try:
        return json.loads((outdir.staging_dir(out) / PLAN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _difference(old: dict, new: dict) -> str:
    changed = [f"{k} {old['params'].get(k)!r} (now {new['params'].get(k)!r})"
               for k in sorted(set(old.get("params", {})) | set(new["params"]))
               if old.get("params", {}).get(k) != new["params"].get(k)]
    if changed:
        return "other arguments: " + ", ".join(changed)
    if old.get("inputs") != new["inputs"]:
        return (f"other inputs: RAW has changed since it began ({old.get('records')} records then, "
                f"{new['records']} now, or files modified)")
    return "another plan (another mmpack version or a changed dataset to append to)"


def _inputs_digest(found: Scan) -> str:
    """Every record's key, size and mtime, the scan's skips, and the classes when some has no
    record (an empty class folder): a changed input, or a new empty folder, changes it, since
    either changes a label. Classes that are the records' own folders are named by the keys
    already, so the digest of such a build is what earlier versions wrote."""
    digest = hashlib.sha256()
    for r in found.records:
        for path in (r.path, r.caption):
            if path is not None:
                size, mtime = found.stats[path]
                digest.update(f"{r.key}\0{os.path.basename(path)}\0{size}\0{mtime}\n".encode())
    for s in found.skipped:
        digest.update(f"skip\0{s.key}\0{s.reason}\n".encode())
    if found.classes is not None and set(found.classes) - {r.key.split("/", 1)[0] for r in found.records}:
        digest.update("classes\0{}\n".format("\0".join(found.classes)).encode())
    return digest.hexdigest()


def _tokenizer_for(config: BuildConfig, kind: str, why: str = ""):
    if kind == "images":
        text_flags = [flag for flag, given in (("--tokenizer", config.tokenizer is not None),
                                                ("--text-key", config.text_key != "text"),
                                                ("--append-eos", config.append_eos is not None),
                                                ("--special-tokens", config.special_tokens)) if given]
        if text_flags:
            raise ConfigError(f"{', '.join(text_flags)}: RAW {config.raw} holds images ({why}), which are not "
                              "tokenized; drop the flag, or pass --kind pairs or --kind text if RAW is not images")
        return None
    if config.tokenizer is None:
        raise ConfigError(f"--tokenizer PATH/tokenizer.json is required to pack {kind}: RAW {config.raw} holds "
                          f"{why}; if it is not {kind}, pass --kind")
    tok = load_tokenizer(config.tokenizer)
    sha256 = file_sha256(config.tokenizer)
    eos_id = resolve_eos(tok, config.append_eos)
    spec = TokenizerSpec(
        path=str(Path(config.tokenizer).resolve()),
        sha256=sha256,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        dtype=token_dtype(tok, eos_id),
        eos_id=eos_id,
        add_special_tokens=config.special_tokens,
    )
    keep_tokenizer(spec, tok)
    return tok, spec


def _columns(config: BuildConfig, kind: str, tokenizer, *, labeled: bool) -> tuple[fmt.Column, ...]:
    size = None if config.keep_aspect else config.image_size
    image = fmt.Column("image", "|u1", (size, size, 3) if size else (None, None, 3))
    key = fmt.Column("key", "|u1", (None,), encoding="utf-8")
    if kind == "images":  # a flat folder has no classes: no label column
        return (image, fmt.Column("label", "<i8", ()), key) if labeled else (image, key)
    tokens = fmt.Column("tokens", tokenizer[1].dtype, (None,))
    return (image, tokens, key) if kind == "pairs" else (tokens, key)


def _params(config: BuildConfig, kind: str, tokenizer: TokenizerSpec | None) -> dict:
    """The arguments a dataset's bytes depend on (not workers, engine, part or timings)."""
    return {
        "raw": printable(str(config.raw.resolve())),
        "kind": kind,
        "image_size": config.image_size,
        "tokenizer_sha256": tokenizer.sha256 if tokenizer else None,
        "text_key": config.text_key,
        "append_eos": config.append_eos,
        "special_tokens": config.special_tokens,
        "shard_rows": config.shard_rows,
        "shard_bytes": config.shard_bytes,
        "strict": config.strict,
        "background": list(config.background) if config.background else None,
        # only where set: the fingerprint of every other build stays what earlier versions wrote,
        # so running a finished build's command again after an upgrade still does nothing
        **({"max_side": config.side_cap} if config.side_cap else {}),
        **({"max_doc_bytes": config.max_doc_bytes} if config.max_doc_bytes != MAX_DOC_BYTES else {}),
    }


# -- append ---------------------------------------------------------------------------------
def record_key(key: str, kind: str) -> str:
    """The record (file) a sample or skip key belongs to: text keys carry ':line' / ':row'."""
    if kind == "text":
        head, _, tail = key.rpartition(":")
        if head and tail.isdigit() and head.lower().endswith(tuple(MULTI_DOC_EXTS)):
            return head
    return key


def _check_unchanged(config: BuildConfig, reader: DatasetReader, found: Scan) -> None:
    """--append adds RAW's new records; files deleted or rewritten since the dataset was built
    would keep their old samples, so they are refused unless --allow-changed says to keep them."""
    base = reader.manifest
    if base.inputs is None:
        log.warning("%s: its build recorded no inputs table (an older mmpack): files of RAW deleted or changed "
                    "since cannot be found; only new files are added", config.out)
        return
    deleted, changed = inputs.changed_since(reader.root, base.inputs, found)
    if (deleted or changed) and not config.allow_changed:
        listed = [f"{k} (deleted)" for k in deleted[:3]] + [f"{k} (changed)" for k in changed[:3]]
        raise ConfigError(f"--append: {len(deleted)} file(s) of {config.raw} deleted and {len(changed)} changed since "
                          f"{config.out} was built ({', '.join(listed)}{', ...' if len(deleted) + len(changed) > 6 else ''}); "
                          "the dataset still holds their old samples. Rebuild with --overwrite, or pass "
                          "--allow-changed to keep those samples as they are and add only the new records")


def _only_new(found: Scan, reader: DatasetReader) -> Scan:
    """The records of RAW that the dataset does not hold yet (packed or skipped before)."""
    base = reader.manifest
    if found.kind != base.kind:
        raise ConfigError(f"--append: RAW holds {found.kind}, the dataset in {reader.root} is {base.kind}")
    known = {record_key(s.key, base.kind) for s in base.skipped}
    known.update(record_key(key.decode("utf-8"), base.kind) for key in reader.key_bytes())
    return replace(found, records=tuple(r for r in found.records if r.key not in known),
                   skipped=tuple(s for s in found.skipped if s.key not in known))


def _check_compatible(config, base: fmt.Manifest, kind: str, columns, tokenizer) -> None:
    where = f"--append to {config.out}"
    if tuple(columns) != tuple(base.columns):
        raise ConfigError(f"{where}: columns differ ({fmt.columns_text(columns)} vs the dataset's {fmt.columns_text(base.columns)}); "
                          "use the dataset's --image-size")
    old = base.build
    for name, new in (("image_size", config.image_size), ("max_side", config.side_cap),
                      ("text_key", config.text_key), ("append_eos", config.append_eos),
                      ("special_tokens", config.special_tokens)):
        if name in old and old[name] != new:
            raise ConfigError(f"{where}: {name} is {new!r}, the dataset was built with {old[name]!r}")
    if base.tokenizer and tokenizer and base.tokenizer.get("sha256") != tokenizer[1].sha256:
        raise ConfigError(f"{where}: tokenizer {config.tokenizer} is not the one the dataset was built with "
                          f"(sha256 {tokenizer[1].sha256[:12]} vs {base.tokenizer['sha256'][:12]})")


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
            from .engines import run_ray

            ran, cores = run_ray(prep.ctx, jobs, advance, prep.config.ray_address), None
        else:  # worker processes only, even one: a decoder or tokenizer that kills its process costs its item
            from .engines import run_pool

            ran = run_pool(prep.ctx, jobs, advance, workers, threads)
    waited = take_disk_wait() / max(1e-9, (time.perf_counter() - started) * workers) if todo else 0.0
    results.update((r.shard.index, r) for r in ran)
    return [results[t.index] for t in tasks], cores, None if cores is None else min(1.0, waited)


# -- commit: every shard there -> manifest, published last ------------------------------------
def commit(out: str | Path, *, max_skipped: float | None = None) -> fmt.Manifest:
    """Publish the build staged in OUT (by `--part` runs) once every planned shard is whole."""
    out = Path(out)
    with outdir.locked(out):
        return _commit(out, max_skipped=max_skipped)


def _commit(out: Path, *, seconds: float | None = None, workers: int | str | None = None,
            cores: int | None = None, max_skipped: float | None = None, disk_wait: float | None = None) -> fmt.Manifest:
    doc = _read_plan(out)
    if doc is None:
        raise ConfigError(f"{out}: nothing to commit (no build staged in {out / fmt.STAGING_DIR})")
    done = _published(out, doc)
    if done is not None:  # a commit killed after its publish, while it removed the staging: finish that
        outdir.publish(out, done)
        return done
    staging = outdir.staging_dir(out)
    results, missing = [], []
    for index in doc["shards"]:
        result = read_sidecar(staging, index, doc["fingerprint"], doc["generation"])
        (missing.append(index) if result is None else results.append(result))
    if missing:
        raise ConfigError(f"{out}: {len(missing)} of {len(doc['shards'])} shards are not built yet "
                          f"(first: {fmt.shard_dir_name(missing[0])}); run the missing parts, then commit")
    new_shards = [r.shard for r in results if r.shard.num_samples]
    strays = [s.dir for s in new_shards if not s.dir.startswith(doc["generation"] + "/")]
    if strays:  # never publish a manifest whose own generation does not hold its new shards
        raise IntegrityError(f"{out}: shard {strays[0]} is not in this build's generation {doc['generation']}; "
                             "run the build again with --overwrite")
    check_file_sizes(out, new_shards)
    skipped = [fmt.Skip(**s) for s in doc["skipped"]] + [k for r in results for k in r.skipped]
    base = None
    if doc["base"] is not None:
        base = load_manifest(out)
        if hashlib.sha256(base.to_json().encode()).hexdigest() != doc["base"]:
            raise IntegrityError(f"{out}: the dataset changed while an append to it was staged; "
                                 "run the append again")
    packed = sum(s.num_samples for s in new_shards)
    if packed == 0 and base is None:
        first = f" (first: {skipped[0].key}: {skipped[0].reason})" if skipped else ""
        shutil.rmtree(staging, ignore_errors=True)
        raise SourceError(f"{doc['params']['raw']}: nothing packed, all {len(skipped)} records skipped{first}")
    counts = {"found": packed + len(skipped), "packed": packed, "skipped": len(skipped)}
    _check_skip_rate(doc, skipped, counts, max_skipped)
    build_info = {**{k: v for k, v in doc["params"].items() if k != "tokenizer_sha256"},
                  "seconds": round(seconds, 3) if seconds is not None else None,
                  "workers": workers, "cores_used": cores, "disk_wait": round(disk_wait, 3) if disk_wait is not None else None,
                  "created_unix": round(time.time(), 3),
                  "mmpack_version": _version(), "layout": f"{doc['kind']}: {doc.get('layout', '')}"}
    if base is not None:  # the append's own counts in its entry, the dataset's in `counts`
        build_info["appended"] = [*base.build.get("appended", []),
                                  {**{k: build_info[k] for k in ("raw", "created_unix", "seconds")}, **counts}]
        build_info = {**base.build, "appended": build_info["appended"]}
        counts = {k: base.counts[k] + counts[k] for k in counts}
    build_info["fingerprint"] = doc["fingerprint"]  # what a run of the same command finds done
    manifest = fmt.Manifest(
        inputs=_commit_inputs(out, doc["generation"]),
        kind=doc["kind"],
        columns=tuple(fmt.Column(**c) for c in doc["columns"]),
        shards=(*(base.shards if base else ()), *new_shards),
        counts=counts,
        skipped=(*(base.skipped if base else ()), *skipped),
        classes=tuple(doc["classes"]) if doc["classes"] is not None else None,
        tokenizer=doc["tokenizer"] if base is None else base.tokenizer,
        build=build_info,
        generation=doc["generation"],
    )
    kept = outdir.publish(out, manifest)
    if kept:
        log.warning("%s: kept %s, still open by a reader; the next build into it removes %s", out,
                    ", ".join(kept), "them" if len(kept) > 1 else "it")
    return manifest


def _commit_inputs(out: Path, generation: str) -> fmt.FileEntry | None:
    """The staged inputs table, moved into the generation (where a killed commit left it too)."""
    staged, final = outdir.staging_dir(out) / inputs.STAGED, out / generation / fmt.INPUTS_NAME
    if staged.is_file():
        os.replace(staged, final)
    if not final.is_file():
        return None
    return fmt.FileEntry(f"{generation}/{fmt.INPUTS_NAME}", final.stat().st_size,
                         checksum_file(final, "xxh3_128"), "xxh3_128")


def _check_skip_rate(doc: dict, skipped: list[fmt.Skip], counts: dict, max_skipped: float | None) -> None:
    """--max-skipped: a build that skips more than this share of what it found fails, its
    reasons counted (a wrong --kind or a broken decoder skips most of a dataset)."""
    if max_skipped is None or not counts["found"] or counts["skipped"] <= max_skipped * counts["found"]:
        return
    reasons = Counter(s.reason.split(" (")[0] for s in skipped).most_common(3)
    top = "; ".join(f"{n} x {reason}" for reason, n in reasons)
    raise SourceError(f"{doc['params']['raw']}: {counts['skipped']:,} of {counts['found']:,} records skipped "
                      f"({counts['skipped'] / counts['found']:.1%}, more than --max-skipped {max_skipped:g}): {top}; "
                      "nothing was published")


def _version() -> str:
    from . import __version__

    return __version__
