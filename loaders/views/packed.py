"""Packed documents: documents packed into fixed-length rows, with per-row boundaries
(`cu_seqlens`, `position_ids`) for attention masking, as varlen attention kernels take them.

No token is lost by default: a document longer than `seq_len` is cut into pieces of `seq_len`
tokens (each a row of its own) and a last, shorter piece, which is packed like any short
document. Packing (`pack_documents`, a pure function of the lengths) is best-fit decreasing by
default: pieces longest first, each into the row whose free room fits it most tightly, so a
document is never split to fill a row (that only happens when it does not fit any row at all).
`policy="in-order"` keeps document order (a row takes the next pieces while they fit).
`truncate=True` keeps only the first `seq_len` tokens of each document and counts what it drops.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from packer.dataset.reader import DatasetReader

from loaders.views.conversations import Conversations
from loaders.views.dataset import resolve_root
from packer.errors import ConfigError
from loaders.batch.buffers import Memory, empty
from loaders.batch.ragged import ranges
from loaders.batch.source import BatchSource

Policy = Literal["best-fit", "in-order"]
POLICIES = ("best-fit", "in-order")
SLICE_TOKENS = 256  # pieces at least this long are copied as slices, shorter ones in one fancy index


@dataclass(frozen=True)
class Packing:
    """Rows of pieces: row r holds pieces [row_ptr[r], row_ptr[r+1]), piece p being tokens
    [start[p], start[p] + length[p]) of document doc[p]."""

    row_ptr: np.ndarray
    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    truncated_tokens: int  # dropped by truncate=True; 0 otherwise

    @property
    def num_rows(self) -> int:
        return len(self.row_ptr) - 1

    def row_tokens(self) -> np.ndarray:
        """Tokens in each row."""
        return np.add.reduceat(self.length, self.row_ptr[:-1]) if len(self.length) else np.zeros(0, np.int64)


def pieces_of(lengths: np.ndarray, seq_len: int, *, truncate: bool = False):
    """(doc, start, length) of every piece, in document order: whole documents that fit, else
    pieces of seq_len tokens and the remainder (truncate: the first seq_len tokens alone)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if truncate:
        counts = (lengths > 0).astype(np.int64)
    else:
        counts = -(-lengths // seq_len)
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    start = (np.arange(len(doc), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)) * seq_len
    length = np.minimum(lengths[doc] - start, seq_len)
    return doc, start, length


def pack_documents(lengths, seq_len: int, *, policy: Policy = "best-fit", truncate: bool = False) -> Packing:
    """The rows of documents of these token counts (a pure function: same lengths, same rows)."""
    if seq_len <= 0:
        raise ValueError("seq_len must be positive")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    lengths = np.asarray(lengths, dtype=np.int64)
    doc, start, length = pieces_of(lengths, seq_len, truncate=truncate)
    row = (_best_fit if policy == "best-fit" else _in_order)(length, seq_len)
    order = np.argsort(row, kind="stable")
    row_ptr = np.searchsorted(row[order], np.arange(int(row.max(initial=-1)) + 2))
    dropped = int(np.maximum(lengths - seq_len, 0).sum()) if truncate else 0
    return Packing(row_ptr.astype(np.int64), doc[order], start[order], length[order], dropped)


def _in_order(length: np.ndarray, seq_len: int) -> np.ndarray:
    """Row of each piece: the next pieces while they fit (next-fit in document order)."""
    row = np.empty(len(length), dtype=np.int64)
    current, used = -1, seq_len
    for i, n in enumerate(length.tolist()):
        if used + n > seq_len:
            current, used = current + 1, 0
        row[i] = current
        used += n
    return row


def _best_fit(length: np.ndarray, seq_len: int) -> np.ndarray:
    """Row of each piece, best-fit decreasing: longest first, each into the open row with the
    least room that still fits it, else a new row. Rows with room r wait in rooms[r]; `free`
    lists the room sizes some row has, sorted."""
    row = np.empty(len(length), dtype=np.int64)
    by_size = np.argsort(-length, kind="stable")
    full = length[by_size] == seq_len  # whole rows: no search
    row[by_size[full]] = np.arange(int(full.sum()))
    rows = int(full.sum())
    rooms: list[list[int]] = [[] for _ in range(seq_len + 1)]
    free: list[int] = []
    for i, n in zip(by_size[~full].tolist(), length[by_size[~full]].tolist()):
        k = bisect.bisect_left(free, n)
        if k < len(free):
            room = free[k]
            r = rooms[room].pop()
            if not rooms[room]:
                del free[k]
        else:
            room, r = seq_len, rows
            rows += 1
        row[i] = r
        left = room - n
        if left:
            if not rooms[left]:
                bisect.insort(free, left)
            rooms[left].append(r)
    return row


class PackedDocuments(BatchSource):
    """Rows of `seq_len` tokens of packed documents, as a Loader source.

    A batch is a dict: `tokens` int64 [B, seq_len] (`padding_value` after the last piece), `position_ids`
    [B, seq_len] (restarting at 0 in every piece, 0 in the padding), `lengths` [B] (real tokens
    per row), and `cu_seqlens` int32 [segments + 1]: cumulative segment lengths over the
    flattened B x seq_len tokens, each row's pieces then, if the row is not full, its padding as
    one segment. A piece is a whole document or a part of a long one: attention never crosses
    a piece boundary.

    Args:
        root: dataset dir with a token column.
        seq_len: tokens per row.
        policy: "best-fit" (least padding) or "in-order" (document order kept).
        truncate: keep the first seq_len tokens of each document only (`num_truncated_tokens`
            counts the rest); by default no token is dropped.
        padding_value: the token after a row's last piece (default 0; `lengths` and
            `cu_seqlens` say where the padding starts whatever it is).
    """

    def __init__(self, root: str | Path, seq_len: int, *, column: str = "tokens", policy: Policy = "best-fit",
                 truncate: bool = False, padding_value: int = 0,
                 image_tokens: int | Callable[[int, int], int] | None = None):
        self.root, self.seq_len, self.column = resolve_root(root), seq_len, column
        self.policy, self.truncate, self.padding_value = policy, truncate, padding_value
        self.image_tokens = image_tokens
        self.generation: str | None = None  # set at open: a pickled copy re-opens this very build
        self._open()

    def _open(self) -> None:
        self._reader = reader = DatasetReader(self.root, self.generation)  # held: its generation stays
        self.generation = reader.generation
        shards = range(len(reader.manifest.shards))
        columns = [reader.column(k, self.column) for k in shards]
        self._values = [c.values for c in columns]
        offsets = [np.asarray(c.offsets, dtype=np.int64) for c in columns]
        counts = [len(o) - 1 for o in offsets]
        lengths = np.concatenate([np.diff(o) for o in offsets]) if offsets else np.zeros(0, np.int64)
        self._doc_shard = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        self._doc_row = np.arange(len(lengths), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        self._doc_start = np.concatenate([o[:-1] for o in offsets]) if offsets else np.zeros(0, np.int64)
        chat = self.column == "tokens" and any(c.name == "loss_mask" for c in reader.manifest.columns)
        self._chat = Conversations(reader, lengths, self.seq_len, truncate=self.truncate,
                                   image_tokens=self.image_tokens) if chat else None
        if self.image_tokens is not None and not chat:
            raise ConfigError(f"{self.root}: image_tokens= is for conversations with images (packer build "
                              "--chat-template); this dataset has no loss_mask column")
        pk = pack_documents(self._chat.effective if chat else lengths, self.seq_len, policy=self.policy,
                            truncate=self.truncate and not chat)
        if chat and self._chat.has_images:  # whole conversations, placed by their tokens and images: copied by tokens
            pk = replace(pk, length=lengths[pk.doc])
        self.packing = pk
        # per piece, what every batch would otherwise recompute: where it starts in its row, in
        # its shard's flat tokens, and which shard that is; per row, its real tokens
        per_row = np.diff(pk.row_ptr)
        ends = np.cumsum(pk.length)
        row_start = np.repeat(ends[pk.row_ptr[:-1]] - pk.length[pk.row_ptr[:-1]], per_row) if len(ends) else ends
        self._within = ends - pk.length - row_start
        self._src = self._doc_start[pk.doc] + pk.start
        self._shard = self._doc_shard[pk.doc]
        self._row_used = pk.row_tokens()
        self.num_tokens = int(lengths.sum())
        self.num_truncated_tokens = self._chat.dropped_tokens if chat else self.packing.truncated_tokens
        self.num_dropped = self._chat.dropped if chat else 0  # conversations longer than a row, left out
        self._max_pieces = int(np.diff(self.packing.row_ptr).max(initial=1))
        self._arange = np.arange(self.seq_len, dtype=np.int64)
        self.source_id = (f"{reader.content_id}:packed:{self.column}:{self.seq_len}:{self.policy}:"
                          f"{int(self.truncate)}" + (f":{self.image_tokens}" if self.image_tokens is not None else ""))

    @property
    def padding_fraction(self) -> float:
        """Share of the rows' tokens that are padding."""
        rows = self.packing.num_rows
        return 1 - (self.num_tokens - self.num_truncated_tokens) / (rows * self.seq_len) if rows else 0.0

    def __getstate__(self) -> dict:
        return {"root": self.root, "seq_len": self.seq_len, "column": self.column, "policy": self.policy,
                "truncate": self.truncate, "padding_value": self.padding_value, "generation": self.generation,
                "image_tokens": self.image_tokens}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return self.packing.num_rows

    def alloc(self, batch_size: int, memory: Memory) -> dict[str, torch.Tensor]:
        L = self.seq_len
        labels = {"labels": empty((batch_size, L), np.int64, memory)} if self._chat is not None else {}
        return {**labels, "tokens": empty((batch_size, L), np.int64, memory),
                "position_ids": empty((batch_size, L), np.int64, memory),
                "lengths": empty((batch_size,), np.int64, memory),
                # a row has at most _max_pieces pieces and one padding segment
                "cu_seqlens": empty((batch_size * (self._max_pieces + 1) + 1,), np.int32, memory)}

    def gather(self, ids: np.ndarray, buffers: dict, pool=None, num_threads: int = 1) -> dict:
        B, L = len(ids), self.seq_len
        pk = self.packing
        rows = np.asarray(ids, dtype=np.int64)
        first = pk.row_ptr[rows]
        per_row = pk.row_ptr[rows + 1] - first
        p = ranges(first, per_row)  # the batch's pieces, row after row
        length = pk.length[p]
        dst = np.repeat(np.arange(0, B * L, L, dtype=np.int64), per_row) + self._within[p]  # in the flat [B, L]
        used = self._row_used[rows]

        tokens, positions = buffers["tokens"][:B], buffers["position_ids"][:B]
        t, pos = tokens.numpy().reshape(-1), positions.numpy().reshape(-1)
        for r, u in enumerate(used.tolist()):  # the rows' padding: zeros
            if u < L:
                t[r * L + u:(r + 1) * L] = self.padding_value
                pos[r * L + u:(r + 1) * L] = 0
        src, shard = self._src[p], self._shard[p]
        long = length >= SLICE_TOKENS
        values, arange = self._values, self._arange
        for d, s, n, k in zip(dst[long].tolist(), src[long].tolist(), length[long].tolist(), shard[long].tolist()):
            t[d:d + n] = values[k][s:s + n]  # long pieces: a slice copy each
            pos[d:d + n] = arange[:n]
        if not long.all():  # short pieces: one fancy-index copy per shard
            short = np.flatnonzero(~long)
            for k in np.unique(shard[short]).tolist():
                sel = short[shard[short] == k]
                t[ranges(dst[sel], length[sel])] = values[k][ranges(src[sel], length[sel])]
            pos[ranges(dst[short], length[short])] = ranges(np.zeros(len(short), np.int64), length[short])

        out_lengths = buffers["lengths"][:B]
        out_lengths.numpy()[:] = used
        padded = np.flatnonzero(used < L)
        bounds = np.sort(np.concatenate([dst + length, (padded + 1) * L]))
        cu = buffers["cu_seqlens"][:len(bounds) + 1]
        c = cu.numpy()
        c[0], c[1:] = 0, bounds
        out = {"tokens": tokens, "position_ids": positions, "lengths": out_lengths, "cu_seqlens": cu}
        if self._chat is None:
            return out
        labels = buffers["labels"][:B]
        self._chat.labels(t, dst, src, length, shard, labels.numpy().reshape(-1))
        out["labels"] = labels
        if self._chat.has_images:
            batch_rows = np.repeat(np.arange(B, dtype=np.int64), per_row)
            out |= self._chat.images(pk.doc[p], self._doc_shard, self._doc_row, batch_rows, self._within[p])
        return out
