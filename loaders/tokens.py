"""Language-model views over a token column: fixed `seq_len` windows across document
boundaries, as pretraining loaders read them.

The token column of every shard, in shard order, is one token stream. Window i covers stream
positions [i * stride, i * stride + seq_len + 1): x is its first seq_len tokens, y the last
seq_len (shifted by one). A window may span documents and shards. As a Loader source, a whole
batch of windows is one gather into an int64 [B, seq_len + 1] buffer; x and y are views of it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from packer.reader import DatasetReader

from .gather import Memory, empty
from .sampler import Order, epoch_order


class TokenWindows:
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
        self.root, self.seq_len, self.stride = Path(root), seq_len, stride or seq_len
        self.order, self.seed, self.column = order, seed, column
        self._reader: DatasetReader | None = None
        self._open()

    def _open(self) -> None:
        self._reader = DatasetReader(self.root)
        counts = [int(self._reader.column(k, self.column).offsets[-1]) for k in range(len(self._reader.manifest.shards))]
        self._token_ends = np.cumsum(counts, dtype=np.int64)
        self._token_starts = self._token_ends - np.asarray(counts, dtype=np.int64)
        self.num_tokens = int(self._token_ends[-1]) if counts else 0

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        span = self.seq_len + 1
        return 0 if self.num_tokens < span else (self.num_tokens - span) // self.stride + 1

    def _values(self, k: int) -> np.ndarray:
        return self._reader.column(k, self.column).values

    def alloc(self, batch_size: int, memory: Memory) -> dict[str, torch.Tensor]:
        return {"window": empty((batch_size, self.seq_len + 1), np.int64, memory)}

    def gather(self, ids: np.ndarray, buffers: dict, pool=None, num_threads: int = 1):
        """(x, y) int64 [len(ids), seq_len] views of one buffer."""
        buf = buffers["window"][: len(ids)]
        dst = buf.numpy()
        span = self.seq_len + 1
        starts = np.asarray(ids, dtype=np.int64) * self.stride
        first = np.searchsorted(self._token_ends, starts, side="right")
        for i, (start, k) in enumerate(zip(starts.tolist(), first.tolist())):
            filled = 0
            while filled < span:
                local = start + filled - int(self._token_starts[k])
                piece = self._values(k)[local: local + span - filled]
                dst[i, filled: filled + len(piece)] = piece  # casts to int64 while copying
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
        for i in epoch_order(len(self), order=self.order, seed=self.seed, epoch=0).tolist():
            yield self[i]
