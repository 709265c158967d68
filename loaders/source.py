"""What a Loader or a BatchedDataset reads, and in which order: the glue of the data flow view ->
order -> gather. A view (`loaders.views`) gives a batch source, the contract every view keeps
(`loaders.batch.source.BatchSource`: `MMapDataset.batch_source`, `TokenWindows`,
`PackedDocuments`, `AudioClips`, `Mixture`): its size, its identity, its buffers and a gather of
sample ids into them, with what only some offer declared by defaults; `epochs_of` binds it to
its epochs (`loaders.order`), and `bind` does so for Loader and BatchedDataset alike, with the
check of a remote dataset's cache limit. The batch and order layers import neither each other
nor the views: this module, above them, joins them.
"""

from __future__ import annotations

import numpy as np

from packer.errors import ConfigError
from packer.remote import check_first_batches

from loaders.batch.gather import ColumnGather
from loaders.batch.ragged import frames_of
from loaders.batch.source import Batchable, BatchSource
from loaders.order.buckets import Bucketed, aspect_bucket
from loaders.order.lengths import Budget
from loaders.order.orders import WINDOW
from loaders.order.planned import DatasetOrder, LengthEpochs
from loaders.order.sampler import Epochs
from loaders.padding import Padding


def as_source(dataset, columns: list[str] | None = None, *, device_decode: bool = False) -> BatchSource:
    """The batch source a loader reads (`loaders.batch.source`): an MMapDataset's (of `columns`),
    or the view itself; checked here, once, so nothing later asks the source what it offers."""
    if not isinstance(dataset, Batchable):
        raise ConfigError(f"a Loader reads an MMapDataset, a dataset dir, TokenWindows or PackedDocuments, not "
                          f"{type(dataset).__name__}; for other datasets use torch.utils.data.DataLoader")
    return dataset.batch_source(columns, device_decode=device_decode)


def bind(source: BatchSource, batch_size: int | None, **order) -> Epochs:
    """What Loader and BatchedDataset make of a batch source (`as_source`): its epochs
    (`epochs_of`, `order` its keywords), a remote dataset's cache limit checked against the
    first batches."""
    epochs = epochs_of(source, batch_size, **order)
    check_first_batches(source, epochs)  # a cache limit too small for a batch: refused now
    return epochs


def gather(source: BatchSource, ids: np.ndarray, buffers: dict, pool=None, num_threads: int = 1, *, epoch: int):
    """Batch `ids` of `epoch`: a view whose samples change with the epoch (`per_epoch`:
    AudioClips' crops) is told it."""
    if source.per_epoch:
        return source.gather(ids, buffers, pool, num_threads, epoch=epoch)
    return source.gather(ids, buffers, pool, num_threads)


def epochs_of(source: BatchSource, batch_size: int | None, *, bucket_by: str | None = None,
              max_tokens: int | None = None, max_seconds: float | None = None, cost: str = "linear",
              **kwargs) -> Epochs:
    """The epochs over a batch source: its permutations, a mixture's stream (`order_for`), with
    `bucket_by="aspect"` batches whose images share an aspect-ratio bucket, or with
    `bucket_by="length"` (`"length:COLUMN"`), `max_tokens` or `max_seconds` batches planned by
    length (`loaders.order.planned`). Their `padding` counts the batches' ragged column."""
    stream = source.order_stream()
    if (bucket_by or "").startswith("length") or max_tokens is not None or max_seconds is not None:
        return _planned(source, batch_size, bucket_by=bucket_by or "length", max_tokens=max_tokens,
                        max_seconds=max_seconds, cost=cost, **kwargs)
    if cost != "linear":
        raise ConfigError(f"cost={cost!r} weighs a budget: give max_tokens= (or max_seconds=)")
    if batch_size is None:
        raise ConfigError("a loader needs a batch_size, or a budget (max_tokens= or max_seconds=)")
    if bucket_by is not None:
        if bucket_by != "aspect":
            raise ConfigError(f"bucket_by must be 'aspect', 'length', 'length:COLUMN' or None, not {bucket_by!r}")
        if stream is not None or not isinstance(source, ColumnGather):
            raise ConfigError("bucket_by='aspect' groups the images of one MMapDataset (not a Mixture or a view)")
        column = source.image_column()
        stream = Bucketed(AspectOf(source, column), batch_size, bucket_by=bucket_by, column=column)
    epochs = Epochs(len(source), batch_size, source=source.source_id, stream=stream, **kwargs)
    gather = source.column_gather
    name = length_column(gather, None, required=False) if gather is not None else None
    epochs.padding = Padding(name) if name else None
    return epochs


