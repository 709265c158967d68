"""Batches grouped by shape: an epoch order in which each run of `group` positions (a batch) holds
samples of one aspect-ratio bucket, so a keep-aspect batch's canvas is little more than its
images.

The epoch's random permutation is walked in order; each sample joins its bucket's pending
group, and a group is emitted when it is full, so groups come out in the order they fill, which
is random, deterministic in (seed, epoch), and takes every sample once. What is left in the
buckets at the epoch's end is its tail, in bucket order (at most one short group a bucket).
Memory: one group a bucket and a chunk of the walk, whatever the dataset's size. Finding a
position means walking the permutation up to it; a pass walks forward, so only a resume (or a
DataLoader worker's first batch) walks from the epoch's start, at numpy speed.
"""

from __future__ import annotations

import numpy as np

from loaders.order.orders import Permutation, Stream

STEPS_PER_OCTAVE = 8  # buckets a doubling of the aspect ratio spans: sides within 9% of each other
WALK = 1 << 16  # positions of the permutation walked at once


def aspect_bucket(shapes: np.ndarray) -> np.ndarray:
    """A bucket per (height, width, ...) row: the aspect ratio on a log scale, STEPS_PER_OCTAVE a
    doubling. Images of one build's side and one bucket differ in their long side by under 9%."""
    h, w = shapes[:, 0].astype(np.float64), shapes[:, 1].astype(np.float64)
    return np.round(np.log2(np.maximum(h, 1) / np.maximum(w, 1)) * STEPS_PER_OCTAVE).astype(np.int64)


class ShapeBuckets:
    """Positions of one epoch -> sample ids, grouped `group` at a time by `bucket_of(ids)`."""

    def __init__(self, num_samples: int, bucket_of, *, group: int, seed: int, epoch: int, order: str = "random"):
        self.num_samples, self.bucket_of, self.group = num_samples, bucket_of, group
        self.perm = Permutation(num_samples, order=order, seed=seed, epoch=epoch)
        self.epoch = epoch
        self._restart()

    def _restart(self) -> None:
        self.walked = 0  # positions of the permutation taken into the buckets
        self.pending: dict[int, np.ndarray] = {}
        self.base = 0  # the position of out[0] in the emitted order
        self.out = np.zeros(0, np.int64)

    def __call__(self, positions) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if not positions.size:
            return np.zeros(0, np.int64)
        lo, hi = int(positions.min()), int(positions.max()) + 1
        if lo < self.base:  # behind what is held: walk again from the epoch's start
            self._restart()
        while self.base + len(self.out) < hi:
            self._walk()
            if self.base + len(self.out) <= lo:  # all of it before the request: done with
                self.base, self.out = self.base + len(self.out), self.out[:0]
        self.out, self.base = self.out[lo - self.base:], lo
        return self.out[positions - lo]

    def _walk(self) -> None:
        """Walk the next WALK positions of the permutation into the buckets; emit the groups that
        fill, in the order they fill (and the tail once the walk is over)."""
        if self.walked >= self.num_samples:
            raise IndexError(f"positions must lie in [0, {self.num_samples})")
        stop = min(self.walked + WALK, self.num_samples)
        ids = self.perm(np.arange(self.walked, stop, dtype=np.int64))
        buckets = self.bucket_of(ids)
        filled = []  # (where in this walk the group filled, bucket, its ids)
        for k in np.unique(buckets).tolist():
            at = np.flatnonzero(buckets == k)
            held = self.pending.get(k, np.zeros(0, np.int64))
            queue = np.concatenate([held, ids[at]])
            whole = len(queue) // self.group
            for j in range(whole):
                filled.append((int(at[(j + 1) * self.group - len(held) - 1]), k, queue[j * self.group:(j + 1) * self.group]))
            self.pending[k] = queue[whole * self.group:]
        filled.sort(key=lambda f: f[0])
        parts = [self.out, *(f[2] for f in filled)]
        self.walked = stop
        if stop == self.num_samples:  # the tail: what is left, bucket by bucket
            parts += [self.pending[k] for k in sorted(self.pending)]
            self.pending = {}
        self.out = np.concatenate(parts)


class Bucketed(Stream):
    """What `Epochs` orders an epoch by when batches are grouped by shape: `ShapeBuckets` of one
    batch each, dealt to ranks a whole batch at a time (so a rank's batch is one group, and the
    order does not depend on the rank count, but does on the batch size). `buckets` says what
    the order depends on, for the resume state: what grouped (`bucket_by`, the user's option, of
    `column`) and the batch size."""

    def __init__(self, bucket_of, batch_size: int, *, bucket_by: str, column: str):
        self.bucket_of, self.deal_block = bucket_of, batch_size
        self.buckets = {"bucket_by": bucket_by, "column": column, "batch_size": batch_size}

    def order_for(self, *, order: str, seed: int, epoch: int, num_samples: int) -> ShapeBuckets:
        return ShapeBuckets(num_samples, self.bucket_of, group=self.deal_block, seed=seed, epoch=epoch, order=order)

