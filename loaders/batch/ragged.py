"""Ragged columns gathered in the producer's thread: where a batch's samples lie in their shards'
flat values (`spans`, `ranges`), strings (`gather_strings`: one take per shard, decoded once)
and 1-D samples such as tokens (`gather_ragged`: padded to the batch's longest, with their
lengths, in the batch's buffers when they hold it). Ragged images go into a canvas
(`loaders.batch.canvas`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from packer.dataset.codec import decode_text
from packer.dataset.reader import ColumnArrays

from loaders.batch.buffers import batch_dtype, values_dtype

RAGGED_BUFFER_BYTES = 16 << 20  # a ragged column's batch buffer: up to B x its longest sample, at most this
AUDIO_BUFFER_BYTES = 256 << 20  # ... an audio column's: a batch of 64 clips of 30 s at 48 kHz stereo int16 is 369 MB


def frames_of(column) -> int | None:
    """Values per step of a column ragged along its first axis only ([T] tokens or mono audio,
    [T, C] audio): batched padded along T with `{name}_lengths`; None for any other column."""
    if not column.ragged or column.encoding not in (None, "bfloat16") or column.shape[0] is not None or \
            None in column.shape[1:]:
        return None
    return math.prod(column.shape[1:])
SHORT_PIECES = 256  # ragged samples up to this long on average are gathered vectorised, longer ones one by one


def spans(arrays: list[ColumnArrays], shard, rows):
    """Where a ragged column's samples lie: each sample's start and length in its shard's flat
    values, and per shard touched (positions in the batch, that shard's values)."""
    starts = np.empty(len(rows), np.int64)
    ends = np.empty(len(rows), np.int64)
    pieces = []
    for k in np.unique(shard):
        sel = np.flatnonzero(shard == k)
        offsets = arrays[k].offsets
        starts[sel], ends[sel] = offsets[rows[sel]], offsets[rows[sel] + 1]
        pieces.append((sel, arrays[k].values))
    return starts, ends - starts, pieces


def shapes_at(arrays: list[ColumnArrays], shard, rows, ndim: int) -> np.ndarray:
    """[len(rows), ndim]: each sample's shape in a ragged column, from its shards' shapes files."""
    out = np.zeros((len(rows), ndim), np.int64)
    for k in np.unique(shard).tolist():
        sel = shard == k
        out[sel] = arrays[k].shapes[rows[sel]]
    return out


def take_bytes(arrays: list[ColumnArrays], shard, rows) -> tuple[np.ndarray, list[int]]:
    """A |u1 ragged column's samples one after another, one vectorised take per shard, and where
    each starts and ends in that blob ([B + 1] bounds)."""
    starts, lengths, pieces = spans(arrays, shard, rows)
    at = np.cumsum(lengths) - lengths  # where each sample's bytes go in the batch's blob
    blob = np.empty(int(lengths.sum()), np.uint8)
    for sel, values in pieces:
        blob[ranges(at[sel], lengths[sel])] = values[ranges(starts[sel], lengths[sel])]
    return blob, [*at.tolist(), len(blob)]


def gather_strings(arrays: list[ColumnArrays], shard, rows, encoding: str, where: str) -> list[str]:
    """A string column: each shard's bytes for the batch in one vectorised take, decoded once
    (ASCII, the usual case for keys) and sliced, else decoded piece by piece: half
    the work of a bytes() + decode per sample, which matters because it runs on the producer
    thread while the pool copies images, and holds the GIL the whole time."""
    blob, bounds = take_bytes(arrays, shard, rows)
    raw = blob.tobytes()
    if encoding in ("utf-8", "ascii") and raw.isascii():
        text = raw.decode("ascii")
        return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return [decode_text(raw[a:b], encoding, where) for a, b in zip(bounds[:-1], bounds[1:])]


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of arange(s, s + n) for each (s, n), without a Python loop."""
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))


def gather_ragged(name, arrays, shard, rows, buffers, pad: int = 0, step: tuple[int, ...] = ()) -> dict:
    """Columns ragged along their first axis: padded [B, longest in the batch, *step] (`pad`
    after each sample) plus `{name}_lengths` (steps: tokens, frames), in the batch's buffers
    when they hold it.
    Vectorised, because short documents would otherwise cost a Python-level copy each into a
    fresh array; for long ones the two ways are about even, most of the work being the padding."""
    starts, lengths, pieces = spans(arrays, shard, rows)
    n, width = len(rows), int(lengths.max(initial=0))
    flat, lens = buffers.get(name), buffers.get(f"{name}_lengths")
    fresh = flat is None or n * width > flat.numel() or lens is None  # no buffer, or wider than it was sized for
    if fresh:  # zeroed by the OS, and only as far as it is touched
        flat = torch.from_numpy(np.zeros(n * width, batch_dtype(values_dtype(arrays))))
        lens = torch.empty(n, dtype=torch.int64)
        fresh = pad == 0  # else it is filled below, as a reused buffer is
    padded, lens = flat[: n * width].view(n, width), lens[:n]
    dst = padded.numpy()
    lens.numpy()[:] = lengths
    if n and lengths.sum() <= SHORT_PIECES * n:  # short samples: one fancy-index copy per shard
        if not fresh:
            dst.fill(pad)
        out = dst.reshape(-1)
        for sel, values in pieces:
            out[ranges(sel * width, lengths[sel])] = values[ranges(starts[sel], lengths[sel])]
    else:  # long samples: a slice copy each, and its padding written
        for sel, values in pieces:
            for i, s, m in zip(sel.tolist(), starts[sel].tolist(), lengths[sel].tolist()):
                dst[i, :m] = values[s:s + m]
                if not fresh:
                    dst[i, m:] = pad
    if step:  # [T, C] samples: their flat values padded as one row each, and lengths in frames
        each = math.prod(step)
        lens.numpy()[:] //= each
        padded = padded.view(n, width // each, *step)
    return {name: padded, f"{name}_lengths": lens}
