"""Batches planned by length, as pure functions of integers and arrays: what a batch may hold
(`Budget`), a window of samples sorted by length cut into batches from its buckets' counts alone
(`cut`), and the order a window's batches are dealt in (`layout`). `loaders.order.planned` keeps
an epoch's plan around them.

A batch's cost is counted on each length's bucket's upper edge (`EDGES`: STEPS_PER_OCTAVE a
doubling, exact below 17), not on the length itself, so that how many batches a window makes
follows from how many of its samples each bucket holds: a window's count needs a bincount of its
lengths, not a sort. The cost so counted is at most 4.4% above the real one (2**(1/16)), which
only makes a batch a little smaller than its budget allows; never larger.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from packer.errors import ConfigError

STEPS_PER_OCTAVE = 16
# every bucket's largest length: 1, 2, ..., 16, 17, 18, 19, 20, 22, ... (floor(2 ** (k / 16)), once each)
EDGES = np.unique(np.floor(2.0 ** (np.arange(62 * STEPS_PER_OCTAVE + 1) / STEPS_PER_OCTAVE)).astype(np.int64))
COSTS = ("linear", "quadratic")
SPAN_BUCKETS = 3  # a budget's batch holds lengths of at most 3 neighbouring buckets: within 2**(2/16), 9%


TABLED = 1 << 20  # lengths below this find their bucket in a table (2 MB), a gather instead of a binary search
_TABLE: list[np.ndarray] = []


def bucket_of(lengths) -> np.ndarray:
    """The bucket of each length: the first edge at or above it (a length of 0 is bucket 0's)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if not _TABLE:
        _TABLE.append(np.searchsorted(EDGES, np.arange(TABLED), side="left").astype(np.int16))
    small = lengths < TABLED
    if small.all():
        return _TABLE[0][np.maximum(lengths, 0)].astype(np.int64)
    out = np.searchsorted(EDGES, lengths, side="left")
    out[small] = _TABLE[0][np.maximum(lengths[small], 0)]
    return out


@dataclass(frozen=True)
class Budget:
    """What a batch may hold: at most `batch_size` samples (None: no limit of its own) and, with
    `max_tokens`, at most that many padded elements (its samples x its longest), or with cost
    "quadratic" its samples x its longest squared (attention's cost; NeMo's quadratic
    penalty). A sample over the budget alone is a batch of one."""

    batch_size: int | None = None
    max_tokens: int | None = None
    cost: str = "linear"

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"{name} must be a positive int, not {value!r}")
        if self.batch_size is None and self.max_tokens is None:
            raise ConfigError("a batch needs a batch_size, or a budget (max_tokens= or max_seconds=)")
        if self.cost not in COSTS:
            raise ConfigError(f"cost must be one of {COSTS}, not {self.cost!r}")
        if self.cost != "linear" and self.max_tokens is None:
            raise ConfigError(f"cost={self.cost!r} weighs a budget: give max_tokens= (or max_seconds=)")

    def cost_of(self, lengths) -> np.ndarray:
        """The cost of a batch whose longest sample is each of `lengths` (per sample in it), as
        float64 (exact to 2**53, far past any batch)."""
        width = np.maximum(np.asarray(lengths, dtype=np.float64), 1.0)  # a row of nothing still takes a row
        return width * width if self.cost == "quadratic" else width

    def over(self, lengths) -> np.ndarray:
        """Which samples are over the budget alone (each then a batch of one)."""
        if self.max_tokens is None:
            return np.zeros(np.shape(lengths), bool)
        return self.cost_of(lengths) > self.max_tokens

    def capacities(self) -> np.ndarray:
        """int64 [len(EDGES)]: the most samples a batch may hold whose longest sample lies in
        each bucket (at least 1), non-increasing."""
        return _capacities(self.batch_size, self.max_tokens, self.cost)

    @property
    def span(self) -> int | None:
        """The buckets a batch's samples may lie in with a budget (`cut`): SPAN_BUCKETS, lengths
        within 9% of each other (a fixed batch size takes its neighbours whatever their length)."""
        return SPAN_BUCKETS if self.max_tokens is not None else None

    def most(self, shortest: int = 1) -> int:
        """The most samples a batch of this budget holds when no sample is shorter than `shortest`."""
        return int(self.capacities()[bucket_of([shortest])[0]])

    def describe(self) -> dict:
        """The budget as the resume state records it."""
        return {"batch_size": self.batch_size, "max_tokens": self.max_tokens, "cost": self.cost}


