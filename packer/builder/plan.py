"""Shard planning: the scanned records cut into shards *before* any decoding, so the shard is
the unit of work and a dataset is the same bytes whatever runs the shards (1 or N workers, N
machines, Ray).

A shard is a tuple of spans. A span is `count` consecutive whole records (images, pairs, .txt
files), or one piece of a big text file: a line range of a JSONL file (byte offsets at line
starts, with the first line's number for keys) or a row range of a Parquet file. Shard sizes
are targets computed from the inputs: rows are exact upper bounds (records per shard); bytes
are estimated from the output size of a sample (images: S*S*3; text: `TEXT_BYTES_PER_TOKEN`
raw bytes per token). Records that are skipped while packing make a shard smaller, never larger.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np

from packer.builder.audio import AudioSpec, header_frames
from packer.dataset import codec
from packer.errors import ConfigError, SourceError
from packer.dataset.format import Skip
from packer.dataset.geometry import keep_aspect_size
from packer.builder.scan import JSONL, PARQUET, Record, Scan
from packer.builder.text import MAX_DOC_BYTES, read_lines

KEY_PROBES = 8  # JSON objects of a file parsed to look for an escaped --text-key (and to name its keys)

TEXT_BYTES_PER_TOKEN = 4  # UTF-8 bytes per token for English BPE/WordPiece, to size text shards
_SAMPLE_OVERHEAD = 64  # label, key and offsets of one sample, roughly


@dataclass(frozen=True)
class Span:
    record: int  # index into Scan.records
    count: int = 1  # whole records record .. record+count-1 (start/stop unused)
    start: int = 0  # JSONL: byte offset of a line start; Parquet: first row
    stop: int | None = None  # JSONL: byte offset (exclusive); Parquet: row (exclusive); None: to the end
    first_line: int = 1  # JSONL: 1-based number of the line at `start`


@dataclass(frozen=True)
class ShardTask:
    index: int
    spans: tuple[Span, ...]
    items: int  # records (images) or documents (text) it covers: the progress unit


@dataclass(frozen=True)
class Plan:
    tasks: tuple[ShardTask, ...]
    skipped: tuple[Skip, ...]  # records found unusable while planning (an unreadable Parquet file)

    @property
    def items(self) -> int:
        return sum(t.items for t in self.tasks)

    def digest(self) -> str:
        doc = {"tasks": [asdict(t) for t in self.tasks], "skipped": [asdict(s) for s in self.skipped]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class _Cutter:
    """Accumulates spans into the current shard and cuts when it reaches the target."""

    def __init__(self, rows: int | None, nbytes: int | None, first_index: int):
        self.rows_limit, self.bytes_limit = rows, nbytes
        self.tasks: list[ShardTask] = []
        self.first_index = first_index
        self._spans: list[Span] = []
        self._rows = self._bytes = 0

    def fills(self, rows: int, nbytes: int) -> bool:
        """Would adding rows/bytes to the current shard fill it?"""
        return bool(
            (self.rows_limit and self._rows + rows >= self.rows_limit)
            or (self.bytes_limit and self._bytes + nbytes >= self.bytes_limit)
        )

    def fitting(self, left: int, each: int) -> int:
        """How many of `left` rows of `each` bytes to add in one run: those that fill the
        current shard (at least one), or all that are left."""
        take = left
        if self.rows_limit:
            take = min(take, self.rows_limit - self._rows)
        if self.bytes_limit:
            take = min(take, max(1, -(-(self.bytes_limit - self._bytes) // each)))
        return take

    def add(self, span: Span, rows: int, nbytes: int) -> None:
        last = self._spans[-1] if self._spans else None
        whole = span.start == 0 and span.stop is None
        if last is not None and whole and last.start == 0 and last.stop is None and last.record + last.count == span.record:
            self._spans[-1] = Span(last.record, last.count + span.count)
        else:
            self._spans.append(span)
        self._rows += rows
        self._bytes += nbytes
        if self.fills(0, 0):
            self.cut()

    def cut(self) -> None:
        if self._spans:
            self.tasks.append(ShardTask(self.first_index + len(self.tasks), tuple(self._spans), self._rows))
        self._spans, self._rows, self._bytes = [], 0, 0


CHAT_IMAGE_GUESS_PIXELS = 1024 * 768  # a conversation's image at its own size, planned before any is decoded


def plan(found: Scan, *, image_size: int | None, token_itemsize: int, shard_rows: int | None,
         shard_bytes: int | None, first_index: int = 0, max_side: int | None = None, text_key: str = "text",
         max_doc_bytes: int = MAX_DOC_BYTES, audio: AudioSpec | None = None, image_share: float = 1.0) -> Plan:
    """Cut the records of a scan into shard tasks numbered from `first_index` (`max_side`: a
    keep-aspect build's cap, whose samples' sizes come from each file's header; `image_share`:
    the share of its pixels' bytes an image is stored in, JPEG_SHARE for the JPEG lane). A JSONL or
    Parquet file none of whose records has `text_key` is a ConfigError: a typo in --text-key
    would otherwise skip every record of it, and exit 0."""
    cutter = _Cutter(shard_rows, shard_bytes, first_index)
    skipped: list[Skip] = []
    if found.kind in ("images", "pairs") and image_size is not None and max_side is None:
        _plan_fixed(cutter, len(found.records), _image_bytes(None, image_size, share=image_share))
    elif found.kind in ("images", "pairs"):
        for i, record in enumerate(found.records):
            cutter.add(Span(i), 1, _image_bytes(record, image_size, max_side, found, image_share))
    elif found.kind == "audio":  # each clip's size from its header (capped), as the image sizes of 'keep'
        frame = audio.channels * np.dtype(audio.dtype).itemsize
        for i, record in enumerate(found.records):
            frames = header_frames(record.path, audio.sample_rate, audio.max_seconds)
            cutter.add(Span(i), 1, frames * frame + _SAMPLE_OVERHEAD)
    else:
        # a conversation's loss mask is a byte a token; its image (where it has one) S x S x 3 bytes,
        # S x the cap's side keep-aspect, a photo's at its own size: what a shard's size is planned
        # by (its files hold what was written)
        itemsize = token_itemsize + (found.kind == "chat")
        extra = 0
        if found.kind == "chat" and (found.fields or {}).get("image"):
            side = max_side or image_size
            extra = int((image_size * side if image_size else CHAT_IMAGE_GUESS_PIXELS) * 3 * image_share)
        for i, record in enumerate(found.records):
            ext = os.path.splitext(record.path)[1].lower()
            try:
                if ext == JSONL:
                    _plan_jsonl(cutter, i, record, itemsize, text_key, max_doc_bytes, extra)
                elif ext == PARQUET:
                    _plan_parquet(cutter, i, record, itemsize, text_key, extra)
                elif ext == ".json" and found.kind == "chat":
                    _plan_json(cutter, i, record, itemsize, text_key, max_doc_bytes, extra)
                else:
                    size = found.stats[record.path][0]  # the scan's stat, as the fingerprint's
                    cutter.add(Span(i), 1, _text_bytes(size, token_itemsize))
            except _Unusable as exc:
                skipped.append(Skip(record.key, "read", str(exc)))
            except OSError as exc:
                skipped.append(Skip(record.key, "read", f"unreadable ({exc.strerror or exc})"))
    cutter.cut()
    return Plan(tuple(cutter.tasks), tuple(skipped))


class _Unusable(Exception):
    pass


def _plan_fixed(cutter: _Cutter, n: int, nbytes: int) -> None:
    """`n` records of `nbytes` each, cut where adding them one at a time would cut, a run of
    records at a time (a million images: 0.04 s, against 1.8 s a record at a time, all of it
    before the first decode)."""
    first = 0
    while first < n:
        take = cutter.fitting(n - first, nbytes)
        cutter.add(Span(first, take), take, take * nbytes)
        first += take


def _image_bytes(record: Record | None, size: int | None, max_side: int | None = None, found: Scan | None = None,
                 share: float = 1.0) -> int:
    if size is not None and max_side is None:
        return int(size * size * 3 * share) + _SAMPLE_OVERHEAD
    dims = header_size(record, found)  # 'keep' and keep-aspect: the header's size, without decoding
    if dims is None or 0 in dims:  # unreadable now means skipped later; it costs nothing here
        return _SAMPLE_OVERHEAD
    w, h = keep_aspect_size(*dims, size, max_side) if size is not None else dims
    return int(w * h * 3 * share) + _SAMPLE_OVERHEAD


def header_size(record: Record, found: Scan | None = None) -> tuple[int, int] | None:
    """A record's image's (width, height) from its header, without decoding, wherever its bytes
    are; None when Pillow cannot tell (EXIF rotation may swap them, which changes no size in
    pixels)."""
    from PIL import Image

    from packer.builder.forms.read import image_source

    try:
        with image_source(record, found.form, found.fields) if found is not None else \
                contextlib.nullcontext(record.path) as source, Image.open(source) as img:
            return img.width, img.height
    except Exception:  # noqa: BLE001 - any image Pillow cannot open: the build skips it later
        return None


def _text_bytes(raw_bytes: int, token_itemsize: int) -> int:
    return raw_bytes * token_itemsize // TEXT_BYTES_PER_TOKEN + _SAMPLE_OVERHEAD


def _plan_jsonl(cutter: _Cutter, i: int, record: Record, itemsize: int, text_key: str, max_bytes: int,
                extra: int = 0) -> None:
    """Line ranges of one JSONL file, cut where the current shard fills (one pass, a line at a
    time, in memory bounded by `max_bytes`); `extra`: bytes a line's sample holds besides its
    tokens (a conversation's image)."""
    start = pos = rows = nbytes = 0
    first_line = line = 1
    key = _KeyProbe(text_key)
    with open(record.path, "rb") as f:
        for raw, size in read_lines(f, max_bytes):
            pos += size
            rows += 1
            nbytes += _text_bytes(size, itemsize) + extra
            line += 1
            if raw is not None:
                key.look(raw)
            if cutter.fills(rows, nbytes):
                cutter.add(Span(i, 1, start, pos, first_line), rows, nbytes)
                start, first_line, rows, nbytes = pos, line, 0, 0
    if pos == 0:
        raise _Unusable("empty file")
    key.check(record)
    if rows:
        whole = start == 0
        cutter.add(Span(i) if whole else Span(i, 1, start, None, first_line), rows, nbytes)


class _KeyProbe:
    """Whether any line of a JSONL file has `key`: its JSON string found in the raw line, or, in
    the first KEY_PROBES objects that lack it, the key itself (written with escapes)."""

    def __init__(self, key: str):
        self.key, self.needle = key, json.dumps(key, ensure_ascii=False).encode("utf-8")
        self.found, self.probed, self.first_keys = False, 0, None

    def look(self, raw: bytes) -> None:
        if self.found or self.needle in raw:
            self.found = True
            return
        if self.probed < KEY_PROBES:
            try:
                obj = json.loads(raw)
            except ValueError:
                return
            if isinstance(obj, dict):
                self.probed += 1
                self.found = self.key in obj
                self.first_keys = self.first_keys or list(obj)

    def check(self, record: Record) -> None:
        if not self.found and self.first_keys is not None:
            raise ConfigError(f"--text-key {self.key!r}: no record of {record.key} has it (its records have "
                              f"{', '.join(map(repr, self.first_keys[:8])) or 'no keys'}); pass the key that holds "
                              "the text")


def _plan_json(cutter: _Cutter, i: int, record: Record, itemsize: int, text_key: str, max_bytes: int,
               extra: int = 0) -> None:
    """Element ranges of one JSON list, as `_plan_jsonl` cuts lines: a span's start and stop
    are elements' byte offsets, its `first_line` the 0-based place of its first element."""
    from packer.builder.forms import jsonarray

    start, rows, nbytes, first, place = 0, 0, 0, 0, -1
    key = _KeyProbe(text_key)
    with open(record.path, "rb") as f:
        try:
            for place, (at, size, raw) in enumerate(jsonarray.elements(f, limit=max_bytes)):
                if rows == 0 and place:
                    start, first = at, place
                rows += 1
                nbytes += _text_bytes(size, itemsize) + extra
                if raw is not None:
                    key.look(raw)
                if cutter.fills(rows, nbytes):
                    cutter.add(Span(i, 1, start, at + size, first), rows, nbytes)
                    rows = nbytes = 0
        except SourceError as exc:  # past the first element: the worker that reads there says so
            if place < 0:
                raise _Unusable(str(exc)) from None
    key.check(record)
    if rows:
        cutter.add(Span(i) if start == 0 else Span(i, 1, start, None, first), rows, nbytes)


def _plan_parquet(cutter: _Cutter, i: int, record: Record, itemsize: int, text_key: str, extra: int = 0) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pfile = pq.ParquetFile(record.path)
        meta = pfile.metadata
    except (pa.ArrowException, OSError) as exc:
        raise _Unusable(f"not a readable Parquet file ({exc})") from None
    names = pfile.schema_arrow.names
    if text_key not in names:
        raise ConfigError(f"--text-key {text_key!r}: {record.key} has no such column (its columns are "
                          f"{', '.join(map(repr, names[:8]))}); pass the column that holds the text")
    total = meta.num_rows
    if total == 0:
        raise _Unusable("no rows")
    per_row = max(1, _text_bytes(sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)),
                                 itemsize) // total) + extra
    row = 0
    while row < total:
        take = cutter.fitting(total - row, per_row)
        whole = row == 0 and take == total
        cutter.add(Span(i) if whole else Span(i, 1, row, row + take), take, take * per_row)
        row += take


def records_of(found: Scan, task: ShardTask) -> Iterator[tuple[Span, Record]]:
    """(span, record) pairs of a task, whole-record spans expanded one record at a time."""
    for span in task.spans:
        if span.start == 0 and span.stop is None:
            for r in range(span.record, span.record + span.count):
                yield Span(r), found.records[r]
        else:
            yield span, found.records[span.record]


def _source_bytes(record: Record, found: Scan) -> int:
    """The bytes of a record's image as the input holds it (a Parquet row's are not known
    without reading it: 0, and the report takes the files' sizes)."""
    if record.at is None:
        return found.stats.get(record.path, (0, 0))[0]
    return record.at[1] if found.form == "tar" else 0


SIZES_SAMPLE = 2000  # headers read for `packer sizes` by default: a 1% error bar on the mean
# images of those decoded and stored as JPEG for its JPEG rows: their share of the pixels' bytes
JPEG_SAMPLE = 100


def size_report(found: Scan, size: int, max_side: int, sample: int | None = SIZES_SAMPLE,
                on_progress=None) -> dict:
    """What RAW's images would take under each storage policy (`packer sizes`): bytes for
    `--image-size size` (S x S crops), `--keep-aspect` with `max_side`, `--image-size keep`, and
    the source files themselves, from the headers of `sample` records drawn evenly (all of them
    when None or when RAW holds fewer), scaled to every record. No pixel is decoded."""
    records = found.records
    n = len(records)
    step = 1.0 if sample is None or n <= sample else n / sample
    picked = [records[int(k * step)] for k in range(n if step == 1.0 else sample)]
    total = {"fixed": 0, "keep_aspect": 0, "keep": 0, "source": 0}
    unreadable = 0
    for done, record in enumerate(picked, 1):
        total["source"] += _source_bytes(record, found)
        dims = header_size(record, found)
        if dims is None or 0 in dims:
            unreadable += 1
        else:
            w, h = keep_aspect_size(*dims, size, max_side)
            total["fixed"] += size * size * 3
            total["keep_aspect"] += w * h * 3
            total["keep"] += dims[0] * dims[1] * 3
        if on_progress is not None:
            on_progress(done, len(picked))
    scale = n / max(len(picked), 1)
    sizes = {k: round(v * scale) for k, v in total.items()}
    shares = jpeg_shares(found, picked[::max(1, len(picked) // JPEG_SAMPLE)][:JPEG_SAMPLE], size, max_side)
    sizes |= {f"jpeg_{k}": round(sizes[k] * share) for k, share in shares.items()}
    if found.form == "parquet":  # its rows' image bytes are not known without reading them: the files'
        sizes["source"] = sum(found.stats[p][0] for p in found.sources)
    return {"records": n, "headers_read": len(picked), "unreadable": unreadable, "size": size,
            "max_side": max_side, "bytes": sizes, "jpeg_quality": codec.DEFAULT_QUALITY}


def jpeg_shares(found: Scan, records: list[Record], size: int, max_side: int) -> dict[str, float]:
    """The share of their pixels' bytes `records`' images take in the JPEG lane (--store jpeg,
    its default quality), for S x S crops ("fixed") and keep-aspect images: each decoded and
    encoded as a build would."""
    from packer.builder.forms.read import image_source
    from packer.builder.images import decode_image

    jpeg = {"fixed": 0, "keep_aspect": 0}
    pixels = dict(jpeg)
    for record in records:
        for policy, cap in (("fixed", None), ("keep_aspect", max_side)):
            try:
                with image_source(record, found.form, found.fields) as source:
                    image = decode_image(source, size, writable=False, max_side=cap)
            except SourceError:
                break
            pixels[policy] += image.nbytes
            jpeg[policy] += codec.encode(image, codec.DEFAULT_QUALITY).data.nbytes
    return {k: jpeg[k] / pixels[k] if pixels[k] else 0.0 for k in jpeg}
