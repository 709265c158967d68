"""`Mixture`: several datasets (or token-window views) as one stream of samples, each source
taking its share by weight at every prefix of the stream.

Each source walks its own O(1)-memory order (`loaders.order.orders.Permutation`, seeded per
source) and starts its next epoch when it is exhausted, independently of the others; which
source a stream position takes is `loaders.order.blend`. A mixture's epoch is `num_samples`
positions of that stream, and mixture epoch e continues where epoch e - 1 ended, so a source
upsampled 5x sees each of its samples 5 times, in 5 different orders. A batch's ids are union
ids: source k's sample i is `offsets[k] + i`.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from packer.errors import ConfigError

from loaders.batch.buffers import Memory, empty
from loaders.batch.gather import ColumnGather
from loaders.batch.source import BatchSource
from loaders.order.blend import Blend
from loaders.order.orders import Order, Stream
from loaders.views.dataset import MMapDataset
from loaders.views.packed import PackedDocuments
from loaders.views.tokens import TokenWindows

class Mixture(BatchSource, Stream):
    """Several sources of one kind as one stream, by weight.

    Args:
        sources: MMapDatasets (or dataset dirs) with the same columns, or TokenWindows (or
            PackedDocuments) views with the same seq_len.
        weights: each source's share of the samples (any positive numbers; normalised).
        num_samples: the mixture's epoch, in samples (default: until the source with the
            largest weight has been through its samples once, the others taking their shares).
        reweighted_from: a loader state saved over a Mixture of these sources with other
            weights (a curriculum): the stream is that one up to the state's place, then these
            weights from each source's count there. Load the state into the new loader.

    `Loader(Mixture(...), B, seed=...)`, `ds.batched`-style `BatchedDataset(...)` and
    `StatefulDataLoader` take it; `order` and `seed` there set each source's own order. Every
    batch carries a `source` column (int64: the index of each sample's source); a batch of
    TokenWindows is (x, y, source); of PackedDocuments, rows each from one source, whose
    cu_seqlens cover the batch as for one source.
    """

    def __init__(self, sources, weights, *, num_samples: int | None = None, reweighted_from: dict | None = None):
        sources = [MMapDataset(s) if isinstance(s, (str, os.PathLike)) else s for s in sources]
        if not sources:
            raise ConfigError("a Mixture needs at least one source")
        self.sources = sources
        self._parts = _parts(sources)
        sizes, parts = [len(s) for s in sources], [p.source_id for p in self._parts]
        self.blend = Blend(sizes, list(weights), num_samples)
        self.accepts: tuple[str, ...] = ()  # the state this mixture was reweighted from
        if reweighted_from is not None:
            self.blend = _reweighted(reweighted_from, sizes, parts, self.blend)
            self.accepts = (reweighted_from.get("source"),)
        self.weights, self.sizes, self.num_samples = self.blend.weights, self.blend.sizes, self.blend.num_samples
        self.source_id = "mixture:" + json.dumps({"sources": parts, **self.blend.describe()})

    def __len__(self) -> int:
        return self.num_samples

    def order_for(self, *, order: Order, seed: int, epoch: int, num_samples: int | None = None):
        """Positions of mixture epoch `epoch` -> union ids (what `Epochs` orders an epoch by)."""
        return self.blend.order_for(order=order, seed=seed, epoch=epoch)

    @property
    def column_gather(self) -> ColumnGather | None:
        """The one gather over every source's shards, where the sources are datasets (their
        ragged columns' lengths are what `bucket_by="length"` plans by); None for token views."""
        return self._parts[0] if isinstance(self._parts[0], ColumnGather) else None

    def source_state(self, epoch: int, cursor: int) -> list[dict]:
        return self.blend.source_state(epoch, cursor)

    def order_stream(self) -> Mixture:
        """Itself: its blend orders its epochs. (Its shards are fetched as batches read them: a
        lookahead and a cache check follow one dataset's gather.)"""
        return self

    def alloc(self, batch_size: int, memory: Memory) -> dict[str, torch.Tensor]:
        out = self._parts[0].alloc(batch_size, memory)
        if isinstance(self._parts[0], PackedDocuments):  # room for the most segments any source's rows hold
            per_row = max(p.alloc(1, "plain")["cu_seqlens"].numel() - 1 for p in self._parts)
            out["cu_seqlens"] = empty((batch_size * per_row + 1,), np.int32, memory)
        out["source"] = empty((batch_size,), np.int64, memory)
        return out

    def gather(self, ids: np.ndarray, buffers: dict, pool=None, num_threads: int = 1):
        ids = np.asarray(ids, dtype=np.int64)
        n = len(ids)
        source = buffers["source"][:n]
        source.numpy()[:] = self.blend.source_of(ids)
        if isinstance(self._parts[0], ColumnGather):  # datasets: one gather over all their shards
            return {**self._parts[0].gather(ids, buffers, pool, num_threads), "source": source}
        rows = ("window",) if isinstance(self._parts[0], TokenWindows) else ("tokens", "position_ids", "lengths")
        out = {name: buffers[name][:n] for name in rows}
        bounds = []  # packed documents: each source's segment ends, moved to its rows' places
        for k, part in enumerate(self._parts):
            sel = np.flatnonzero(source.numpy() == k)
            if not len(sel):
                continue
            own = part.alloc(len(sel), "plain")
            got = part.gather(ids[sel] - self.blend.offsets[k], own)
            for name in rows:
                out[name][torch.from_numpy(sel)] = own[name][: len(sel)]
            if "cu_seqlens" in own:
                ends = got["cu_seqlens"].numpy()[1:].astype(np.int64)
                row = (ends - 1) // part.seq_len
                bounds.append(sel[row] * part.seq_len + ends - row * part.seq_len)
        if "window" in out:
            return out["window"][:, :-1], out["window"][:, 1:], source
        ends = np.sort(np.concatenate(bounds)) if bounds else np.zeros(0, np.int64)
        cu = buffers["cu_seqlens"][: len(ends) + 1]
        cu.numpy()[0], cu.numpy()[1:] = 0, ends
        return {**out, "cu_seqlens": cu, "source": source}

    def __repr__(self) -> str:
        shares = ", ".join(f"{n:,} x {w:.3g}" for n, w in zip(self.sizes, self.weights))
        return f"Mixture({shares}; {self.num_samples:,} samples an epoch)"


def _reweighted(state: dict, sizes: list[int], parts: list[str], new: Blend) -> Blend:
    """The stream of the mixture that saved `state`, then `new`'s weights from the state's place
    on (the same stream when they are its weights already)."""
    source = state.get("source", "") if isinstance(state, dict) else ""
    try:
        doc = json.loads(source[len("mixture:"):]) if source.startswith("mixture:") else None
    except ValueError:
        doc = None
    if doc is None or doc.get("sources") != parts:
        raise ConfigError("reweighted_from: the state was not saved over a Mixture of these sources")
    if doc["num_samples"] != new.num_samples:
        raise ConfigError(f"reweighted_from: the state's mixture had epochs of {doc['num_samples']} samples, this "
                          f"one {new.num_samples}: pass num_samples={doc['num_samples']}")
    old = Blend.described(sizes, doc)
    if np.allclose(old.weights, new.weights):
        return old
    return old.reweighted(new.weights, state["epoch"] * new.num_samples + state["cursor"])


def _parts(sources) -> list:
    """What gathers the sources' samples: one ColumnGather over every dataset's shards, or the
    views themselves (token windows, packed documents: gathered apart, then placed)."""
    if all(isinstance(s, MMapDataset) for s in sources):
        names = list(sources[0].columns)
        if any(list(s.columns) != names for s in sources[1:]):
            other = next(s for s in sources[1:] if list(s.columns) != names)
            raise ConfigError(f"{other.root}: columns {list(other.columns)} differ from {sources[0].root}'s {names}; "
                              "mixed datasets must hold the same columns (open them with columns=[...])")
        other = next((s for s in sources[1:] if s.manifest.audio != sources[0].manifest.audio), None)
        if other is not None:  # the same frames would mean another time at another rate
            raise ConfigError(f"{other.root}: its audio ({other.manifest.audio}) is not {sources[0].root}'s "
                              f"({sources[0].manifest.audio}); mix datasets built at one rate, channels and dtype")
        if "label" in names:  # a label is an index into its dataset's classes: mixed, they must mean the same
            other = next((s for s in sources[1:] if s.classes != sources[0].classes), None)
            if other is not None:
                raise ConfigError(f"{other.root}: its classes differ from {sources[0].root}'s, so the same label would "
                                  "name two classes; mix datasets built with the same class folders, or open them "
                                  "with columns=[...] without label")
        return [ColumnGather([s.reader for s in sources], names, sources[0].padding_value)]
    if all(isinstance(s, TokenWindows) for s in sources):
        if len({s.seq_len for s in sources}) > 1:
            raise ConfigError(f"mixed TokenWindows must share seq_len: {[s.seq_len for s in sources]}")
        return list(sources)
    if all(isinstance(s, PackedDocuments) for s in sources):
        if len({(s.seq_len, s.padding_value) for s in sources}) > 1:
            raise ConfigError(f"mixed PackedDocuments must share seq_len and padding_value: "
                              f"{[(s.seq_len, s.padding_value) for s in sources]}")
        return list(sources)
    kinds = sorted({type(s).__name__ for s in sources})
    raise ConfigError(f"a Mixture mixes MMapDatasets, TokenWindows or PackedDocuments, one kind at a time, not "
                      f"{', '.join(kinds)}")