@functools.lru_cache(maxsize=16)
def _capacities(batch_size: int | None, max_tokens: int | None, cost: str) -> np.ndarray:
    """`Budget.capacities`, in Python's integers (no rounding at any length), once per budget."""
    if max_tokens is None:
        return np.full(len(EDGES), batch_size, np.int64)
    caps = [max(1, max_tokens // (u * u if cost == "quadratic" else u)) for u in EDGES.tolist()]
    caps = np.asarray(caps, np.int64)
    caps.flags.writeable = False  # shared by every plan of the budget
    return np.minimum(caps, batch_size) if batch_size is not None else caps


def cut(counts: np.ndarray, caps: np.ndarray, carry: int = 0, span: int | None = None) -> list[tuple[int, int, int]]:
    """The batches of a window sorted by length whose buckets hold `counts` samples each: greedily
    from the shortest, each batch taking samples while their number stays within the capacity of
    its longest sample's bucket, and with `span`, while they lie within `span` buckets (a batch
    of a budget closes at a gap in the lengths rather than pad its short samples to a long one);
    the first batch holds `carry` places fewer (the epoch's phase, so a window is not cut alike
    every epoch). As runs (first end, step, how many) of the batches' end positions in the
    sorted window: `bounds` makes them the array."""
    runs = []
    pos = real = 0  # samples placed; real samples in the open batch
    held, first = carry, -1  # places taken in the open batch (the carry too); the bucket it began in
    for k in np.flatnonzero(counts).tolist():
        n, cap = int(counts[k]), int(caps[k])
        first = k if first < 0 else first
        if held and span is not None and k - first >= span:
            held = 0  # a gap in the lengths: closed as it is
        if held:
            take = min(max(cap - held, 0), n)
            held, real, pos, n = held + take, real + take, pos + take, n - take
            held = 0 if held >= cap else held  # full, or no room for a sample this long: closed
        if not held and real:
            runs.append((pos, 1, 1))
            real = 0
        if not n:
            continue
        full, rest = divmod(n, cap)
        if full:
            runs.append((pos + cap, cap, full))
        pos += full * cap
        if rest:
            held = real = rest
            pos, first = pos + rest, k
    if real:
        runs.append((pos, 1, 1))
    return runs


def count(runs) -> int:
    return sum(r[2] for r in runs)


def bounds(runs) -> np.ndarray:
    """int64 [batches + 1]: where each batch of `cut`'s runs starts and ends in the sorted window."""
    parts = [np.zeros(1, np.int64)] + [first + step * np.arange(n, dtype=np.int64) for first, step, n in runs]
    return np.concatenate(parts)


def fixed_count(sizes: np.ndarray, carries: np.ndarray, batch_size: int) -> np.ndarray:
    """`cut`'s batch count of windows of `sizes` samples with every capacity `batch_size` (no
    budget): closed form, no lengths needed."""
    return -(-(np.asarray(sizes, np.int64) + carries) // batch_size)


def layout(j: np.ndarray, *, batches: int, before: int, deal: int, groups) -> np.ndarray:
    """The sorted batch (0 = shortest) that a window's j-th batch in its order is.

    The epoch's batches are dealt `deal` at a time (a step of that many ranks), so a step should
    hold batches of about one length: each of them the same cost, no rank waits for another. A
    window's batches, sorted, are taken `deal` at a time into groups dealt in the order
    `groups(q)` (a permutation of the window's groups), the batch of a group each rank gets
    turning with the group. The window's shortest batches lie at its ends: the first
    (-before) % deal complete the step the window before began (whose tail is its own shortest
    ones), and the batches past its whole groups begin the next."""
    j = np.asarray(j, dtype=np.int64)
    head = min(-before % deal, batches)
    whole = (batches - head) // deal
    tail = batches - head - whole * deal
    out = j.copy()  # the head: in order
    late = j >= head + whole * deal
    out[late] = j[late] - whole * deal  # the tail: the shortest after the head
    mid = (j >= head) & ~late
    if mid.any():
        q, i = np.divmod(j[mid] - head, deal)
        out[mid] = head + tail + np.asarray(groups(q), dtype=np.int64) * deal + (i + q) % deal
    return out
