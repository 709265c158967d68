"""Packed documents: whole documents packed into fixed-length rows, with per-row boundaries
(`cu_seqlens`, `position_ids`) for attention masking, as varlen attention kernels take them.

Packing is greedy in document order (a pure function, `pack_documents`): a row takes the next
documents while they fit in `seq_len`. A document longer than `seq_len` gets a row of its own and
is truncated to `seq_len` tokens: the only tokens ever dropped (`num_truncated_tokens` says how
many). No token is duplicated.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from packer.reader import DatasetReader

from .gather import Memory, _ranges, empty


def pack_documents(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Row boundaries over documents: row r holds documents [bounds[r], bounds[r+1])."""
    if seq_len <= 0:
        raise ValueError("seq_len must be positive")
    bounds = [0]
    used = 0
    for i, n in enumerate(np.minimum(np.asarray(lengths, dtype=np.int64), seq_len).tolist()):
        if used + n > seq_len and i > bounds[-1]:
            bounds.append(i)
            used = 0
        used += n
    if len(lengths):
        bounds.append(len(lengths))
    return np.asarray(bounds, dtype=np.int64)


class PackedDocuments:
    """Rows of `seq_len` tokens of whole documents, as a Loader source.

    A batch is a dict: `tokens` int64 [B, seq_len] (0 after the last document), `position_ids`
    [B, seq_len] (restarting at 0 in every document, 0 in the padding), `lengths` [B] (real
    tokens per row), and `cu_seqlens` int32 [segments + 1]: cumulative segment lengths over the
    flattened B x seq_len tokens, each row's documents then, if the row is not full, its padding
    as one segment.

    As every Loader source, a batch is written into buffers from `alloc` (Loader's pinned ring,
    or shared memory in a DataLoader worker), reused from batch to batch. A row's documents are
    consecutive in the token stream (packing keeps document order, and only a row's single
    document is ever truncated), so its tokens are one slice copy per shard it touches; position
    ids and segment boundaries are computed for the whole batch at once.
    """

    def __init__(self, root: str | Path, seq_len: int, *, column: str = "tokens"):
        self.root, self.seq_len, self.column = Path(root), seq_len, column
        self._open()

    def _open(self) -> None:
        self._reader = DatasetReader(self.root)
        shards = range(len(self._reader.manifest.shards))
        columns = [self._reader.column(k, self.column) for k in shards]
        self._values = [c.values for c in columns]
        offsets = [np.asarray(c.offsets, dtype=np.int64) for c in columns]
        counts = [len(o) - 1 for o in offsets]
        lengths = np.concatenate([np.diff(o) for o in offsets]) if offsets else np.zeros(0, np.int64)
        self._doc_shard = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        self._doc_start = np.concatenate([o[:-1] for o in offsets]) if offsets else np.zeros(0, np.int64)
        self._shard_first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])  # first doc of each shard
        self._lengths = lengths
        self._clipped = np.minimum(lengths, self.seq_len)
        self._arange = np.arange(self.seq_len, dtype=np.int64)
        self._bounds = pack_documents(lengths, self.seq_len)
        self._max_docs = int(np.diff(self._bounds).max()) if len(self._bounds) > 1 else 1
        self.num_truncated_tokens = int(np.maximum(lengths - self.seq_len, 0).sum())

    def __getstate__(self) -> dict:
        return {"root": self.root, "seq_len": self.seq_len, "column": self.column}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return len(self._bounds) - 1

    def alloc(self, batch_size: int, memory: Memory) -> dict[str, torch.Tensor]:
        L = self.seq_len
        return {"tokens": empty((batch_size, L), np.int64, memory),
                "position_ids": empty((batch_size, L), np.int64, memory),
                "lengths": empty((batch_size,), np.int64, memory),
                # a row has at most _max_docs documents and one padding segment
                "cu_seqlens": empty((batch_size * (self._max_docs + 1) + 1,), np.int32, memory)}

    def gather(self, ids: np.ndarray, buffers: dict, pool=None, num_threads: int = 1) -> dict:
        B, L = len(ids), self.seq_len
        rows = np.asarray(ids, dtype=np.int64)
        first, last = self._bounds[rows], self._bounds[rows + 1]
        per_row = last - first
        row_of = np.repeat(np.arange(B, dtype=np.int64), per_row)  # the batch row of each document
        row_first = np.cumsum(per_row) - per_row  # index (in `docs`) of each row's first document
        n = self._clipped[_ranges(first, per_row)]  # of the rows' documents, in order
        ends = np.cumsum(n)
        starts = ends - n  # each document's start in the batch's concatenated tokens
        row_start = starts[row_first]
        within = starts - row_start[row_of]  # ... and in its row
        used = ends[row_first + per_row - 1] - row_start

        tokens, positions = buffers["tokens"][:B], buffers["position_ids"][:B]
        t, p = tokens.numpy(), positions.numpy()
        # position ids of the batch's documents, concatenated, for rows of several (a row of one
        # document takes a slice of _arange)
        in_doc = _ranges(np.zeros_like(n), n) if np.any(per_row > 1) else None
        values, shard_first, doc_start, lengths = self._values, self._shard_first, self._doc_start, self._lengths
        for i, (d0, d1, u, k0, k1, s0, c0) in enumerate(zip(
                first.tolist(), last.tolist(), used.tolist(), self._doc_shard[first].tolist(),
                self._doc_shard[last - 1].tolist(), doc_start[first].tolist(), row_start.tolist())):
            if k0 == k1:  # one slice: the row's documents, or the first seq_len tokens of its only one
                t[i, :u] = values[k0][s0:s0 + u]  # casts to int64 while copying
            else:  # whole documents across shards: a slice of each shard
                filled = 0
                for k in range(k0, k1 + 1):
                    a, b = max(d0, int(shard_first[k])), min(d1, int(shard_first[k + 1]))
                    if a < b:
                        s, m = int(doc_start[a]), int(doc_start[b - 1] + lengths[b - 1] - doc_start[a])
                        t[i, filled:filled + m] = values[k][s:s + m]
                        filled += m
            p[i, :u] = self._arange[:u] if d1 - d0 == 1 else in_doc[c0:c0 + u]
            t[i, u:] = 0
            p[i, u:] = 0

        out_lengths = buffers["lengths"][:B]
        out_lengths.numpy()[:] = used
        padded = np.flatnonzero(used < L)
        bounds = np.sort(np.concatenate([row_of * L + within + n, (padded + 1) * L]))
        cu = buffers["cu_seqlens"][:len(bounds) + 1]
        c = cu.numpy()
        c[0], c[1:] = 0, bounds
        return {"tokens": tokens, "position_ids": positions, "lengths": out_lengths, "cu_seqlens": cu}
