"""Several sources blended into one stream by weight, computed per position: O(1) memory, and
any position of a stream of 10^10 samples as cheap as the first.

Source k's j-th sample (j = 0, 1, ...) is an event at time (2j + 1) / w_k; the stream is every
source's events in time order, a tie going to the lower source. This is the order in which the
Sainte-Laguë (Webster) method awards seats, so every prefix of the stream holds each source in
proportion to its weight, off by less than K/2 samples with K sources (one with two; Megatron's
greedy blend is tighter with many skewed sources, but has no closed form). What makes it usable here is that it has a
closed form: the number of source k's events before time T is round(T w_k / 2) in effect, so the
counts at any position are found from an estimate and a few exact corrections, never by walking
the stream from its start as a greedy blend must.
"""

from __future__ import annotations

import math

import numpy as np

from packer.errors import ConfigError

from loaders.order.orders import Order, Permutation, Stream, derive_key, permute

SOURCE_KEY = 0x6D6978  # keys each source's own orders apart from a single dataset's with the same seed


def check_weights(weights) -> np.ndarray:
    """Positive, finite weights, normalised to sum to 1 (float64)."""
    try:
        w = np.asarray([float(x) for x in weights], dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"weights must be numbers, not {weights!r}") from None
    if len(w) == 0 or not np.isfinite(w).all() or (w <= 0).any():
        raise ConfigError(f"weights must be positive and finite, one per source: {list(weights)!r}")
    return w / w.sum()


