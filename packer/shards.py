"""The shard function: one planned shard from its records to whole column files in staging.

The same function runs in the build process (`--workers 1`), in pool worker processes (image
shards there go in pieces, below, with the same bytes), and as a Ray task: it takes a picklable
context and task and returns a picklable result. A finished shard is `OUT/<generation>/shard-k/`
plus `OUT/.staging/shard-k.json` (its files with sizes and checksums, its skips, and the build
fingerprint), which is what lets a killed build resume and what `packer commit` assembles the
manifest from. Partial shards are written in `OUT/.staging/shard-k.partial/`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from . import format as fmt
from . import writer
from .errors import ConfigError, SourceError
from .outdir import write_atomic
from .images import decode_image
from .plan import ShardTask, Span
from .sources import Record, read_ahead
from .system import flock, linux_libc, process_alive
from .text import Document, TokenizerSpec, iter_documents, key_bytes, read_caption, tokenized

PROGRESS_EVERY_S = 0.2


@dataclass(frozen=True)
class ShardContext:
    """What every shard of one build shares; picklable, small."""

    out: Path
    generation: str  # the generation dir whole shards go into
    fingerprint: str
    kind: str
    columns: tuple[fmt.Column, ...]
    image_size: int | None
    text_key: str
    tokenizer: TokenizerSpec | None
    strict: bool
    raw: Path
    background: tuple[int, int, int] | None = None  # --background: composite transparency over it
    max_side: int | None = None  # --keep-aspect: the longer side's cap (None: S x S centre crops)
    # Pillow's decompression-bomb limit in the build process (a script may change it): workers
    # start from a forkserver and would otherwise decode with Pillow's default
    max_image_pixels: int | None = field(default_factory=lambda: Image.MAX_IMAGE_PIXELS)

    def decode(self, path: str):
        """A record's pixels, as this build decodes them (read-only)."""
        if Image.MAX_IMAGE_PIXELS != self.max_image_pixels:
            Image.MAX_IMAGE_PIXELS = self.max_image_pixels
        return decode_image(path, self.image_size, writable=False, background=self.background, max_side=self.max_side)

    @property
    def staging(self) -> Path:
        return self.out / fmt.STAGING_DIR

    def shard_writer(self, index: int, **slots) -> writer.ShardWriter:
        """The writer of shard `index`, whose whole dir goes into this build's generation."""
        rel = fmt.shard_path(self.generation, index)
        return writer.ShardWriter(self.staging, index, self.columns, final_dir=self.out / rel, rel_dir=rel, **slots)


@dataclass(frozen=True)
class ShardResult:
    shard: fmt.Shard  # num_samples 0 and no files when every record of it was skipped
    skipped: tuple[fmt.Skip, ...]
    items: int
    reused: bool = False


# -- progress: a sink set per process (a callback in the build process, a queue in workers) ---
_sink: Callable[[int], None] | None = None


def set_progress_sink(sink: Callable[[int], None] | None) -> None:
    global _sink
    _sink = sink


class _Ticker:
    def __init__(self):
        self.pending, self.last = 0, time.monotonic()

    def tick(self, n: int = 1, *, flush: bool = False) -> None:
        self.pending += n
        now = time.monotonic()
        if _sink is not None and self.pending and (flush or now - self.last >= PROGRESS_EVERY_S):
            _sink(self.pending)
            self.pending, self.last = 0, now