def _planned(source: BatchSource, batch_size: int | None, *, bucket_by: str, max_tokens, max_seconds, cost: str,
             block_window: int = WINDOW, **kwargs) -> LengthEpochs:
    """`LengthEpochs` over the source's ragged column (named by `bucket_by="length:COLUMN"`)."""
    if bucket_by != "length" and not bucket_by.startswith("length:"):
        raise ConfigError(f"a budget (max_tokens, max_seconds) plans batches by length: bucket_by is 'length', "
                          f"'length:COLUMN' or None with it, not {bucket_by!r}")
    gather = source.column_gather
    if gather is None:
        raise ConfigError(f"{type(source).__name__} has no ragged column to plan batches by length (its rows all "
                          "have one length); bucket_by='length' and max_tokens batch an MMapDataset, a Mixture of "
                          "them, or ds.batched; for whole clips, MMapDataset of the audio dataset")
    name = length_column(gather, bucket_by.partition(":")[2] or None)
    if max_seconds is not None:
        max_tokens = _frames(gather, name, max_tokens, max_seconds)
    budget = Budget(batch_size=batch_size, max_tokens=max_tokens, cost=cost)
    if block_window != WINDOW:
        raise ConfigError(f"block_window={block_window} is block order's window over one dataset without bucket_by")
    stream = source.order_stream()
    positions_of = stream.order_for if stream is not None else DatasetOrder(len(source), WINDOW)
    epochs = LengthEpochs(len(source), budget, positions_of=positions_of, lengths=RaggedLengths(gather.readers, name),
                          bucket_by=bucket_by, column=name, source=source.source_id, **kwargs)
    epochs.padding = Padding(name, budget if max_tokens is not None else None)
    return epochs


def length_column(gather, name: str | None, *, required: bool = True) -> str | None:
    """The ragged column batches are planned by: `name`, else the only one ragged along its first
    axis, else `audio`, else `tokens` (conversations: their tokens, not the loss mask beside them)."""
    ragged = [c.name for c in gather.columns if frames_of(c) is not None]
    if name is not None:
        if name not in ragged:
            raise ConfigError(f"bucket_by='length:{name}': the columns ragged along their first axis are {ragged}")
        return name
    for pick in (ragged if len(ragged) == 1 else []) + [n for n in ("audio", "tokens") if n in ragged]:
        return pick
    if required:
        raise ConfigError(f"no column to plan batches by length (ragged along the first axis: {ragged}); name one "
                          "with bucket_by='length:COLUMN'" if ragged else
                          f"{gather.reader.root}: no ragged column (tokens, audio) to plan batches by length")
    return None


def _frames(gather, name: str, max_tokens, max_seconds) -> int:
    """max_seconds as frames of the audio column `name`."""
    audio = gather.reader.manifest.audio
    if max_tokens is not None:
        raise ConfigError("give max_tokens or max_seconds, not both")
    if not audio or name != "audio" or not max_seconds > 0:
        raise ConfigError(f"max_seconds={max_seconds!r} is a budget of audio: a positive number of seconds over an "
                          f"audio dataset's audio column (this one plans by {name!r}); else max_tokens")
    return max(1, int(max_seconds * audio["sample_rate"]))


