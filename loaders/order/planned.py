"""An epoch's batches planned by length (`LengthPlan`), and the epochs of a loader whose batches
are (`LengthEpochs`): the resume state, rank shares and passes of `loaders.order.sampler`, counted
in batches.

The epoch's order (a `Permutation`, or a mixture's stream) is cut into windows of WINDOW_SAMPLES
positions. Each window's samples are sorted by length and cut into batches (`lengths.cut`); the
windows' batches follow one another in window order, each window's own in the order
`lengths.layout` gives them. A window is a random sample of the dataset, so its batches are too;
sorting it whole puts samples of near lengths together (the more samples a window, the closer).
Nothing is of size N: a batch's ids need its window's (W ids and lengths, sorted), and where
each window starts in the epoch's batches needs the batch counts of the windows before it:
closed form for a fixed batch size, a bincount of each window's lengths for a budget. They are
counted as the pass reaches them (`LengthPlan.exists`): a pass's first batch needs its first
windows' counts, a resumed cursor the windows before it (counted at once, in threads), and only
the epoch's end, or len(), all of them (O(N) time spread over the pass, O(N / W) memory). So a
pass's batch count is known at its end (`Pass.num_batches` is None; `Epochs.has(p, b)` answers
whether batch b exists, as far as it takes): every rank computes the same plan, so every rank
still gets as many batches.

The global plan is dealt to ranks a batch each in turn (rank r takes batches cursor + j*W + r),
so it is the same plan for any rank count, and a state, whose cursor counts the batches all
ranks took, resumes on any. `deal`, the rank count the epoch started with, only orders each
window's batches so that a step's batches are of one length (`lengths.layout`): it is part of
the plan, kept in the state (as `slices`), and a state resumed on another rank count goes on
with the plan it began.
"""

from __future__ import annotations

import copy
import threading

import numpy as np

from packer.errors import ConfigError
from packer.system import available_cores

from loaders.order.lengths import EDGES, Budget, bounds, bucket_of, count, cut, fixed_count, layout
from loaders.order.orders import Permutation, derive_key, mix
from loaders.order.sampler import REBUILD, Epochs, Pass

WINDOW_SAMPLES = 1 << 16  # the samples sorted together: batches of 64 from 65,536 differ little in length
COUNT_WINDOWS = 4  # windows whose lengths are counted at once in the epoch's pass over them, in one thread
COUNT_THREADS = 16  # threads of that pass at most (each holds a window's arrays, about 4 MB)
PHASE, GROUPS = 0x504841, 0x475250  # the purposes that key each window's phase and the order of its groups


