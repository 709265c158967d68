"""Epoch orders as bijections of [0, N) computed per position: O(1) memory, O(1) to start an
epoch, O(batch) for a batch's ids, whatever N is (10^10 token windows included).

`random`: a keyed Feistel network over the smallest square >= N, with cycle walking (a position
whose image is >= N is mapped again until it lands inside [0, N)): a permutation of [0, N)
chosen by (seed, epoch). `block`: for data larger than RAM, blocks of `block_size`
consecutive ids in a random order, then the ids inside consecutive windows of `window` positions
shuffled (each window by its own Feistel key): every read stays within a few blocks, so disk
access is near-sequential; cut in `parts` (one per rank), each part's blocks are the same every
epoch, as Streaming assigns shards to nodes (`_pinned`). `sequential`: the identity. Pure functions of integers (`Permutation`
only holds the keys); `loaders.order.sampler` deals the positions to ranks and counts the cursor.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

Order = Literal["random", "sequential", "block"]
ORDERS = ("random", "sequential", "block")


class Stream:
    """What orders an epoch instead of a permutation (a Mixture's blend, batches grouped by
    shape), declared: `order_for` gives an epoch's positions -> ids; `deal_block`, the ids dealt
    to a rank at once (a shape group's batch); `buckets`, what the order depends on beyond the
    seed (part of the resume state); `source_state`, what a mixture records of its sources."""

    deal_block = 1
    buckets: dict | None = None

    def order_for(self, *, order: Order, seed: int, epoch: int, num_samples: int | None = None):
        raise NotImplementedError

    def source_state(self, epoch: int, cursor: int) -> list | None:
        return None
ROUNDS = 8  # Feistel rounds: 4 make a strong pseudo-random permutation of a random round function
WINDOW = 8192  # block order's window: the positions whose ids are shuffled among themselves
PIN = 0x50494E  # the purpose that keys block order's assignment of blocks to parts
_GOLDEN = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, in place on a uint64 array (wrapping arithmetic): a bijective
    avalanche of every bit."""
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def derive_key(*parts: int) -> int:
    """A 64-bit key from integers (seed, epoch, purpose, ...): splitmix64 chained over them."""
    key = 0
    for part in parts:  # mix in Python ints: a numpy array per part cost more than a batch's ids
        key = (key + _GOLDEN + (int(part) & _M64)) & _M64
        key ^= key >> 30
        key = key * 0xBF58476D1CE4E5B9 & _M64
        key ^= key >> 27
        key = key * 0x94D049BB133111EB & _M64
        key ^= key >> 31
    return key


def round_function(right: np.ndarray, side, key, r: int) -> np.ndarray:
    """Round r's F of the Feistel network: the mixed right half scaled into [0, side) (multiply
    and shift: no division), uint64; `key` 1-d (one, or one per element)."""
    f = mix(right ^ (key + np.uint64((r + 1) * _GOLDEN & _M64)))
    f >>= np.uint64(32)
    f *= np.asarray(side, dtype=np.uint64)
    f >>= np.uint64(32)
    return f


def feistel(x: np.ndarray, side: int, key) -> np.ndarray:
    """A keyed bijection of [0, side**2) applied to uint64 `x` (side < 2**32), as two digits
    base `side` (left, right), each round (left, right) -> (right, left + F(right) mod side)
    (`round_function`); `side` and `key` are each one for all elements or an array of one per
    element."""
    s = np.asarray(side, dtype=np.uint64)
    left, right = x // s, x % s
    key = np.asarray(key, dtype=np.uint64).reshape(-1)  # 1-d: wrapping array arithmetic, no warnings
    for r in range(ROUNDS):
        f = round_function(right, s, key, r)
        f += left
        f -= s * (f >= s)
        left, right = right, f
    return left * s + right


def permute(positions: np.ndarray, n, key) -> np.ndarray:
    """The images of `positions` (in [0, n)) under the keyed permutation of [0, n), int64: the
    Feistel network over the smallest square >= n, whose images past n are mapped again (cycle
    walking) until they land in [0, n); at most 2 / sqrt(n) of them need it. `n` and `key` are
    each one for all positions or an array of one per position (several permutations applied
    in one pass: what a mixture's sources cost)."""
    x = np.asarray(positions, dtype=np.uint64)
    if np.ndim(n) == 0:
        if n <= 1:
            return x.astype(np.int64)
        side = math.isqrt(n - 1) + 1
    else:
        side = _side(np.asarray(n, dtype=np.uint64))
    n, key = np.asarray(n, dtype=np.uint64), np.asarray(key, dtype=np.uint64)
    out = feistel(x, side, key)
    outside = out >= n
    while outside.any():
        out[outside] = feistel(out[outside], _part(side, outside), _part(key, outside))
        outside = out >= n
    return out.astype(np.int64)


def _part(values, mask: np.ndarray):
    """The elements of a per-element array under `mask`, or the one value for all."""
    values = np.asarray(values)
    return values[mask] if values.ndim and values.size == mask.size else values


def _side(n: np.ndarray) -> np.ndarray:
    """isqrt(n - 1) + 1 of each element (n >= 1): the smallest side whose square holds n."""
    m = n - np.uint64(1)
    r = np.floor(np.sqrt(m.astype(np.float64))).astype(np.uint64)
    r -= (r * r > m).astype(np.uint64)  # the float root may be one off either way
    r += ((r + np.uint64(1)) * (r + np.uint64(1)) <= m).astype(np.uint64)
    return r + np.uint64(1)


class Permutation:
    """The epoch's order of [0, num_samples): `perm(positions)` -> sample ids, int64.

    A pure function of (num_samples, order, seed, epoch, block_size, window); nothing of size N
    is ever made."""

    def __init__(self, num_samples: int, *, order: Order, seed: int, epoch: int, block_size: int = 1024,
                 window: int = WINDOW, parts: int = 1):
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
        if block_size <= 0 or window <= 0 or parts <= 0:
            raise ValueError("block_size, window and parts must be positive")
        self.num_samples, self.order, self.block_size, self.window = num_samples, order, block_size, window
        self.epoch, self.parts = epoch, parts
        self.key = derive_key(seed, epoch, ORDERS.index(order))
        self.pin_key = derive_key(seed, ORDERS.index(order), PIN)  # no epoch: which blocks a part holds
        self._rounds: list[np.ndarray] | None = None  # each Feistel round's function of the right half (`_tabled`)

    def __call__(self, positions) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        n = self.num_samples
        if positions.size and (positions.min() < 0 or positions.max() >= n):
            raise IndexError(f"positions must lie in [0, {n})")
        if self.order == "sequential":
            return positions.copy()
        if self.order == "random":
            if n > 1 and positions.size >= math.isqrt(n - 1) + 1:  # as many positions as a round has values
                return self._tabled(positions)
            return permute(positions, n, self.key)
        if self.parts > 1:
            return self._pinned(positions)
        return self._block(positions)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_rounds": None}  # made again where needed, not sent to a worker

    def _tabled(self, positions: np.ndarray) -> np.ndarray:
        """`permute` of many positions with each round's function read from a table of its `side`
        values, made once: the same images, a gather and an add a round instead of a mix
        (an epoch's lengths counted over every position: `loaders.order.planned`, bench sampler)."""
        n = self.num_samples
        side = math.isqrt(n - 1) + 1
        if self._rounds is None:
            values, key = np.arange(side, dtype=np.uint64), np.asarray([self.key], dtype=np.uint64)
            self._rounds = [round_function(values, side, key, r).astype(np.int64) for r in range(ROUNDS)]

        def walk(x: np.ndarray) -> np.ndarray:
            left, right = np.divmod(x, side)
            for table in self._rounds:
                f = table[right]
                f += left
                f -= side * (f >= side)
                left, right = right, f
            return left * side + right

        out = walk(positions)
        outside = out >= n
        while outside.any():
            out[outside] = walk(out[outside])
            outside = out >= n
        return out

    def _block(self, positions: np.ndarray) -> np.ndarray:
        n, w, bs = self.num_samples, self.window, self.block_size
        # 1. inside its window of `w` positions, a position moves to a shuffled one (the last
        #    window may be shorter: it has a domain of its own)
        start = positions // w * w
        last_start = (n - 1) // w * w
        seq = np.empty_like(positions)
        for full in (True, False):
            sel = (start != last_start) if full else (start == last_start)
            if sel.any():
                size = w if full else n - last_start
                keys = _window_keys(self.key, positions[sel] // w)
                seq[sel] = start[sel] + permute(positions[sel] - start[sel], size, keys)
        # 2. the sequence of whole blocks in a random order, the short tail block (if any) last
        full_blocks = n // bs
        out = seq.copy()
        inside = seq < full_blocks * bs
        if inside.any():
            block = permute(seq[inside] // bs, full_blocks, self.key)
            out[inside] = block * bs + seq[inside] % bs
        return out


    def _pinned(self, positions: np.ndarray) -> np.ndarray:
        """Block order cut in `parts` contiguous parts (`sampler.sliced`'s), each holding the same
        blocks every epoch: a rank (and so a node) whose part is cached reads nothing again.
        1. A position moves inside its part's window of `w` positions (windows counted from the
           part's start, so no position leaves its part).
        2. The block slots wholly inside each part are shuffled among themselves by the epoch's
           key (a slot two parts share stays), then all slots are mapped to blocks by a
           permutation without the epoch (`pin_key`): which blocks a part holds is chosen at
           random once, the order it reads them in every epoch. The short tail block stays last."""
        n, w, bs, parts = self.num_samples, self.window, self.block_size, self.parts
        part = _part_of(positions, n, parts)
        first = _part_start(part, n, parts)
        local = positions - first
        size = _part_start(part + 1, n, parts) - first
        start = local // w * w
        windows = part.astype(np.uint64) * np.uint64(1 << 32) + (local // w).astype(np.uint64)
        seq = first + start + permute(local - start, np.minimum(size - start, w), _window_keys(self.key, windows))
        full_blocks = n // bs
        out = seq.copy()
        inside = seq < full_blocks * bs
        if inside.any():
            slot, group = seq[inside] // bs, part[inside]
            low = -(-_part_start(group, n, parts) // bs)  # the slots wholly inside the part
            high = _part_start(group + 1, n, parts) // bs
            own = (slot >= low) & (slot < high)  # a slot two parts share is read by both, unshuffled
            slot[own] = low[own] + permute(slot[own] - low[own], (high - low)[own],
                                           _window_keys(self.key, group[own] + np.int64(1 << 40)))
            out[inside] = permute(slot, full_blocks, self.pin_key) * bs + seq[inside] % bs
        return out


def _part_start(part: np.ndarray, n: int, parts: int) -> np.ndarray:
    """The first position of each part of [0, n) cut in `parts` (`sampler.sliced`'s cut: part s
    holds n // parts positions, one more for s < n % parts); part `parts` starts at n."""
    base, extra = divmod(n, parts)
    return part * base + np.minimum(part, extra)


def _part_of(positions: np.ndarray, n: int, parts: int) -> np.ndarray:
    """The part of [0, n) cut in `parts` that holds each position (the inverse of `_part_start`)."""
    base, extra = divmod(n, parts)
    long = extra * (base + 1)  # the positions of the parts one longer
    if base == 0:
        return positions.copy()
    return np.where(positions < long, positions // (base + 1), extra + (positions - long) // base)


def _window_keys(key: int, windows: np.ndarray) -> np.ndarray:
    keys = mix(windows.astype(np.uint64) + np.uint64(1))
    keys ^= np.uint64(key)
    return mix(keys)


def epoch_order(num_samples: int, *, order: Order, seed: int, epoch: int, block_size: int = 1024,
                window: int = WINDOW, parts: int = 1) -> np.ndarray:
    """The whole epoch's order, int64 [num_samples]: for tests and small datasets; readers ask
    `Permutation` for the positions they need."""
    perm = Permutation(num_samples, order=order, seed=seed, epoch=epoch, block_size=block_size, window=window,
                       parts=parts)
    return perm(np.arange(num_samples, dtype=np.int64))
