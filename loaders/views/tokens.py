"""Language-model views over a token column: fixed `seq_len` windows across document
boundaries, as pretraining loaders read them.

The token column of every shard, in shard order, is one token stream. Window i covers stream
positions [i * stride, i * stride + seq_len + 1): x is its first seq_len tokens, y the last
seq_len (shifted by one). A window may span documents and shards. As a Loader source, a whole
batch of windows is one gather into an int64 [B, seq_len + 1] buffer; x and y are views of it.
Opening costs O(shards), whatever the number of windows (10^10 with stride 1 included).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from packer.errors import ConfigError
from packer.dataset.reader import DatasetReader

from loaders.views.dataset import Reopens, resolve_root
from loaders.batch.buffers import Memory, empty
from loaders.batch.source import BatchSource
from loaders.order.orders import Order, Permutation

ITER_CHUNK = 4096  # windows whose ids are computed at once when a TokenWindows is iterated directly


class TokenWindows(Reopens, BatchSource):
    """Token windows of a text (or pairs) dataset dir.

    Args:
        root: dataset dir with a `tokens` column.
        seq_len: tokens per window (x and y each).
        stride: start-to-start distance (default seq_len: every token is a target once).
        order: the order when iterated directly (Loader uses its own order argument).
        seed: seed of the random order when iterated directly.
    """

    def __init__(self, root: str | Path, seq_len: int, stride: int | None = None, order: Order = "random",
                 *, seed: int = 0, column: str = "tokens"):
        if seq_len <= 0 or (stride is not None and stride <= 0):
            raise ValueError("seq_len and stride must be positive")
        self.root, self.seq_len, self.stride = resolve_root(root), seq_len, stride or seq_len
        self.order, self.seed, self.column = order, seed, column
        self.generation: str | None = None  # set at open: a pickled copy re-opens this very build
        self._reader: DatasetReader | None = None
        self._open()

    def _open(self) -> None:
        self._reader = DatasetReader(self.root, self.generation)
        self.generation = self._reader.generation
        shards = range(len(self._reader.manifest.shards))
        self._values = [self._reader.column(k, self.column).values for k in shards]
        counts = [len(v) for v in self._values]
        # every window that starts in shard k, as a [windows, seq_len + 1] strided view (no copy)
        self._windows = [sliding_window_view(v, self.seq_len + 1) if len(v) > self.seq_len else None
                         for v in self._values]
        self._token_ends = np.cumsum(counts, dtype=np.int64)
        self._token_starts = self._token_ends - np.asarray(counts, dtype=np.int64)
        self.num_tokens = int(self._token_ends[-1]) if counts else 0
        if self.num_tokens <= self.seq_len:
            raise ConfigError(f"{self.root}: holds {self.num_tokens:,} tokens, and a window of seq_len {self.seq_len:,} "
                              f"needs {self.seq_len + 1:,} (its inputs and the next token); use a shorter seq_len")
        self.source_id = f"{self._reader.content_id}:windows:{self.column}:{self.seq_len}:{self.stride}"

    def __len__(self) -> int:
        span = self.seq_len + 1
        return 0 if self.num_tokens < span else (self.num_tokens - span) // self.stride + 1

    def alloc(self, batch_size: int, memory: Memory) -> dict[str, torch.Tensor]:
        return {"window": empty((batch_size, self.seq_len + 1), np.int64, memory)}

    def gather(self, ids: np.ndarray, buffers: dict, pool=None, num_threads: int = 1):
        """(x, y) int64 [len(ids), seq_len] views of one buffer. The windows that lie inside one
        shard (all but a few) are one take of rows of that shard's window view, widened to int64
        as they land (about twice as fast as a slice copy per window)."""
        buf = buffers["window"][: len(ids)]
        dst = buf.numpy()
        span = self.seq_len + 1
        starts = np.asarray(ids, dtype=np.int64) * self.stride
        if len(self._windows) == 1:  # one shard: every window lies in it, one take (no search)
            dst[:] = self._windows[0][starts]
            return buf[:, :-1], buf[:, 1:]
        first = np.searchsorted(self._token_ends, starts, side="right")
        inside = starts + span <= self._token_ends[first]
        if inside.all() and (first == first[0]).all():  # one shard: no selection to scatter by
            dst[:] = self._windows[first[0]][starts - self._token_starts[first[0]]]
        else:
            for k in np.unique(first[inside]).tolist():
                sel = np.flatnonzero(inside & (first == k))
                dst[sel] = self._windows[k][starts[sel] - self._token_starts[k]]
        for i in np.flatnonzero(~inside).tolist():  # across a shard boundary: piece by piece
            start, k, filled = int(starts[i]), int(first[i]), 0
            while filled < span:
                local = start + filled - int(self._token_starts[k])
                piece = self._values[k][local: local + span - filled]
                dst[i, filled: filled + len(piece)] = piece
                filled += len(piece)
                k += 1
        return buf[:, :-1], buf[:, 1:]

    def __getitem__(self, index: int):
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"window {index} out of range for {n} windows")
        x, y = self.gather(np.array([index]), self.alloc(1, "plain"))
        return x[0], y[0]

    def __iter__(self):
        n = len(self)
        perm = Permutation(n, order=self.order, seed=self.seed, epoch=0)
        for lo in range(0, n, ITER_CHUNK):
            for i in perm(np.arange(lo, min(n, lo + ITER_CHUNK))).tolist():
                yield self[i]