def init_worker(queue, rayon_threads: int | None, build_pid: int | None = None, staging: Path | None = None) -> None:
    """Pool worker initializer: dies with the build process (`build_pid`: its parent may be a
    forkserver), holds the staging's workers lock shared for life (so a build started after this
    one was killed waits for it to be gone), progress to the parent's queue; tokenizers' Rust
    pool sized so that N workers do not oversubscribe the cores (set before its first use)."""
    _die_with_parent()
    if build_pid is not None:
        die_with(build_pid)
    if staging is not None:
        _held.append(hold_workers_lock(staging))
    if rayon_threads:
        os.environ["RAYON_NUM_THREADS"] = str(rayon_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    set_progress_sink(queue.put if queue is not None else None)


_held: list = []  # the workers lock of this worker process, open for its whole life


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent goes (a `kill -9` of the build), so no orphan
    keeps writing into a staging dir that a restarted build is using."""
    import signal

    prctl = linux_libc("prctl")
    if prctl is not None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def die_with(pid: int) -> None:
    """SIGKILL this process as soon as process `pid` ends: a thread waits on a pidfd (Linux 5.3;
    elsewhere it looks every WATCH_S). PR_SET_PDEATHSIG alone watches only the parent, which for
    a forkserver's worker is the server, not the build."""
    import select
    import signal
    import threading

    def kill_me() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        kill_me()
    except (AttributeError, OSError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has exited
        else:
            while process_alive(pid):
                time.sleep(WATCH_S)
        kill_me()

    threading.Thread(target=watch, daemon=True, name="mmpack-watch-build").start()


WATCH_S = 0.2


def workers_lock_path(staging: Path) -> Path:
    return staging / "workers.lock"


def hold_workers_lock(staging: Path):
    """A shared flock on the staging's workers lock, held until this process ends."""
    f = open(workers_lock_path(staging), "a")
    flock(f, shared=True)
    return f


def wait_for_old_workers(staging: Path, timeout_s: float = 30.0) -> None:
    """Before a build writes: no worker of an earlier build of this OUT (killed, its workers
    not yet gone) is alive. They hold the workers lock shared; this takes it exclusively once."""
    staging.mkdir(parents=True, exist_ok=True)
    with open(workers_lock_path(staging), "a") as f:
        deadline = time.monotonic() + timeout_s
        while not flock(f, block=False):
            if time.monotonic() > deadline:
                raise ConfigError(f"{staging.parent}: worker processes of an earlier build still run after "
                                  f"{timeout_s:.0f} s; stop them (fuser {workers_lock_path(staging)}), then "
                                  "run this again")
            time.sleep(0.05)


# -- sidecars ------------------------------------------------------------------------------
def sidecar_path(staging: Path, index: int) -> Path:
    return staging / f"{fmt.shard_dir_name(index)}.json"


def _write_sidecar(ctx: ShardContext, result: ShardResult) -> None:
    doc = {"fingerprint": ctx.fingerprint, "shard": asdict(result.shard),
           "skipped": [asdict(s) for s in result.skipped], "items": result.items}
    write_atomic(sidecar_path(ctx.staging, result.shard.index), json.dumps(doc))


def read_sidecar(staging: Path, index: int, fingerprint: str, generation: str) -> ShardResult | None:
    """The recorded result of a finished shard, or None when there is none for this build (its
    fingerprint, and its generation: a sidecar left by a run of the same build into another
    generation, killed while it published, describes files that are not this run's)."""
    try:
        doc = json.loads(sidecar_path(staging, index).read_text(encoding="utf-8"))
        if doc.get("fingerprint") != fingerprint or not all(
                f["path"].startswith(generation + "/") for f in doc["shard"]["files"]):
            return None
        s = doc["shard"]
        files = tuple(fmt.FileEntry(f["path"], f["size_bytes"], f["checksum"], f["algo"]) for f in s["files"])
        shard = fmt.Shard(s["index"], s["num_samples"], files)
        return ShardResult(shard, tuple(fmt.Skip(**k) for k in doc["skipped"]), doc["items"], reused=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def reusable(ctx: ShardContext, index: int) -> ShardResult | None:
    """A finished shard of this very build, whole on disk: sidecar, sizes and checksums all match."""
    result = read_sidecar(ctx.staging, index, ctx.fingerprint, ctx.generation)
    if result is None:
        return None
    for entry in result.shard.files:
        path = ctx.out / entry.path
        try:
            if path.stat().st_size != entry.size_bytes or writer.checksum_file(path) != entry.checksum:
                return None
        except OSError:
            return None
    return result


@contextlib.contextmanager
def shard_lock(staging: Path, index: int) -> Iterator[None]:
    """Held while a process writes shard `index` (flock on `shard-k.lock` in staging). A build
    started again right after a `kill -9` waits for the old build's worker, which may still be
    finishing that shard for a few ms; two runs of the same part take turns. The kernel drops the
    lock when its holder dies. File systems without flock (some shared ones) go unlocked."""
    with _flock(staging / f"{fmt.shard_dir_name(index)}.lock"):
        yield


def wait_for_writers(staging: Path) -> None:
    """Return once no process holds a shard lock in `staging`: before --overwrite deletes an
    unfinished build, the killed build's last workers finish the shards they were writing."""
    for path in sorted(staging.glob("*.lock")):
        with _flock(path):
            pass


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    if sys.platform == "win32":
        yield
        return
    with writer.naming(path):
        f = open(path, "a")
    with f:
        flock(f)
        yield


# -- the shard function --------------------------------------------------------------------
def run_shard(ctx: ShardContext, task: ShardTask, records: list[tuple[Span, Record]]) -> ShardResult:
    """Pack one planned shard into staging; deterministic: same inputs, same bytes. A shard that
    another run finished while this one waited for its lock is reused as it is."""
    return fill_shard(ctx, task, records).close()


class FilledShard:
    """A shard whose samples are all written (or one found whole): close() finishes it (fsync,
    checksums, sidecar), abort() drops it; either releases its lock. One process can close it on
    a thread while it fills the next shard, instead of waiting for the fsync."""

    def __init__(self, ctx: ShardContext, index: int, lock: contextlib.ExitStack, *, done: ShardResult | None = None,
                 shard: writer.ShardWriter | None = None, skipped: list | None = None, items: int = 0):
        self.ctx, self.index, self.lock, self.done = ctx, index, lock, done
        self.shard, self.skipped, self.items = shard, skipped, items

    def close(self) -> ShardResult:
        with self.lock:
            if self.done is None:
                self.done = _finish(self.ctx, self.index, self.shard, self.skipped, self.items)
            return self.done

    def abort(self) -> None:
        with self.lock:
            if self.done is None:
                self.shard.abort()


def fill_shard(ctx: ShardContext, task: ShardTask, records: list[tuple[Span, Record]]) -> FilledShard:
    """The first step of run_shard: every sample of shard `task` written, under its lock."""
    lock = contextlib.ExitStack()
    lock.enter_context(shard_lock(ctx.staging, task.index))
    try:
        done = reusable(ctx, task.index)
        if done is not None:
            _Ticker().tick(done.items, flush=True)
            return FilledShard(ctx, task.index, lock, done=done)
        shard, skipped, items = _fill(ctx, task, records)
    except BaseException:
        lock.close()
        raise
    return FilledShard(ctx, task.index, lock, shard=shard, skipped=skipped, items=items)


def _fill(ctx: ShardContext, task: ShardTask, records: list[tuple[Span, Record]]):
    skipped: list[fmt.Skip] = []
    ticker = _Ticker()
    items = 0
    shard = ctx.shard_writer(task.index)
    try:
        for item in _samples(ctx, records, ticker):
            items += 1
            if isinstance(item, fmt.Skip):
                _check_strict(ctx, item)
                skipped.append(item)
            else:
                shard.add(item)
        ticker.tick(0, flush=True)
    except BaseException:
        shard.abort()
        raise
    return shard, skipped, items


def _finish(ctx: ShardContext, index: int, shard: writer.ShardWriter, skipped: list, items: int) -> ShardResult:
    """Close a shard whose samples are all added (or drop it: every record skipped), then its
    sidecar: from here on it is whole and reusable."""
    try:
        if shard.num_samples == 0:
            shard.abort()
            done = fmt.Shard(index, 0, ())
        else:
            done = shard.close()
    except BaseException:
        shard.abort()
        raise
    result = ShardResult(done, tuple(skipped), items)
    _write_sidecar(ctx, result)
    return result


def _check_strict(ctx: ShardContext, skip: fmt.Skip) -> None:
    if ctx.strict:
        raise SourceError(f"{ctx.raw / skip.key.split(':')[0]}: {skip.reason} (--strict)")


# -- image shards in pieces: several processes fill one shard's image column -----------------
# A pool builds an image shard as pieces of records, each run by whichever worker is free: the
# build process opens the shard (a slot per record in image.npy), pieces decode into their
# slots, and the last step writes labels and keys, squeezes out skipped records' slots and
# closes the shard as run_shard would: the bytes are the same. Work is shared image by image,
# so no core waits while the last shard is packed by one worker.
PIECE_ROWS = 128
MIN_PIECE_ROWS = 16


def piece_bounds(rows: int, *, last: bool, lanes: int) -> list[tuple[int, int]]:
    """(first, stop) of each piece of a shard of `rows` records. PIECE_ROWS each: a piece costs
    the pool about a millisecond of CPU on its way (its records pickled, two queues, three
    threads woken), small beside 128 decodes (a quarter of a second of a core; pieces of 32 took
    1% of a 2-core build). The build's last shard is cut finer as it nears its end, a piece at
    most 1 / (2 x lanes) of the rows left and at least MIN_PIECE_ROWS (guided
    self-scheduling), so the decoding lanes finish within a few images of each other."""
    bounds, first = [], 0
    while first < rows:
        size = max(MIN_PIECE_ROWS, min(PIECE_ROWS, (rows - first) // (2 * lanes))) if last else PIECE_ROWS
        bounds.append((first, min(rows, first + size)))
        first += size
    return bounds


def open_pieces(ctx: ShardContext, task: ShardTask) -> ShardResult | None:
    """Start shard `task` as pieces (a fresh partial dir, image.npy with a slot per record);
    returns the shard instead when another run finished it meanwhile."""
    with shard_lock(ctx.staging, task.index):
        done = reusable(ctx, task.index)
        if done is not None:
            return done
        writer.partial_dir(ctx.staging, task.index, fresh=True)
        writer.create_slots(_image_path(ctx, task.index), _image_column(ctx), task.items)
    return None


def run_piece(ctx: ShardContext, index: int, first: int, records: list[Record], *, writeback: bool = False,
              crashed: tuple[int, ...] = ()) -> tuple[dict[int, fmt.Skip], dict[int, bytes]]:
    """Decode records into slots first, first + 1, ... of shard `index`; returns the skips and
    the written rows' checksum digests (SlotWriter.put), by slot. `writeback`: start writing the
    rows to disk at once (the build's last shard, whose fsync no decoding overlaps; the other
    shards' rows are written by their fsync, on the side). `crashed`: slots whose decode killed
    the process that tried (skipped here, not decoded again). The slot being decoded is noted
    in a progress file, so that the build can tell which record killed a process."""
    ticker = _Ticker()
    slots = writer.SlotWriter(_image_path(ctx, index), _image_column(ctx))
    progress = os.open(_progress_path(ctx, index, first), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    skips, digests = {}, {}
    try:
        for slot, record in enumerate(records, start=first):
            if slot in crashed:
                skip = fmt.Skip(record.key, "decode", "the decoder crashed (its process died) on this file")
            else:
                os.pwrite(progress, slot.to_bytes(8, "little"), 0)
                try:
                    digests[slot] = slots.put(slot, ctx.decode(record.path))
                    skip = None
                except SourceError as exc:
                    skip = fmt.Skip(record.key, "decode", str(exc))
            if skip is not None:
                _check_strict(ctx, skip)
                skips[slot] = skip
            ticker.tick()
        if writeback:
            slots.start_writeback(first, len(records))
    finally:
        slots.close()
        os.close(progress)
    os.unlink(_progress_path(ctx, index, first))
    ticker.tick(0, flush=True)
    return skips, {slot: d for slot, d in digests.items() if d is not None}


def _progress_path(ctx: ShardContext, index: int, first: int) -> Path:
    return ctx.staging / f"{fmt.shard_dir_name(index)}.{first}.progress"


def read_progress(ctx: ShardContext, index: int, first: int) -> int | None:
    """The slot a piece's process was decoding when it died (None: it had not started one)."""
    try:
        raw = _progress_path(ctx, index, first).read_bytes()
    except OSError:
        return None
    return int.from_bytes(raw, "little") if len(raw) == 8 else None


def finish_pieces(ctx: ShardContext, task: ShardTask, records: list[tuple[Span, Record]],
                  skips: dict[int, fmt.Skip], digests: dict[int, bytes]) -> ShardResult:
    """Every piece of shard `task` done: labels and keys of the kept records, then close (the
    image rows' digests, from the pieces, give that file's checksum)."""
    with shard_lock(ctx.staging, task.index):
        keep = [slot not in skips for slot in range(len(records))]
        shard = ctx.shard_writer(task.index, slots={"image": keep}, digests={"image": digests})
        try:
            shard.extend([_image_fields(record) for (_, record), kept in zip(records, keep) if kept])
        except BaseException:
            shard.abort()
            raise
        return _finish(ctx, task.index, shard, [skips[s] for s in sorted(skips)], len(records))


def in_pieces(ctx: ShardContext) -> bool:
    """Image shards of one fixed size go to a pool as pieces."""
    return ctx.kind == "images" and not _image_column(ctx).ragged


def _image_column(ctx: ShardContext) -> fmt.Column:
    return next(c for c in ctx.columns if c.name == "image")


def _image_path(ctx: ShardContext, index: int) -> Path:
    return writer.partial_dir(ctx.staging, index) / fmt.column_file_names(_image_column(ctx))["values"]


def _samples(ctx: ShardContext, records, ticker: _Ticker) -> Iterator:
    """Samples (dicts of arrays) and Skips of a shard's records, in record order."""
    records = read_ahead(records, lambda item: item[1])
    if ctx.kind == "images":
        for _, record in records:
            yield _image_sample(ctx, record)
            ticker.tick()
        return

    def items() -> Iterator:
        for span, record in records:
            if ctx.kind == "pairs":
                yield _pair_item(ctx, record)
            else:
                yield from iter_documents(record, ctx.text_key, span.start, span.stop, span.first_line)

    yield from tokenized(items(), ctx.tokenizer, ticker.tick)


def _image_sample(ctx: ShardContext, record: Record):
    try:
        pixels = ctx.decode(record.path)
    except SourceError as exc:
        return fmt.Skip(record.key, "decode", str(exc))
    return {"image": pixels, **_image_fields(record)}


def _image_fields(record: Record) -> dict:
    """Label (not in a flat folder's dataset) and key of an image record."""
    key = {"key": key_bytes(record.key)}
    return key if record.label is None else {"label": np.int64(record.label), **key}


def _pair_item(ctx: ShardContext, record: Record):
    try:
        caption = read_caption(record.caption)
    except SourceError as exc:
        return fmt.Skip(record.key, "caption", str(exc))
    try:
        pixels = ctx.decode(record.path)
    except SourceError as exc:
        return fmt.Skip(record.key, "decode", str(exc))
    return Document(record.key, caption), {"image": pixels}
