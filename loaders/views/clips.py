"""A random-crop view over an audio dataset: one fixed-length window per clip per epoch, as
speech and voice trainers cut a 2-4 s segment of every clip every epoch, with the decode and
the resampling already done (`packer build --sample-rate`).

Clip i's window in epoch e starts at frame `draw(seed, e, i) mod (T_i - F + 1)` (F = the
window's frames, T_i the clip's): a pure function of three integers, so it is the same with any
thread, worker or rank count, and a resumed run crops what the uninterrupted one would have. A
clip shorter than the window is taken whole and padded with zeros; `audio_lengths` gives the
frames that are real. As a Loader source a batch is one copy per clip into a [B, F] (or
[B, F, C]) buffer, and the clips' other columns beside it as an MMapDataset's batch has them: a
transcript's `tokens` whole (the crop may cut the words it holds), with `tokens_lengths`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from packer.dataset.reader import DatasetReader
from packer.errors import ConfigError

from loaders.batch import native
from loaders.batch.buffers import Memory, batch_dtype, empty
from loaders.batch.gather import ColumnGather
from loaders.batch.rows import in_shares
from loaders.batch.source import BatchSource
from loaders.order.orders import Order, Permutation
from loaders.views.dataset import Reopens, resolve_root

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def draw(seed: int, epoch: int, ids: np.ndarray) -> np.ndarray:
    """uint64 [len(ids)]: splitmix64 of (seed, epoch, id), one independent draw per clip and epoch."""
    with np.errstate(over="ignore"):
        x = (np.uint64(seed % 2**64) * _M1) ^ (np.uint64(epoch % 2**64) * _M2) ^ np.asarray(ids, np.uint64)
        for _ in range(2):
            x = x + _GOLDEN
            x = (x ^ (x >> np.uint64(30))) * _M1
            x = (x ^ (x >> np.uint64(27))) * _M2
            x = x ^ (x >> np.uint64(31))
    return x


def to_float(audio: torch.Tensor) -> torch.Tensor:
    """Clips as float32 in [-1, 1) on their own device: int16 / 32768 (libsndfile's scale); a
    float32 dataset's as they are. Call it after the copy to the GPU, which then moves half
    the bytes. Any other dtype is not an audio batch of ours: a ValueError, not a guess."""
    if audio.dtype == torch.int16:
        return audio.float() / 32768.0
    if audio.dtype == torch.float32:
        return audio
    raise ValueError(f"to_float takes an audio batch (int16 or float32), not {audio.dtype}")


class AudioClips(Reopens, BatchSource):
    """Fixed-length random crops of an audio dataset dir, one per clip per epoch.

    Args:
        root: an audio dataset dir (`packer build RAW OUT --sample-rate HZ`).
        seconds: the window's length; its frames are round(seconds * the dataset's rate).
        seed: with the epoch and the clip, fixes each crop (a Loader's seed orders the clips).
        columns: the dataset's other columns each batch carries (default: all of them: label,
            tokens and key where the dataset has them); a clip's tokens are its whole transcript,
            which the crop may cut.
    """

    per_epoch = True  # a batch depends on the epoch: Loader and BatchedDataset pass it to gather

    def __init__(self, root: str | Path, seconds: float, *, seed: int = 0, columns: list[str] | None = None,
                 order: Order = "random"):
        if not seconds > 0:
            raise ValueError(f"seconds must be positive, got {seconds}")
        self.root, self.seconds, self.seed, self.order = resolve_root(root), float(seconds), seed, order
        self.columns = columns
        self.generation: str | None = None  # set at open: a pickled copy re-opens this very build
        self._open()

    def _open(self) -> None:
        self._reader = reader = DatasetReader(self.root, self.generation)
        self.generation, m = reader.generation, reader.manifest
        if m.kind != "audio" or m.audio is None:
            raise ConfigError(f"{self.root}: holds {m.kind}, not audio; AudioClips reads a dataset built from audio "
                              "files with --sample-rate")
        self.sample_rate, self.channels = m.audio["sample_rate"], m.audio["channels"]
        self.frames = max(1, round(self.seconds * self.sample_rate))
        names = [c.name for c in m.columns]
        extra = self.columns if self.columns is not None else [n for n in names if n != "audio"]
        missing = [n for n in extra if n not in names or n == "audio"]
        if missing:
            raise ConfigError(f"{self.root}: AudioClips cannot carry columns {missing} beside its crops (the "
                              f"dataset has {names}; audio is the crop itself)")
        self._more = ColumnGather(reader, extra) if extra else None  # label, tokens, key: as an MMapDataset's batch
        self._values = [reader.column(k, "audio").values for k in range(len(m.shards))]
        self._regions = None  # where each shard's values lie, for the native copies: made at the first batch
        starts = [np.asarray(reader.column(k, "audio").offsets, np.int64) // self.channels for k in range(len(m.shards))]
        self._starts = np.concatenate([s[:-1] for s in starts]) if starts else np.zeros(0, np.int64)
        self._lengths = np.concatenate([np.diff(s) for s in starts]) if starts else np.zeros(0, np.int64)
        self._shard = np.repeat(np.arange(len(starts)), [len(s) - 1 for s in starts])
        self.source_id = f"{reader.content_id}:clips:{self.frames}:{self.seed}"

    def __len__(self) -> int:
        return len(self._lengths)

    def offsets(self, ids: np.ndarray, epoch: int) -> np.ndarray:
        """int64: the first frame of each clip's window in `epoch` (0 for a clip no longer than it)."""
        ids = np.asarray(ids, np.int64)
        room = np.maximum(self._lengths[ids] - self.frames, 0) + 1
        return (draw(self.seed, epoch, ids) % room.astype(np.uint64)).astype(np.int64)

    def alloc(self, batch_size: int, memory: Memory) -> dict[str, torch.Tensor]:
        dtype = self._values[0].dtype if self._values else np.dtype("<i2")
        step = () if self.channels == 1 else (self.channels,)
        return {"audio": empty((batch_size, self.frames, *step), batch_dtype(dtype), memory),
                "audio_lengths": empty((batch_size,), np.int64, memory),
                **(self._more.alloc(batch_size, memory) if self._more else {})}

    def gather(self, ids: np.ndarray, buffers: dict, pool=None, num_threads: int = 1, *, epoch: int = 0) -> dict:
        """The crops of clips `ids` in `epoch`: {"audio": [B, F] or [B, F, C], "audio_lengths",
        and the other columns}."""
        ids = np.asarray(ids, np.int64)
        n, c = len(ids), self.channels
        audio, lengths = buffers["audio"][:n], buffers["audio_lengths"][:n]
        dst, lens = audio.numpy().reshape(n, -1), lengths.numpy()
        starts = self.offsets(ids, epoch)
        lens[:] = np.minimum(self._lengths[ids], self.frames)
        first = (self._starts[ids] + starts) * c  # in values
        more = (lambda: self._more.gather(ids, buffers)) if self._more else dict  # the other columns: while the crops copy
        if native.LIB is not None and n:  # each crop a canvas slot of F x 1 "pixels" of C values, zeros after it
            if self._regions is None:
                self._regions = native.regions(self._values)
            item = self._values[0].dtype.itemsize
            job = native.Job(dst.reshape(n, self.frames, 1, c), self._regions, self._shard[ids], first * item,
                             np.arange(n), sizes=np.stack([lens, np.ones(n, np.int64)], axis=1), pixel_bytes=c * item,
                             stream=dst.nbytes >= native.STREAM_FROM)
            if isinstance(pool, native.Pool):
                with pool.running(job, num_threads):
                    rest = more()
            else:
                job(0, n)
                rest = more()
        else:
            jobs = list(zip(self._shard[ids].tolist(), first.tolist(), (lens * c).tolist()))

            def fill(lo: int, hi: int) -> None:  # numpy's copies release the GIL: shares run side by side
                for i in range(lo, hi):
                    k, a, m = jobs[i]
                    dst[i, :m] = self._values[k][a: a + m]
                    dst[i, m:] = 0

            pending = in_shares(fill, n, pool, num_threads)
            rest = more()
            for future in pending:
                future.result()
        return {"audio": audio, "audio_lengths": lengths, **rest}

    def __getitem__(self, index: int) -> dict:
        """Clip `index`'s crop in epoch 0."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"clip {index} out of range for {len(self)} clips")
        batch = self.gather(np.array([index % len(self)]), self.alloc(1, "plain"))
        return {k: v[0] for k, v in batch.items()}

    def __iter__(self):
        perm = Permutation(len(self), order=self.order, seed=self.seed, epoch=0)
        for i in perm(np.arange(len(self))).tolist():
            yield self[i]

