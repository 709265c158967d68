"""Image shards in pieces: several worker processes fill one shard's image column.

A pool builds an image shard as pieces of records, each run by whichever worker is free: the
build process opens the shard (a slot per record in image.npy), pieces decode into their
slots, and the last step writes labels and keys, squeezes out skipped records' slots and
closes the shard as run_shard would: the bytes are the same. Work is shared image by image,
so no core waits while the last shard is packed by one worker.
"""

from __future__ import annotations

from pathlib import Path

from packer.dataset import format as fmt
from packer.dataset import writer
from packer.errors import SourceError
from packer.builder.plan import ShardTask, Span
from packer.builder.shard import (CRASHED, ShardContext, ShardResult, Ticker, check_strict, finish, image_fields, reusable,
                     shard_lock, tracing)
from packer.builder.images import flattened
from packer.builder.records import Record

PIECE_ROWS = 128
MIN_PIECE_ROWS = 16


def piece_bounds(rows: int, *, last: bool, lanes: int) -> list[tuple[int, int]]:
    """(first, stop) of each piece of a shard of `rows` records. PIECE_ROWS each: a piece costs
    the pool some CPU on its way (its records pickled, two queues, three threads woken), small
    beside 128 decodes; smaller pieces make that overhead a share of the build that shows. The build's last shard is cut finer as it nears its end, a piece at
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
              crashed: tuple[int, ...] = ()) -> tuple[dict[int, fmt.Skip], dict[int, bytes], int]:
    """Decode records into slots first, first + 1, ... of shard `index`; returns the skips and
    the written rows' checksum digests (SlotWriter.put), by slot, and how many of its images
    had their transparency dropped. `writeback`: start writing the
    rows to disk at once (the build's last shard, whose fsync no decoding overlaps; the other
    shards' rows are written by their fsync, on the side). `crashed`: slots whose decode killed
    the process that tried (skipped here, not decoded again). The slot being decoded is traced
    (`shards.tracing`), so that the build can tell which record killed a process."""
    ticker = Ticker()
    before = flattened()
    slots = writer.SlotWriter(_image_path(ctx, index), _image_column(ctx))
    skips, digests = {}, {}
    try:
        with tracing(ctx.staging, index, first) as busy:
            for slot, record in enumerate(records, start=first):
                if slot in crashed:
                    skip = fmt.Skip(record.key, *CRASHED["images"])
                else:
                    busy(slot, slot + 1)
                    try:
                        digests[slot] = slots.put(slot, ctx.decode(record))
                        skip = None
                    except SourceError as exc:
                        skip = fmt.Skip(record.key, "decode", str(exc))
                if skip is not None:
                    check_strict(ctx, skip)
                    skips[slot] = skip
                ticker.tick()
        if writeback:
            slots.start_writeback(first, len(records))
    finally:
        slots.close()
    ticker.tick(0, flush=True)
    return skips, {slot: d for slot, d in digests.items() if d is not None}, flattened() - before


def finish_pieces(ctx: ShardContext, task: ShardTask, records: list[tuple[Span, Record]],
                  skips: dict[int, fmt.Skip], digests: dict[int, bytes], flat: int = 0) -> ShardResult:
    """Every piece of shard `task` done: labels and keys of the kept records, then close (the
    image rows' digests, from the pieces, give that file's checksum)."""
    with shard_lock(ctx.staging, task.index):
        keep = [slot not in skips for slot in range(len(records))]
        shard = ctx.shard_writer(task.index, slots={"image": keep}, digests={"image": digests})
        try:
            shard.extend([image_fields(record) for (_, record), kept in zip(records, keep) if kept])
        except BaseException:
            shard.abort()
            raise
        return finish(ctx, task.index, shard, [skips[s] for s in sorted(skips)], len(records), flat)


def in_pieces(ctx: ShardContext) -> bool:
    """Image shards of one fixed size go to a pool as pieces."""
    return ctx.kind == "images" and not _image_column(ctx).ragged


def _image_column(ctx: ShardContext) -> fmt.Column:
    return next(c for c in ctx.columns if c.name == "image")


def _image_path(ctx: ShardContext, index: int) -> Path:
    return writer.partial_dir(ctx.staging, index) / fmt.column_file_names(_image_column(ctx))["values"]
