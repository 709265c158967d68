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
    [B, seq_len] (restarting at 0 in every document), `lengths` [B] (real tokens per row), and
    `cu_seqlens` int32 [segments + 1]: cumulative segment lengths over the flattened B x seq_len
    tokens, each row's documents then, if the row is not full, its padding as one segment.
    """

    def __init__(self, root: str | Path, seq_len: int, *, column: str = "tokens"):
        self.root, self.seq_len, self.column = Path(root), seq_len, column
        self._open()

    def _open(self) -> None:
        self._reader = DatasetReader(self.root)
        shards = range(len(self._reader.manifest.shards))
        offsets = [np.asarray(self._reader.column(k, self.column).offsets) for k in shards]
        lengths = np.concatenate([np.diff(o) for o in offsets]) if offsets else np.zeros(0, np.int64)
        self._doc_shard = np.concatenate([np.full(len(o) - 1, k) for k, o in zip(shards, offsets)]).astype(np.int64)
        self._doc_start = np.concatenate([o[:-1] for o in offsets]).astype(np.int64)
        self._lengths = lengths
        self._bounds = pack_documents(lengths, self.seq_len)
        self.num_truncated_tokens = int(np.maximum(lengths - self.seq_len, 0).sum())

    def __getstate__(self) -> dict:
        return {"root": self.root, "seq_len": self.seq_len, "column": self.column}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return len(self._bounds) - 1

    def alloc(self, batch_size: int, memory: str) -> dict:
        return {}

    def gather(self, ids: np.ndarray, buffers: dict, pool=None, num_threads: int = 1) -> dict:
        B, L = len(ids), self.seq_len
        tokens = np.zeros((B, L), dtype=np.int64)
        positions = np.zeros((B, L), dtype=np.int64)
        lengths = np.zeros(B, dtype=np.int64)
        segments = [0]
        for i, row in enumerate(np.asarray(ids).tolist()):
            used = 0
            for d in range(int(self._bounds[row]), int(self._bounds[row + 1])):
                n = min(int(self._lengths[d]), L)
                start = int(self._doc_start[d])
                tokens[i, used:used + n] = self._reader.column(int(self._doc_shard[d]), self.column).values[start:start + n]
                positions[i, used:used + n] = np.arange(n)
                used += n
                segments.append(i * L + used)
            if used < L:
                segments.append((i + 1) * L)
            lengths[i] = used
        return {"tokens": torch.from_numpy(tokens), "position_ids": torch.from_numpy(positions),
                "lengths": torch.from_numpy(lengths), "cu_seqlens": torch.tensor(segments, dtype=torch.int32)}