def _time(count: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The time of each source's event number `count` (its (count+1)-th sample)."""
    return (2 * count + 1) / w


def counts_before(positions, w: np.ndarray) -> np.ndarray:
    """[len(positions), K]: how many samples of each source the stream holds before each position.

    round(g w_k) of each source is every event up to time 2g, about g of them; then the latest
    event of the set is dropped, or the earliest after it added, until it holds g, and one is
    swapped for the other while the set is not a prefix of the stream (which floating-point
    rounding of the estimate can make it)."""
    g = np.asarray(positions, dtype=np.int64).reshape(-1)
    k = len(w)
    c = np.floor(g[:, None] * w[None, :] + 0.5).astype(np.int64)
    rows = np.arange(len(g))
    for _ in range(4 * k + 16):  # each source's estimate is within about k / 2 of its count
        last_in = np.where(c > 0, _time(c - 1, w), -np.inf)
        first_out = _time(c, w)
        last = k - 1 - np.argmax(last_in[:, ::-1], axis=1)  # the latest included; on a tie the higher source
        first = np.argmin(first_out, axis=1)  # the earliest excluded; on a tie the lower source
        total = c.sum(axis=1)
        t_last, t_first = last_in[rows, last], first_out[rows, first]
        crossed = (total == g) & ((t_last > t_first) | ((t_last == t_first) & (last > first)))
        drop, add = (total > g) | crossed, (total < g) | crossed
        if not (drop.any() or add.any()):
            return c
        c[rows[drop], last[drop]] -= 1
        c[rows[add], first[add]] += 1
    raise AssertionError("blend counts did not settle")  # each step moves every row toward its count


def sources_at(positions, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, how many of that source's samples came before) of the stream's sample at each
    position."""
    g = np.asarray(positions, dtype=np.int64).reshape(-1)
    if len(g) > 1 and (np.diff(g) >= 0).all() and g[-1] - g[0] < SPAN * len(g):
        span = _span(int(g[0]), int(g[-1] - g[0]) + 1, w)
        if span is not None:
            return span[0][g - g[0]], span[1][g - g[0]]
    c = counts_before(g, w)
    source = np.argmin(_time(c, w), axis=1)
    return source, c[np.arange(len(c)), source]


SPAN = 8  # sorted positions spread over at most this many times their number are read off one run of the stream


def _span(first: int, count: int, w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(source, count before) of the stream positions [first, first + count): the exact counts
    at `first`, then each source's next events merged in time order (a tie to the lower source,
    as a stable sort of the sources' runs in source order gives), which costs a sort instead
    of counts_before's corrections per position. None when a source's run was too short to be
    sure of the merge (never expected: a source takes within K/2 of its share of any stretch)."""
    k = len(w)
    start = counts_before([first], w)[0]
    runs = np.ceil(count * w).astype(np.int64) + k + 1
    source = np.repeat(np.arange(k), runs)
    j = np.concatenate([s + np.arange(r) for s, r in zip(start.tolist(), runs.tolist())])
    order = np.argsort(_time(j, w[source]), kind="stable")[:count]
    if (np.bincount(source[order], minlength=k) >= runs).any():
        return None
    return source[order], j[order]


class Blend(Stream):
    """The stream of a mixture of sources of `sizes` samples, by `weights`, cut into epochs of
    `num_samples` positions (mixture epoch e continues where e - 1 ended). Pure integers: any
    position of any epoch is computed alone, whatever the sizes."""

    def __init__(self, sizes, weights, num_samples: int | None = None, *, before: Blend | None = None,
                 start: int = 0):
        self.sizes = [int(n) for n in sizes]
        self.weights = check_weights(weights)
        if len(self.weights) != len(self.sizes):
            raise ConfigError(f"one weight per source: {len(self.sizes)} sources, {len(self.weights)} weights")
        empty = next((k for k, n in enumerate(self.sizes) if n <= 0), None)
        if empty is not None:
            raise ConfigError(f"source {empty} of the mixture has no samples")
        if num_samples is None:  # the source with the largest weight through its samples once
            top = max(range(len(self.sizes)), key=lambda k: (self.weights[k], self.sizes[k]))
            num_samples = math.ceil(self.sizes[top] / self.weights[top])
        if type(num_samples) is not int or num_samples < 1:
            raise ConfigError(f"num_samples must be a positive int, not {num_samples!r}")
        self.num_samples = num_samples
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        # reweighted: the stream follows `before` up to position `start`, these weights from its counts there on
        self.before, self.start = before, start
        self.base = before.counts([start])[0] if before is not None else np.zeros(len(self.sizes), np.int64)

    def counts(self, positions) -> np.ndarray:
        """[len(positions), K]: each source's samples in the stream before each position."""
        g = np.asarray(positions, dtype=np.int64).reshape(-1)
        out = self.base + counts_before(np.maximum(g - self.start, 0), self.weights)
        early = g < self.start
        if early.any():
            out[early] = self.before.counts(g[early])
        return out

    def at(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """(source, how many of its samples came before) of the sample at each stream position."""
        g = np.asarray(positions, dtype=np.int64).reshape(-1)
        source, j = sources_at(np.maximum(g - self.start, 0), self.weights)
        j = j + self.base[source]
        early = g < self.start
        if early.any():
            source[early], j[early] = self.before.at(g[early])
        return source, j

    def reweighted(self, weights, position: int) -> Blend:
        """This stream up to `position`, then `weights` from each source's count there."""
        return Blend(self.sizes, weights, self.num_samples, before=self, start=position)

    def describe(self) -> dict:
        """What identifies the stream (in the resume state's source): weights, epoch, and where
        and from what it was reweighted."""
        out = {"weights": self.weights.tolist(), "num_samples": self.num_samples}
        if self.before is not None:
            out["from"] = {"position": self.start, "before": self.before.describe()}
        return out

    @classmethod
    def described(cls, sizes, doc: dict) -> Blend:
        before = cls.described(sizes, doc["from"]["before"]) if "from" in doc else None
        return cls(sizes, doc["weights"], doc["num_samples"], before=before,
                   start=doc["from"]["position"] if before else 0)

    def order_for(self, *, order: Order, seed: int, epoch: int, num_samples: int | None = None):
        """Positions of mixture epoch `epoch` -> union ids (source k's sample i is offsets[k] + i),
        each source in its own order of its own epochs (keyed by seed and source)."""

        sizes = np.asarray(self.sizes, dtype=np.int64)

        def perm(k: int, e: int) -> Permutation:
            return Permutation(self.sizes[k], order=order, seed=derive_key(seed, SOURCE_KEY, k), epoch=e)

        def ids(positions) -> np.ndarray:
            source, j = self.at(epoch * self.num_samples + np.asarray(positions, dtype=np.int64))
            own_epoch, pos = np.divmod(j, sizes[source])
            runs = [(k, e) for k in np.unique(source).tolist()  # (source, its own epoch) the positions hold
                    for e in np.unique(own_epoch[source == k]).tolist()]
            if order == "random":  # one pass of the Feistel network, a key and a size per sample
                key = np.empty(len(source), np.uint64)
                for k, e in runs:
                    key[(source == k) & (own_epoch == e)] = perm(k, e).key
                return self.offsets[source] + permute(pos, sizes[source], key)
            out = np.empty(len(source), np.int64)
            for k, e in runs:
                at = np.flatnonzero((source == k) & (own_epoch == e))
                out[at] = self.offsets[k] + perm(k, e)(pos[at])
            return out

        return ids

    def source_state(self, epoch: int, cursor: int) -> list[dict]:
        """Each source's own epoch and cursor once the stream has reached `cursor` of mixture
        epoch `epoch`."""
        taken = self.counts([epoch * self.num_samples + cursor])[0]
        return [{"epoch": int(t // n), "cursor": int(t % n)} for t, n in zip(taken.tolist(), self.sizes)]

    def source_of(self, ids) -> np.ndarray:
        return np.searchsorted(self.offsets, np.asarray(ids, dtype=np.int64), side="right") - 1
