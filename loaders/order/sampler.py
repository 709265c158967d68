"""Rank shares, the resumable cursor and the resume state: pure functions of integers, and the
`Epochs` that every reader keeps around them.

An epoch's order is `loaders.order.orders.Permutation(seed, epoch)`. Ranks read it through the
epoch's global order, the order cut in `slices` contiguous parts walked side by side (`sliced`;
the world size when the epoch started), so that with interleaved dealing rank r reads part r
only: on a node with its own cache a rank fetches the shards of its part of the epoch. The
`cursor` counts the positions of the global order already consumed by all ranks together. From
any cursor the remaining positions are dealt to ranks interleaved (rank r takes
remaining[r::W]), so a resumed run, with the same or another world size, batch size, worker or
thread count, covers each remaining sample once (batches grouped by shape are an order of their
batch size: they resume with the same one). Everything else the order depends on is in the
resume state and compared when it is loaded. Nothing here is O(N): a batch's ids are computed
from its positions.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import numpy as np

from packer.errors import ConfigError

from loaders.order.orders import ORDERS, WINDOW, Order, Permutation

CHUNK = 16384  # positions whose ids are computed at once: numpy's per-call cost spread over many batches
STATE_VERSION = 5  # 1: the full-permutation orders of mmpack 0.3 (another order for the same seed)
READS = (2, 3, 4, 5)  # 2: no slices (the global order was the epoch's order: one slice); 2, 3: no drop_last,
# buckets; 2-4: block order's parts not pinned (each epoch dealt all blocks anew: `Pass.pinned`)
REBUILD = "load it into a loader built like the one that saved it"
KEY_LIMIT = 1 << 64  # seeds and epochs key the orders as 64-bit integers: larger ones would wrap


def check_int(name: str, value, low: int = 0, high: int = KEY_LIMIT) -> int:
    """`value` when it is an int (not a bool) in [low, high), else a ConfigError naming it."""
    if type(value) is not int and not (isinstance(value, np.integer) and not isinstance(value, np.bool_)):
        raise ConfigError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    if not low <= value < high:
        if high < KEY_LIMIT:
            raise ConfigError(f"{name} {value} is outside [{low}, {high})")
        floor = "a non-negative int" if low == 0 else f"an int >= {low}"
        raise ConfigError(f"{name} must be {floor} below 2**64, got {value}")
    return int(value)


def rank_count(remaining: int, *, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Samples each rank takes of `remaining`: with drop_last whole global batches only, else
    every remaining sample, the tail padded so that every rank gets the same count (as
    DistributedSampler does)."""
    if drop_last:
        return remaining // (world_size * batch_size) * batch_size
    return -(-remaining // world_size)


def rank_positions(cursor: int, first: int, stop: int, *, num_samples: int, rank: int, world_size: int,
                   block: int = 1) -> np.ndarray:
    """Positions in the epoch's order of rank's samples [first, stop) from `cursor` on: rank r's
    j-th is cursor + j*W + r, or with `block` B (batches grouped by shape) the ranks take turns a
    block at a time, cursor + (j // B)*B*W + r*B + j % B, up to the last short global batch,
    dealt sample by sample; past the end, the padding repeats the order from its start."""
    j = np.arange(first, stop, dtype=np.int64)
    pos = cursor + (j // block) * block * world_size + rank * block + j % block
    if block > 1:  # the last, short global batch is dealt sample by sample, as without blocks
        whole = (num_samples - cursor) // (block * world_size) * block  # this rank's samples in whole ones
        rest = j >= whole
        pos[rest] = cursor + whole * world_size + (j[rest] - whole) * world_size + rank
    past = pos >= num_samples
    if past.any():
        pos[past] = (pos[past] - num_samples) % max(num_samples, 1)
    return pos


def sliced(positions: np.ndarray, num_samples: int, slices: int) -> np.ndarray:
    """Positions of the global order -> positions of the epoch's order cut in `slices`
    contiguous parts walked side by side: the global order's position p is position p // S of
    part p % S. Dealt interleaved to S ranks, rank r reads part r only. A bijection of [0, N)
    for any S, which a state resumed on another rank count relies on."""
    if slices <= 1:
        return positions
    part, k = positions % slices, positions // slices
    base, extra = divmod(num_samples, slices)  # part s holds base positions, one more for s < extra
    return part * base + np.minimum(part, extra) + k


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1, 1 << 31)
        check_int("rank", self.rank, 0, self.world_size)


def resolve_topology(rank: int | None = None, world_size: int | None = None) -> Topology:
    """Explicit arguments, else torch.distributed when initialised, else RANK / WORLD_SIZE,
    else a single process."""
    if rank is not None or world_size is not None:
        return Topology(rank or 0, world_size or 1)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return Topology(dist.get_rank(), dist.get_world_size())
    except ImportError:
        pass
    return Topology(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))