COARSE_RUNS = 1 << 20  # the most runs of ids `RaggedLengths` tables the shard of (8 MB): past it, a binary search


class RaggedLengths:
    """ids -> the length of each sample of a ragged column (in steps: a stereo frame is one) of
    one or more datasets' shards as one (a Mixture's union ids), from their offsets alone (a
    remote dataset's index, never its values). A class: it goes to spawned DataLoader workers."""

    def __init__(self, readers, name: str):
        self.readers, self.name = list(readers), name
        self._open()

    def _open(self) -> None:
        self.per_step = frames_of(self.readers[0].manifest.column(self.name))
        self._shards = [(r, k) for r in self.readers for k in range(len(r.shard_ends))]
        counts = np.asarray([n for r in self.readers for n in np.diff([0, *r.shard_ends])], np.int64)
        self._ends = np.cumsum(counts)
        self._starts = self._ends - counts
        self._offsets: dict[int, np.ndarray] = {}
        self._shortest: int | None = None
        self._coarse: tuple | None = None  # (k, the shard each run of 2**k ids starts in), made at first use

    def __getstate__(self) -> dict:
        return {"readers": self.readers, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.readers, self.name = state["readers"], state["name"]
        self._open()

    def offsets(self, g: int) -> np.ndarray:
        if g not in self._offsets:
            r, k = self._shards[g]
            self._offsets[g] = r.index(k, self.name).offsets
        return self._offsets[g]

    def __call__(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        shard = self._shard_of(ids)
        narrow = shard.astype(np.int16) if len(self._ends) < 1 << 15 else shard  # numpy sorts 16-bit keys by radix
        by_shard = np.argsort(narrow, kind="stable")  # one take per shard touched
        shard, rows = shard[by_shard], ids[by_shard] - self._starts[shard[by_shard]]
        lengths = np.empty(len(ids), np.int64)
        bounds = [0, *(np.flatnonzero(np.diff(shard)) + 1).tolist(), len(ids)]
        for a, b in zip(bounds[:-1], bounds[1:]):
            if a < b:
                offsets = self.offsets(int(shard[a]))
                lengths[a:b] = offsets[rows[a:b] + 1] - offsets[rows[a:b]]
        out = np.empty(len(ids), np.int64)
        out[by_shard] = lengths // self.per_step if self.per_step > 1 else lengths
        return out

    def _shard_of(self, ids: np.ndarray) -> np.ndarray:
        """The shard of each id: from a table of the shard where each run of 2**k ids starts (k:
        the runs no longer than the shortest shard, so a run crosses one shard's end at most),
        else a binary search of the shards' ends."""
        if self._coarse is None:
            shortest = int((self._ends - self._starts).min()) if len(self._ends) else 0
            k = max(shortest, 1).bit_length() - 1
            runs = -(-int(self._ends[-1]) // (1 << k)) if len(self._ends) else 0
            table = np.searchsorted(self._ends, np.arange(runs, dtype=np.int64) << k, side="right")
            self._coarse = (k, table) if runs <= COARSE_RUNS else (0, None)
        k, table = self._coarse
        if table is None:
            return np.searchsorted(self._ends, ids, side="right")
        shard = table[ids >> k]
        shard += ids >= self._ends[shard]
        return shard

    def shortest(self) -> int:
        """The shortest sample's length: every shard's offsets read once, then kept."""
        if self._shortest is None:
            mins = [int(np.diff(self.offsets(g)).min()) for g in range(len(self._shards)) if len(self.offsets(g)) > 1]
            self._shortest = min(mins, default=0) // self.per_step
        return self._shortest


class AspectOf:
    """ids -> their aspect-ratio buckets, from a batch source's image shapes (a class, not a
    closure: it goes to spawned DataLoader workers with the epochs)."""

    def __init__(self, source, name: str):
        self.source, self.name = source, name

    def __call__(self, ids):
        return aspect_bucket(self.source.shapes_of(self.name, ids))
