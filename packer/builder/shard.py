"""The shard function: one planned shard from its records to whole column files in staging.

The same function runs in pool worker processes (fixed-size image shards there go in pieces,
`packer.builder.pieces`, with the same bytes) and as a Ray task: it takes a picklable
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
from itertools import islice
from pathlib import Path

import numpy as np
from PIL import Image

from packer.dataset import codec
from packer.dataset import format as fmt
from packer.dataset import writer
from packer.errors import SourceError
from packer.dataset.outdir import write_atomic
from packer.builder.audio import AudioSpec, clipped, decode_audio
from packer.builder.chat.template import TemplateSpec
from packer.builder.forms.read import caption_of, image_source
from packer.builder.images import decode_image, flattened, pixel_limit
from packer.builder.plan import ShardTask, Span
from packer.builder.scan import Record, read_ahead
from packer.system import flock
from packer.builder.config import BuildConfig
from packer.builder.text import Document, TokenizerSpec, iter_documents, key_bytes, tokenized

PROGRESS_EVERY_S = 0.2


@dataclass(frozen=True)
class ShardContext:
    """What every shard of one build shares: its configuration and what the build found and
    planned; picklable, small."""

    config: BuildConfig
    generation: str  # the generation dir whole shards go into
    fingerprint: str
    kind: str
    columns: tuple[fmt.Column, ...]
    tokenizer: TokenizerSpec | None
    form: str = "folder"  # where records' bytes are (`packer.builder.forms`)
    fields: dict | None = None  # the form's field of each role
    # the pixel limit as the build process knows it (--max-pixels, or a script's Pillow limit):
    # workers start from a forkserver and would otherwise decode with Pillow's default
    max_image_pixels: int | None = field(default_factory=pixel_limit)
    audio: AudioSpec | None = None  # an audio build's rate, channels and dtype
    chat: TemplateSpec | None = None  # a chat build's template

    def decode(self, record: Record):
        """A record's pixels, as this build decodes them (read-only), wherever its bytes are;
        with --store jpeg, those pixels as the JPEG lane stores them (`codec.Encoded`)."""
        if Image.MAX_IMAGE_PIXELS != self.max_image_pixels:
            Image.MAX_IMAGE_PIXELS = self.max_image_pixels
        c = self.config
        with image_source(record, self.form, self.fields) as source:
            pixels = decode_image(source, c.image_size, writable=False, background=c.background, max_side=c.side_cap)
        store, quality = codec.parse_store(c.store)
        if store != codec.JPEG:
            return pixels
        try:
            return codec.encode(pixels, quality)
        except (OSError, ValueError) as exc:  # libjpeg's limits: a side over 65,500 ('--image-size keep')
            raise SourceError(f"cannot store as JPEG ({type(exc).__name__}: {str(exc)[:200]})") from None

    def caption(self, record: Record) -> str:
        return caption_of(record, self.form, self.fields, self.config.max_doc_bytes)

    @property
    def out(self) -> Path:
        return self.config.out

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
    flattened: int = 0  # its images whose transparency was dropped (`images.flattened`)
    audio_clipped: int = 0  # its clips' values not stored as decoded (`audio.clipped`)


# -- progress: a sink set per process (a callback in the build process, a queue in workers) ---
_sink: Callable[[tuple[int, float]], None] | None = None


def set_progress_sink(sink: Callable[[tuple[int, float]], None] | None) -> None:
    global _sink
    _sink = sink


class Ticker:
    def __init__(self):
        self.pending, self.last = 0, time.monotonic()

    def tick(self, n: int = 1, *, flush: bool = False) -> None:
        """n more items done; sent on (with the seconds this process waited on the disk since it
        last sent, `writer.take_disk_wait`) every PROGRESS_EVERY_S, and when flushed."""
        self.pending += n
        now = time.monotonic()
        if _sink is not None and (flush or now - self.last >= PROGRESS_EVERY_S):
            waited = writer.take_disk_wait()
            if self.pending or waited:
                _sink((self.pending, waited))
            self.pending, self.last = 0, now


# -- sidecars ------------------------------------------------------------------------------
def sidecar_path(staging: Path, index: int) -> Path:
    return staging / f"{fmt.shard_dir_name(index)}.json"


def _write_sidecar(ctx: ShardContext, result: ShardResult) -> None:
    doc = {"fingerprint": ctx.fingerprint, "shard": asdict(result.shard),
           "skipped": [asdict(s) for s in result.skipped], "items": result.items, "flattened": result.flattened,
           "audio_clipped": result.audio_clipped}
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
        return ShardResult(shard, tuple(fmt.Skip(**k) for k in doc["skipped"]), doc["items"], reused=True,
                           flattened=doc.get("flattened", 0), audio_clipped=doc.get("audio_clipped", 0))
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
def run_shard(ctx: ShardContext, task: ShardTask, records: list[tuple[Span, Record]],
              crashed: frozenset[int] = frozenset()) -> ShardResult:
    """Pack one planned shard into staging, under its lock; deterministic: same inputs, same
    bytes. A shard that another run finished while this one waited for its lock is reused as it
    is. `crashed`: the places of items (records; documents for text) that killed the process
    that tried them, skipped here, not tried again (found by `probe`)."""
    with shard_lock(ctx.staging, task.index):
        done = reusable(ctx, task.index)
        if done is not None:
            Ticker().tick(done.items, flush=True)
            return done
        before, clipped_before = flattened(), clipped()
        shard, skipped, items = _fill(ctx, task, records, crashed)
        result = finish(ctx, task.index, shard, skipped, items, flattened() - before, clipped() - clipped_before)
    Ticker().tick(0, flush=True)  # the shard's fsyncs, in the build's disk wait
    return result


def _fill(ctx: ShardContext, task: ShardTask, records: list[tuple[Span, Record]], crashed: frozenset[int] = frozenset()):
    skipped: list[fmt.Skip] = []
    ticker = Ticker()
    items = 0
    with tracing(ctx.staging, task.index) as busy:
        shard = ctx.shard_writer(task.index)
        try:
            for item in _samples(ctx, records, ticker, crashed.__contains__, busy):
                items += 1
                if isinstance(item, fmt.Skip):
                    check_strict(ctx, item)
                    skipped.append(item)
                else:
                    shard.add(item)
            ticker.tick(0, flush=True)
        except BaseException:
            shard.abort()
            raise
    return shard, skipped, items


# -- tracing a dying worker to its item --------------------------------------------------------
def busy_path(staging: Path, index: int, first: int | None = None) -> Path:
    """The trace file of shard `index` run whole, or of its piece from slot `first`."""
    return staging / f"{fmt.shard_dir_name(index)}{'' if first is None else f'.{first}'}.busy"


@contextlib.contextmanager
def tracing(staging: Path, index: int, first: int | None = None) -> Iterator[Callable[[int, int], None]]:
    """busy(lo, hi): the items (places in the shard) this process is on from now, noted in a
    file that only a process that dies leaves behind (an error is no crash)."""
    path = busy_path(staging, index, first)
    with writer.naming(path):  # pwrite's ENOSPC names no file
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def busy(lo: int, hi: int) -> None:
        with writer.naming(path):
            os.pwrite(fd, lo.to_bytes(8, "little") + hi.to_bytes(8, "little"), 0)

    try:
        yield busy
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def read_busy(staging: Path, index: int, first: int | None = None) -> tuple[int, int] | None:
    """The items (lo, hi) a process was reading, decoding or tokenizing when it died (None: it
    had not started one), and the trace gone, so that a later look cannot find it again."""
    path = busy_path(staging, index, first)
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    path.unlink(missing_ok=True)
    return (int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")) if len(raw) == 16 else None


def probe(ctx: ShardContext, records: list[tuple[Span, Record]], lo: int, hi: int,
          crashed: frozenset[int] = frozenset()) -> None:
    """Read, decode and tokenize items lo..hi-1 of a shard (less those `crashed`) as the shard
    function does, and write nothing: run in a process of its own, it tells whether one of them
    kills it."""
    set_progress_sink(None)
    for _ in _samples(ctx, records, Ticker(), lambda n: n in crashed or not lo <= n < hi, stop=hi):
        pass


def finish(ctx: ShardContext, index: int, shard: writer.ShardWriter, skipped: list, items: int,
           flat: int = 0, audio_clipped: int = 0) -> ShardResult:
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
    result = ShardResult(done, tuple(skipped), items, flattened=flat, audio_clipped=audio_clipped)
    _write_sidecar(ctx, result)
    return result


def check_strict(ctx: ShardContext, skip: fmt.Skip) -> None:
    if ctx.config.strict:
        raise SourceError(f"{ctx.config.raw / skip.key.split(':')[0]}: {skip.reason} (--strict)")


CRASHED = {"images": ("decode", "the decoder crashed (its process died) on this file"),
           "audio": ("decode", "the decoder crashed (its process died) on this file"),
           "pairs": ("decode", "its process died reading, decoding or tokenizing this pair"),
           "text": ("tokenize", "the tokenizer crashed (its process died) on this document"),
           "chat": ("chat", "its process died rendering, tokenizing or decoding this conversation")}


def _samples(ctx: ShardContext, records, ticker: Ticker, skip=lambda n: False, busy=None,
             stop: int | None = None) -> Iterator:
    """Samples (dicts of arrays) and Skips of a shard's records, in record order; the items
    (records; documents for text) at places n where skip(n) are skipped untried, as crashed.
    busy(lo, hi): see `tokenized`. `stop`: no item from that place on."""
    records = read_ahead(records, lambda item: item[1])
    stage, reason = CRASHED[ctx.kind]
    if ctx.kind == "chat":
        yield from _chat_samples(ctx, records, ticker, skip, busy, stop)
        return
    if ctx.kind == "images" or (ctx.kind == "audio" and ctx.tokenizer is None):
        sample = _image_sample if ctx.kind == "images" else _audio_item
        for n, (_, record) in enumerate(islice(records, stop)):
            if busy is not None:
                busy(n, n + 1)
            yield fmt.Skip(record.key, stage, reason) if skip(n) else sample(ctx, record)
            ticker.tick()
        return

    def items() -> Iterator:
        n = 0
        for span, record in records:
            if ctx.kind in ("pairs", "audio"):
                item = _pair_item if ctx.kind == "pairs" else _audio_item
                yield fmt.Skip(record.key, stage, reason) if skip(n) else item(ctx, record)
                n += 1
            else:
                for doc in iter_documents(record, ctx.config.text_key, span.start, span.stop, span.first_line,
                                          max_bytes=ctx.config.max_doc_bytes):
                    yield fmt.Skip(doc.key, stage, reason) if skip(n) and isinstance(doc, Document) else doc
                    n += 1
                    if n == stop:
                        return
            if n == stop:
                return

    yield from tokenized(items(), ctx.tokenizer, ticker.tick, busy)


def _chat_samples(ctx: ShardContext, records, ticker: Ticker, skip, busy, stop: int | None) -> Iterator:
    """A chat shard's samples: each record of its spans rendered, tokenized (and its images
    decoded) one at a time, a record at place n skipped untried where skip(n)."""
    from packer.builder.chat.read import records as chat_records
    from packer.builder.chat.sample import ChatPacker

    packer = ChatPacker(ctx)
    stage, reason = CRASHED["chat"]
    n = 0
    for span, record in records:
        folder = os.path.dirname(record.path)
        for item in chat_records(record, span, ctx.config.max_doc_bytes):
            if n == stop:
                return
            if busy is not None:
                busy(n, n + 1)
            if isinstance(item, fmt.Skip):
                yield item
            else:
                yield fmt.Skip(item[0], stage, reason) if skip(n) else packer.sample(*item, folder)
            n += 1
            ticker.tick()


def _image_sample(ctx: ShardContext, record: Record):
    try:
        if record.size is not None:
            check_annotated_size(record)
        pixels = ctx.decode(record)
    except SourceError as exc:
        return fmt.Skip(record.key, "decode", str(exc))
    return {"image": pixels, **image_fields(record)}


def check_annotated_size(record: Record) -> None:
    """SourceError where an image is not what its annotation's boxes were drawn on: another size,
    or an EXIF orientation the build would turn it by."""
    try:
        with Image.open(record.path) as img:
            size, orientation = img.size, img.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 - one Pillow cannot open: the decode says why
        return
    if size != record.size:
        raise SourceError(f"its file is {size[0]}x{size[1]}, its annotation says {record.size[0]}x{record.size[1]}: "
                          "its boxes would not fit it")
    if orientation not in (1, None):
        raise SourceError(f"EXIF orientation {orientation}: its boxes are in the file's own orientation, which a build "
                          "turns (strip the tag, or rotate the file and its boxes)")


def image_fields(record: Record) -> dict:
    """Label (not in a flat folder's dataset), --fields' values and key of an image record."""
    key = {**dict(record.extra), "key": key_bytes(record.key)}
    return key if record.label is None else {"label": np.int64(record.label), **key}


def _audio_item(ctx: ShardContext, record: Record):
    """An audio record's sample (with a tokenizer: its transcript as a Document, and the rest)."""
    if ctx.tokenizer is not None:
        try:
            transcript = ctx.caption(record)
        except SourceError as exc:
            return fmt.Skip(record.key, "transcript", str(exc).replace("caption", "transcript"))
    try:
        clip = decode_audio(record.path, ctx.audio)
    except SourceError as exc:
        return fmt.Skip(record.key, "decode", str(exc))
    fields = {"audio": clip, **dict(record.extra)} if record.label is None else {
        "audio": clip, "label": np.int64(record.label), **dict(record.extra)}
    return (Document(record.key, transcript), fields) if ctx.tokenizer is not None else {
        **fields, "key": key_bytes(record.key)}


def _pair_item(ctx: ShardContext, record: Record):
    try:
        caption = ctx.caption(record)
    except SourceError as exc:
        return fmt.Skip(record.key, "caption", str(exc))
    try:
        pixels = ctx.decode(record)
    except SourceError as exc:
        return fmt.Skip(record.key, "decode", str(exc))
    return Document(record.key, caption), {"image": pixels, **dict(record.extra)} if record.label is None else {
        "image": pixels, "label": np.int64(record.label), **dict(record.extra)}