@dataclass(frozen=True)
class Pass:
    """One pass over (the rest of) an epoch, fixed when it starts: its batches' ids are a pure
    function of these integers, so any process (a DataLoader worker) can make any batch."""

    epoch: int
    cursor: int
    num_batches: int | None  # None: known once its epoch's plan is counted to its end (`Epochs.has`)
    slices: int = 1  # the parts of the epoch's order walked side by side (`sliced`)
    pinned: bool = True  # block order: each part holds the same blocks every epoch (False: a state before)


class Epochs:
    """The state around the functions above, shared by every reader: order, seed, epoch, this
    rank's place, and the cursor.

    Only a loaded state resumes mid-epoch: the first pass after `load_state_dict` starts at the
    loaded cursor. Every other pass starts an epoch from its beginning, as a DataLoader iterator
    does: the current epoch, or, after a pass left early (a peek with `next(iter(loader))`, a
    `break`), the next one, a new order, as a shuffled DataLoader's next iterator draws one
    (starting the same epoch again would train every such pass on the same first batches). A
    pass left early keeps its place in `state_dict()` until the next one starts, for a checkpoint
    of what was taken. A pass that reaches the end of its epoch moves on to the next
    epoch. `set_epoch(e)` names the next pass's epoch: from its beginning, but for the epoch of
    a loaded state, whose cursor it keeps (so the usual loop, which calls it at the top of every
    epoch, does not replay a resumed epoch)."""

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool, order: Order | None, seed: int,
                 drop_last: bool, rank: int | None, world_size: int | None, source: str = "", stream=None,
                 block_window: int = WINDOW):
        check_int("batch_size", batch_size, 1)
        order = order or ("random" if shuffle else "sequential")
        if order not in ORDERS:
            raise ConfigError(f"order must be one of {ORDERS}, not {order!r}")
        self.block_window = check_int("block_window", block_window, 1, 1 << 40)
        if block_window != WINDOW and (order != "block" or stream is not None):
            raise ConfigError(f"block_window={block_window} is block order's window (order='block'), over one dataset "
                              "without bucket_by (a Mixture's sources and buckets keep their own)")
        topo = resolve_topology(rank, world_size)
        self.num_samples, self.batch_size, self.seed, self.order = num_samples, int(batch_size), check_int("seed", seed), order
        self.drop_last, self.rank, self.world_size = drop_last, topo.rank, topo.world_size
        self.source = source  # what the samples are (the content_id of a dataset, and the view)
        # a Mixture's blend, or batches grouped by shape: what orders an epoch instead of a permutation
        self.stream = stream
        self.block = stream.deal_block if stream is not None else 1
        self.buckets = stream.buckets if stream is not None else None  # grouped by shape: what their order depends on
        self.epoch = 0
        self.cursor = 0
        self.slices = self.fresh_slices()  # of the epoch in progress
        self.pinned = True  # of the epoch in progress: False for a resumed state of version 4 or earlier
        self.resuming = False  # a loaded state's cursor is where the next pass starts
        self.partial = False  # a pass started and not taken to its end: the next one takes a new epoch
        self._perm: tuple | None = None  # (epoch, its positions -> ids)
        self._chunk: tuple[tuple[int, int, int], np.ndarray] | None = None  # (epoch, cursor, chunk) -> ids
        self.padding = None  # what a loader counts of the batches it hands over (`loaders.padding`), or None

    def most_per_batch(self) -> int:
        """The most samples a batch holds (what a ring's buffers are made for)."""
        return self.batch_size

    def set_epoch(self, epoch: int) -> None:
        epoch = check_int("epoch", epoch)
        if epoch != self.epoch:
            self.epoch, self.cursor, self.resuming = epoch, 0, False
        self.partial = False

    @property
    def next_cursor(self) -> int:
        """Where the next pass starts in its epoch: a loaded state's cursor, else 0."""
        return self.cursor if self.resuming else 0

    def upcoming(self) -> Pass:
        """The pass the next iteration makes, without starting it: from a loaded state's cursor,
        else an epoch from its beginning (the next one after a pass left early)."""
        epoch = self.epoch + 1 if self.partial and not self.resuming else self.epoch
        if self.next_cursor:  # a resumed epoch keeps its parts, cut as they were
            return Pass(epoch, self.next_cursor, self.known_count(self.next_cursor), self.slices, self.pinned)
        return self.fresh(epoch)

    def known_count(self, cursor: int) -> int | None:
        """This rank's batches of a pass from `cursor`, known before it starts (None where they are
        known only at its end: a plan by length's)."""
        return -(-self.per_rank(cursor) // self.batch_size)

    def fresh_slices(self) -> int:
        """The parts of an epoch started now: one per rank. A mixture's stream or batches
        grouped by shape keep one (their positions carry the blend's and the buckets' order)."""
        return self.world_size if self.stream is None else 1

    def start(self) -> Pass:
        """Start the next pass (`upcoming`); from here `state_dict()` describes it. A loaded
        cursor is used once."""
        p = self.upcoming()
        self.epoch, self.cursor, self.resuming, self.partial = p.epoch, p.cursor, False, True
        self.slices, self.pinned = p.slices, p.pinned
        return p

    def per_rank(self, cursor: int | None = None) -> int:
        """Samples this rank takes from `cursor` (default: the next pass's start)."""
        cursor = self.next_cursor if cursor is None else cursor
        return rank_count(max(self.num_samples - cursor, 0), world_size=self.world_size,
                          batch_size=self.batch_size, drop_last=self.drop_last)

    def num_batches(self) -> int:
        """This rank's batches of the next pass (over a plan by length, its epoch counted)."""
        return self.count(self.upcoming())

    def has(self, p: Pass, b: int) -> bool:
        """Whether pass p has a batch b (this rank's, every rank as many): what a loop over a pass
        asks instead of its count, which a plan by length knows only at the epoch's end."""
        return b < p.num_batches

    def count(self, p: Pass) -> int:
        """The batches of pass p: its whole plan counted (over a plan by length, an O(N) pass)."""
        return p.num_batches

    def batches(self, p: Pass, first: int = 0, step: int = 1):
        """Batch numbers first, first + step, ... of pass p, while it has them (a DataLoader
        worker's share: first = its id, step = the worker count, which DataLoader takes round-robin,
        so the order is the same whatever the count)."""
        b = first
        while self.has(p, b):
            yield b
            b += step

    def repeats(self, p: Pass, b: int) -> bool:
        """Whether this rank's batch b of pass p repeats batches of the epoch (counted by `padding`):
        a plan by length's last round made whole; samples, not batches, repeat here."""
        return False

    def dropped(self, p: Pass) -> int:
        """Batches of the epoch no rank takes in pass p (counted by `padding`): none here, where
        drop_last drops samples."""
        return 0

    def clip(self, p: Pass, n: int) -> int:
        """min(n, batches of pass p), counting no further than batch n."""
        return n if n <= 0 or self.has(p, n - 1) else self.count(p)

    def ids(self, p: Pass, first: int, stop: int) -> np.ndarray:
        """Sample ids of this rank's samples [first, stop) of pass `p` (clipped to the pass)."""
        stop = min(stop, self.per_rank(p.cursor))
        parts = [self._ids_of_chunk(p, c)[max(first - c * CHUNK, 0):stop - c * CHUNK]
                 for c in range(first // CHUNK, -(-stop // CHUNK))]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _ids_of_chunk(self, p: Pass, c: int) -> np.ndarray:
        key = (p.epoch, p.cursor, p.slices, p.pinned, c)
        if self._chunk is None or self._chunk[0] != key:
            stop = min((c + 1) * CHUNK, self.per_rank(p.cursor))
            pos = rank_positions(p.cursor, c * CHUNK, stop, num_samples=self.num_samples, rank=self.rank,
                                 world_size=self.world_size, block=self.block)
            perm = self.permutation(p.epoch, p.slices if p.pinned else 1)
            self._chunk = (key, perm(sliced(pos, self.num_samples, p.slices)))
        return self._chunk[1]

    def batch_ids(self, p: Pass, b: int) -> np.ndarray:
        return self.ids(p, b * self.batch_size, (b + 1) * self.batch_size)

    def fresh(self, epoch: int) -> Pass:
        """Epoch `epoch`'s pass from its start."""
        return Pass(epoch, 0, self.known_count(0), self.fresh_slices())

    def ahead_of(self, p: Pass, first: int = 0, step: int = 1):
        """(ids(i), more(i)): the i-th of batches first, first + step, ... of pass p, then of the
        next epoch's from its start (a DataLoader worker's share, as `batches`), each computed
        apart from this object's caches; `more(i)`: whether there is an i-th. What a lookahead
        reads (a cache keeps what the next epoch starts with)."""
        this, after = self.twin(), self.twin()
        following = after.fresh(p.epoch + 1)

        def where(i: int) -> tuple:
            b = first + i * step
            if this.has(p, b):
                return this, p, b
            mine = len(range(first, this.count(p), step))  # this share's batches of pass p
            return after, following, first + (i - mine) * step

        def ids(i: int) -> np.ndarray:
            epochs, q, b = where(i)
            return epochs.batch_ids(q, b)

        def more(i: int) -> bool:
            epochs, q, b = where(i)
            return epochs.has(q, b)
        return ids, more

    def twin(self) -> Epochs:
        """A copy whose ids are computed apart from this one's (its own caches of the order): what a
        thread that reads the order ahead uses."""
        twin = copy.copy(self)
        twin._perm = twin._chunk = None
        return twin

    def permutation(self, epoch: int, parts: int = 1):
        """Positions of `epoch` -> sample ids: the epoch's permutation (block order's cut in
        `parts`, each holding its blocks every epoch), or a mixture's stream."""
        if self._perm is None or self._perm[0] != (epoch, parts):
            if self.stream is not None:
                ids = self.stream.order_for(order=self.order, seed=self.seed, epoch=epoch, num_samples=self.num_samples)
            else:
                ids = Permutation(self.num_samples, order=self.order, seed=self.seed, epoch=epoch, parts=parts,
                                  window=self.block_window)
            self._perm = ((epoch, parts), ids)
        return self._perm[1]

    def taken(self, p: Pass, batches: int) -> None:
        """The caller has taken `batches` batches of pass `p` (each rank as many): move the cursor
        past them, and to the next epoch once the pass is whole."""
        self.epoch = p.epoch
        self.cursor = min(p.cursor + batches * self.batch_size * self.world_size, self.num_samples)
        if not self.has(p, batches):
            self.epoch, self.cursor, self.partial = p.epoch + 1, 0, False

    def state_dict(self) -> dict:
        """A few integers and the identity of what they index: enough to resume exactly in a
        fresh process, whatever the worker, thread or rank count."""
        state = {"version": STATE_VERSION, "source": self.source, "num_samples": self.num_samples,
                 "order": self.order, "seed": self.seed, "drop_last": bool(self.drop_last),
                 "buckets": dict(self.buckets) if self.buckets is not None else None, "epoch": self.epoch,
                 "cursor": self.cursor, "slices": self.slices, "pinned": self.pinned, "block_window": self.block_window}
        sources = self.stream.source_state(self.epoch, self.cursor) if self.stream is not None else None
        if sources is not None:  # a mixture's sources' own epochs and cursors, for the record
            state["sources"] = sources
        return state

    def load_state_dict(self, state: dict) -> None:
        """Take a saved state; a state of another dataset, view, size, order, seed, drop_last or
        grouping by shape (`check_grouping`) is refused."""
        if not isinstance(state, dict) or state.get("version") not in READS:
            raise ConfigError(f"not a loader state of this mmpack (version {state.get('version') if isinstance(state, dict) else None!r}, "
                              f"expected one of {READS}); states of mmpack 0.3 and earlier used other orders "
                              "and cannot be resumed exactly")
        mine = self.state_dict()
        for name in ("source", "num_samples", "order", "seed"):
            if name == "source" and state.get(name) in getattr(self.stream, "accepts", ()):
                continue  # the state a reweighted mixture goes on from
            if name == "source" and state.get(name) != mine[name] and str(state.get(name)).startswith("mixture:"):
                raise ConfigError("the state was saved over a Mixture of other weights or sources; to go on with new "
                                  "weights from where it stopped (a curriculum), build the Mixture with "
                                  "reweighted_from=state, then load it")
            if state.get(name) != mine[name]:
                raise ConfigError(f"the state is for {name} {state.get(name)!r}, this loader has {mine[name]!r}: "
                                  f"it was saved over another dataset, view or order; {REBUILD}")
        self.check_grouping(state)
        window = state.get("block_window", WINDOW)  # (a state before version 5: the window all had)
        if window != self.block_window:
            raise ConfigError(f"the state was saved with block_window={window!r}, this loader has "
                              f"block_window={self.block_window}: its order is another; {REBUILD}")
        epoch, cursor = state.get("epoch"), state.get("cursor")
        if type(epoch) is not int or type(cursor) is not int or not 0 <= epoch < KEY_LIMIT or not 0 <= cursor <= self.num_samples:
            raise ConfigError(f"the state's epoch {epoch!r} / cursor {cursor!r} are not valid for "
                              f"{self.num_samples} samples")
        slices = state.get("slices", 1) if state["version"] == 2 else state.get("slices")
        if type(slices) is not int or not 1 <= slices < 1 << 31 or (slices > 1 and self.stream is not None):
            raise ConfigError(f"the state's slices {slices!r} are not valid for this loader")
        pinned = state.get("pinned") if state["version"] >= 5 else False
        if type(pinned) is not bool:
            raise ConfigError(f"the state's pinned {pinned!r} is not valid (a bool)")
        self.epoch, self.cursor, self.slices, self.resuming, self.partial = epoch, cursor, slices, True, False
        self.pinned = pinned

    def check_grouping(self, state: dict) -> None:
        """A ConfigError, naming what differs, when the state's batches were made otherwise than
        this loader's are: with another drop_last (where the epoch ends), or grouped by shape
        otherwise (another order: none, another kind, or another batch size). States before
        version 4 record neither: taken as saved without buckets (version 2, mmpack 0.4.0's, had
        none), their drop_last unchecked."""
        recorded = state["version"] >= 4
        theirs = state.get("drop_last")
        if recorded and (type(theirs) is not bool or theirs != bool(self.drop_last)):
            raise ConfigError(f"the state was saved with drop_last={theirs!r}, this loader has "
                              f"drop_last={bool(self.drop_last)}: {REBUILD}")
        theirs, mine = state.get("buckets") if recorded else None, self.buckets
        if theirs == mine:
            return
        if not recorded:
            raise ConfigError(f"the state (version {state['version']}) records neither bucket_by nor a batch size, "
                              f"this loader has {_grouping(mine)} and batch_size {mine['batch_size']}: batches "
                              "grouped by shape resume from states of version 4 on; start the state's epoch over "
                              "with set_epoch")
        budget = ("batch_size", "max_tokens", "cost")
        if isinstance(theirs, dict) and mine is not None and \
                {**theirs, **{k: mine.get(k) for k in budget if k in mine}} == mine:
            ours = _budget(mine)
            if ours.startswith("batch_size ") and _budget(theirs).startswith("batch_size "):
                ours = ours[len("batch_size "):]  # "batch_size 8, this loader's 16"
            raise ConfigError(f"the state's batches were grouped (bucket_by={mine['bucket_by']!r}) with "
                              f"{_budget(theirs)}, this loader's {ours}: batches grouped by shape or length "
                              "are an order of their size, and resume only with the batch size (or budget) that "
                              "saved them")
        raise ConfigError(f"the state was saved with {_grouping(theirs)}, this loader has {_grouping(mine)}: "
                          f"its order is another; {REBUILD}")


def _budget(buckets: dict) -> str:
    """What a grouped state's batches hold, for a message: 'batch_size 8', 'max_tokens 4096 (cost
    'quadratic'), batch_size 64'."""
    parts = [f"max_tokens {buckets['max_tokens']!r}" + (f" (cost {buckets['cost']!r})" if buckets.get("cost") not in
             (None, "linear") else "")] if buckets.get("max_tokens") is not None else []
    if buckets.get("batch_size") is not None or not parts:
        parts.append(f"batch_size {buckets.get('batch_size')!r}")
    return ", ".join(parts)


def _grouping(buckets) -> str:
    """Batches grouped by shape as the user asked for them (`bucket_by`), for a message."""
    if buckets is None:
        return "bucket_by=None"
    if isinstance(buckets, dict):
        return f"bucket_by={buckets.get('bucket_by')!r} of column {buckets.get('column')!r}"
    return f"buckets {buckets!r}"