class LengthPlan:
    """Epoch `epoch`'s batches over `num_samples` positions, planned by length: `total` batches,
    `batch(g)` the ids of the g-th. `ids_of(positions)` gives the samples of positions of the
    epoch's order, `lengths(ids)` their lengths."""

    def __init__(self, num_samples: int, *, ids_of, lengths, budget: Budget, seed: int, epoch: int, order: str,
                 deal: int, window: int = WINDOW_SAMPLES):
        self.num_samples, self.ids_of, self.lengths, self.budget = num_samples, ids_of, lengths, budget
        self.seed, self.epoch, self.order, self.deal, self.window = seed, epoch, order, deal, window
        self.num_windows = -(-num_samples // window)
        self.caps = budget.capacities()
        self._counts = _Counted(self.num_windows)  # where each window's batches start: as far as counted
        self._held: tuple | None = None  # (window, its ids sorted by length, their lengths, its batches' bounds)

    def fork(self) -> LengthPlan:
        """The same plan with a window cache of its own (another thread's), its counts shared."""
        twin = copy.copy(self)
        twin._held = None
        return twin

    def sizes(self, windows: np.ndarray) -> np.ndarray:
        return np.minimum((windows + 1) * self.window, self.num_samples) - windows * self.window

    def phases(self, windows) -> np.ndarray:
        """uint64 per window: its phase (how many places its first batch holds fewer, modulo
        that batch's capacity), drawn from (seed, epoch, window); 0 in sequential order."""
        windows = np.asarray(windows, dtype=np.uint64)
        if self.order == "sequential":
            return np.zeros(len(windows), np.uint64)
        x = mix(windows + np.uint64(1))
        x ^= np.uint64(derive_key(self.seed, self.epoch, PHASE))
        return mix(x)

    @property
    def starts(self) -> np.ndarray:
        """int64 [num_windows + 1]: where each window's batches start in the epoch's, then the
        total; every window counted."""
        self.start_of(self.num_windows)
        return self._counts.starts

    @property
    def total(self) -> int:
        """The epoch's batches: every window counted (O(N) over the lengths, once)."""
        return self.start_of(self.num_windows)

    def start_of(self, w: int) -> int:
        """Where window w's batches start in the epoch's (w = num_windows: the total), the
        windows before it counted as far as they were not."""
        counts = self._counts
        if counts.counted < w:
            counts.extend(w, self._count)
        return int(counts.starts[w])

    def exists(self, g: int) -> bool:
        """Whether the epoch has a g-th batch, windows counted only as far as it takes."""
        counts = self._counts
        while True:
            c = counts.counted
            before = int(counts.starts[c])
            if g < before:
                return True
            if c == self.num_windows:
                return False
            # the windows g is likely in, from the batches a window made so far: a resumed
            # cursor's many windows counted at once, in threads; the next one's a few at a time
            need = (g - before) * c // max(before, 1) + 1 if c else 1
            counts.extend(min(c + max(need, COUNT_WINDOWS), self.num_windows), self._count)

    def _count(self, w0: int, stop: int) -> np.ndarray:
        """The batch counts of windows [w0, stop): each window's lengths bucketed and cut
        (`lengths.cut`, the function that cuts it when served); closed form for a fixed batch
        size. Many windows are counted in threads (numpy's work here releases the GIL)."""
        windows = np.arange(w0, stop, dtype=np.int64)
        if self.budget.max_tokens is None:
            size = self.budget.batch_size
            carries = (self.phases(windows) % np.uint64(size)).astype(np.int64)
            return fixed_count(self.sizes(windows), carries, size)
        out = np.zeros(stop - w0, np.int64)
        phases = self.phases(windows)

        def counted(a: int, b: int) -> None:
            positions = np.arange(a * self.window, min(b * self.window, self.num_samples), dtype=np.int64)
            local = positions // self.window - a
            held = np.bincount(local * len(EDGES) + bucket_of(self.lengths(self.ids_of(positions))),
                               minlength=(b - a) * len(EDGES)).reshape(b - a, len(EDGES))
            for i, row in enumerate(held):
                out[a - w0 + i] = count(cut(row, self.caps, self._carry(row, phases[a - w0 + i]), self.budget.span))
        first = w0 + (min(COUNT_WINDOWS, stop - w0) if w0 == 0 else 0)
        if first > w0:  # in this thread: the order's and the lengths' tables made once, before any other reads them
            counted(w0, first)
        threads = min(available_cores(), COUNT_THREADS, stop - first)
        if threads <= 1 or stop - first <= COUNT_WINDOWS:
            for a in range(first, stop, COUNT_WINDOWS):
                counted(a, min(a + COUNT_WINDOWS, stop))
            return out
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads, thread_name_prefix="mmpack-plan") as pool:
            list(pool.map(lambda a: counted(a, a + 1), range(first, stop)))
        return out

    def _carry(self, counts: np.ndarray, phase) -> int:
        """The places a window's first batch holds fewer: its phase modulo the capacity of the
        bucket of its shortest sample."""
        first = np.flatnonzero(counts)
        return int(np.uint64(phase) % np.uint64(self.caps[first[0]])) if len(first) else 0

    def window_of(self, w: int) -> tuple:
        """(w, its ids sorted by length (ties in the order's), their lengths, its batches' bounds
        in them, the sorted batch each of its batches in their order is (`lengths.layout`))."""
        held = self._held  # read once: another thread may hold the plan (a local, never another's window)
        if held is None or held[0] != w:
            positions = np.arange(w * self.window, min((w + 1) * self.window, self.num_samples), dtype=np.int64)
            ids = self.ids_of(positions)
            lengths = np.asarray(self.lengths(ids), dtype=np.int64)
            by_length = np.argsort(lengths, kind="stable")
            ids, lengths = ids[by_length], lengths[by_length]
            counts = np.bincount(bucket_of(lengths), minlength=len(EDGES))
            edges = bounds(cut(counts, self.caps, self._carry(counts, self.phases([w])[0]), self.budget.span))
            batches, before = len(edges) - 1, self.start_of(w)
            head = min(-before % self.deal, batches)
            groups = Permutation(max((batches - head) // self.deal, 1), order=self.order,
                                 seed=derive_key(self.seed, GROUPS, w), epoch=self.epoch)
            order = layout(np.arange(batches), batches=batches, before=before, deal=self.deal, groups=groups)
            held = self._held = (w, ids, lengths, edges, order)
        return held

    def _batch(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, lengths) of the epoch's g-th batch."""
        if not self.exists(g):
            raise IndexError(f"batch {g} of an epoch of {self.total}")
        counts = self._counts
        w = int(np.searchsorted(counts.starts[:counts.counted + 1], g, side="right")) - 1
        _, ids, lengths, edges, order = self.window_of(w)
        k = order[g - int(counts.starts[w])]
        return ids[edges[k]:edges[k + 1]], lengths[edges[k]:edges[k + 1]]

    def batch(self, g: int) -> np.ndarray:
        """The ids of the epoch's g-th batch."""
        return self._batch(g)[0]

    def lengths_of_batch(self, g: int) -> np.ndarray:
        return self._batch(g)[1]


class _Counted:
    """Where each window's batches start in the epoch's, for the windows counted so far (a
    prefix): shared by a plan's forks (the threads reading it), extended under a lock."""

    def __init__(self, num_windows: int):
        self.starts = np.zeros(num_windows + 1, np.int64)
        self.counted = 0  # windows [0, counted) counted: starts[:counted + 1] known
        self._lock = threading.Lock()

    def extend(self, stop: int, count) -> None:
        """Windows [counted, stop) counted by `count(w0, stop)` -> their batch counts."""
        with self._lock:
            c = self.counted
            if c >= stop:
                return
            self.starts[c + 1:stop + 1] = self.starts[c] + np.cumsum(count(c, stop))
            self.counted = stop  # after the starts it covers: a reader without the lock sees them whole


class LengthEpochs(Epochs):
    """`Epochs` whose batches are planned by length (`LengthPlan`): the cursor counts the
    epoch's batches all ranks took, and rank r takes batches cursor + j*W + r; past the epoch's
    end the last round is made whole by repeating its first batches, as DistributedSampler
    does (drop_last=True drops that round instead), so every rank gets as many batches.

    `positions_of(order, seed, epoch)` gives an epoch's positions -> ids (a `Permutation`, or a
    mixture's stream); `lengths(ids)` the lengths of the column `column` bucketed by."""

    def __init__(self, num_samples: int, budget: Budget, *, positions_of, lengths, bucket_by: str, column: str,
                 window: int = WINDOW_SAMPLES, **kwargs):
        self.budget = budget
        super().__init__(num_samples, budget.most(), **kwargs)
        self.positions_of, self.lengths, self.column, self.window = positions_of, lengths, column, window
        self.buckets = {"bucket_by": bucket_by, "column": column, **budget.describe(), "window": window}
        self.padding = None  # what a loader counts of the batches it hands over (`loaders.padding`)
        self._plan: LengthPlan | None = None

    def most_per_batch(self) -> int:
        """The most samples a batch holds: what a ring's buffers are made for (the dataset's
        shortest sample read once, from its lengths, where a budget sets the number)."""
        if self.budget.max_tokens is None:
            return self.budget.batch_size
        shortest = getattr(self.lengths, "shortest", None)
        return self.budget.most(shortest() if shortest else 1)

    def plan(self, epoch: int, deal: int) -> LengthPlan:
        plan = self._plan
        if plan is None or (plan.epoch, plan.deal) != (epoch, deal):
            ids_of = self.positions_of(order=self.order, seed=self.seed, epoch=epoch)
            plan = self._plan = LengthPlan(self.num_samples, ids_of=ids_of, lengths=self.lengths, budget=self.budget,
                                           seed=self.seed, epoch=epoch, order=self.order, deal=deal, window=self.window)
        return plan

    def __getstate__(self) -> dict:
        """Without the plan (a window's ids and lengths): a spawned DataLoader worker makes its own."""
        return {**self.__dict__, "_plan": None}

    def rank_batches(self, epoch: int, deal: int, cursor: int) -> int:
        """Batches each rank takes of epoch `epoch` from `cursor` (of the plan of `deal`): the
        epoch's plan counted whole."""
        rest = max(self.plan(epoch, deal).total - cursor, 0)
        return rest // self.world_size if self.drop_last else -(-rest // self.world_size)

    def known_count(self, cursor: int) -> None:
        """None: a pass's batch count is left to the plan, which counts its windows as they are
        reached (a pass's first batch needs its first window's, not the N lengths' pass a count of
        the epoch is)."""
        return None

    def per_rank(self, cursor: int | None = None) -> int:
        """Batches (not samples: they hold a varying number) this rank takes of the next pass."""
        return self.count(self.upcoming())

    def has(self, p: Pass, b: int) -> bool:
        """Every rank has as many batches: b while rank 0's b-th is in the epoch (a round made
        whole past its end), or with drop_last while the round's last is."""
        last = p.cursor + (b + 1) * self.world_size - 1 if self.drop_last else p.cursor + b * self.world_size
        return b >= 0 and self.plan(p.epoch, p.slices).exists(last)

    def count(self, p: Pass) -> int:
        return self.rank_batches(p.epoch, p.slices, p.cursor)

    def batch_ids(self, p: Pass, b: int) -> np.ndarray:
        plan = self.plan(p.epoch, p.slices)
        g = p.cursor + b * self.world_size + self.rank
        if not plan.exists(g):  # the last round made whole: the epoch's first batches again
            g = (g - plan.total) % max(plan.total, 1)
        return plan.batch(g)

    def repeats(self, p: Pass, b: int) -> bool:
        """Whether this rank's batch b of pass p repeats one of the epoch (the last round made whole)."""
        return not self.plan(p.epoch, p.slices).exists(p.cursor + b * self.world_size + self.rank)

    def dropped(self, p: Pass) -> int:
        """The epoch's batches no rank takes in pass p: with drop_last, the last round's, when short."""
        rest = max(self.plan(p.epoch, p.slices).total - p.cursor, 0)
        return rest % self.world_size if self.drop_last else 0

    def ids(self, p: Pass, first: int, stop: int) -> np.ndarray:
        """This rank's samples of batches [first, stop) of pass p, one after another."""
        parts = [self.batch_ids(p, b) for b in range(first, stop) if self.has(p, b)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def twin(self) -> LengthEpochs:
        twin = super().twin()
        twin._plan = self._plan.fork() if self._plan is not None else None
        return twin

    def taken(self, p: Pass, batches: int) -> None:
        self.epoch = p.epoch
        self.cursor = p.cursor + batches * self.world_size  # within the epoch while the pass has a next batch
        if not self.has(p, batches):
            self.epoch, self.cursor, self.partial = p.epoch + 1, 0, False

    def load_state_dict(self, state: dict) -> None:
        before = (self.epoch, self.cursor, self.slices, self.resuming, self.partial, self.pinned)
        super().load_state_dict(state)
        plan = self.plan(self.epoch, self.slices)
        if self.cursor and not plan.exists(self.cursor - 1):  # windows counted up to the cursor's, no further
            cursor, epoch, total = self.cursor, self.epoch, plan.total
            self.epoch, self.cursor, self.slices, self.resuming, self.partial, self.pinned = before
            raise ConfigError(f"the state's cursor {cursor} is past the {total} batches of its epoch {epoch}: "
                              f"{REBUILD}")


class DatasetOrder:
    """`LengthEpochs.positions_of` over one dataset: each epoch's `Permutation` (a class, not a
    closure: it goes to spawned DataLoader workers with the epochs)."""

    def __init__(self, num_samples: int, window: int):
        self.num_samples, self.window = num_samples, window

    def __call__(self, *, order: str, seed: int, epoch: int) -> Permutation:
        return Permutation(self.num_samples, order=order, seed=seed, epoch=epoch, window=self.window)
