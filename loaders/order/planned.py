"""An epoch's batches planned by length (`LengthPlan`), and the epochs of a loader whose batches
are (`LengthEpochs`): the resume state, rank shares and passes of `loaders.order.sampler`, counted
in batches.

The epoch's order (a `Permutation`, or a mixture's stream) is cut into windows of WINDOW_SAMPLES
positions. Each window's samples are sorted by length and cut into batches (`lengths.cut`); the
windows' batches follow one another in window order, each window's own in the order
`lengths.layout` gives them. A window is a random sample of the dataset, so its batches are too;
sorting it whole puts samples of near lengths together (the more samples a window, the closer).
Nothing is of size N: a batch's ids need its window's (W ids and lengths, sorted), and where
each window starts in the epoch's batches needs each window's batch count: closed form for a
fixed batch size, a bincount of every window's lengths for a budget (the epoch's one pass over
the lengths, in windows: O(N) time spread over the cores' threads, O(N / W) memory, once per
epoch and process).

The global plan is dealt to ranks a batch each in turn (rank r takes batches cursor + j*W + r),
so it is the same plan for any rank count, and a state, whose cursor counts the batches all
ranks took, resumes on any. `deal`, the rank count the epoch started with, only orders each
window's batches so that a step's batches are of one length (`lengths.layout`): it is part of
the plan, kept in the state (as `slices`), and a state resumed on another rank count goes on
with the plan it began.
"""

from __future__ import annotations

import copy

import numpy as np

from packer.errors import ConfigError
from packer.system import available_cores

from loaders.order.lengths import EDGES, Budget, bounds, bucket_of, count, cut, fixed_count, layout
from loaders.order.orders import Permutation, derive_key, _mix
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
        self._starts: np.ndarray | None = None  # where each window's batches start in the epoch's, and the total
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
        x = _mix(windows + np.uint64(1))
        x ^= np.uint64(derive_key(self.seed, self.epoch, PHASE))
        return _mix(x)

    @property
    def starts(self) -> np.ndarray:
        """int64 [num_windows + 1]: where each window's batches start in the epoch's, then the total."""
        if self._starts is None:
            counts = self._counts()
            self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return self._starts

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def _counts(self) -> np.ndarray:
        """Each window's batch count: closed form for a fixed batch size; for a budget, each
        window's lengths bucketed and cut (`lengths.cut`, the function that cuts it when served)."""
        windows = np.arange(self.num_windows, dtype=np.int64)
        if self.budget.max_tokens is None:
            size = self.budget.batch_size
            carries = (self.phases(windows) % np.uint64(size)).astype(np.int64)
            return fixed_count(self.sizes(windows), carries, size)
        out = np.zeros(self.num_windows, np.int64)
        phases = self.phases(windows)

        def counted(w0: int, stop: int) -> None:
            positions = np.arange(w0 * self.window, min(stop * self.window, self.num_samples), dtype=np.int64)
            local = positions // self.window - w0
            held = np.bincount(local * len(EDGES) + bucket_of(self.lengths(self.ids_of(positions))),
                               minlength=(stop - w0) * len(EDGES)).reshape(stop - w0, len(EDGES))
            for i, row in enumerate(held):
                out[w0 + i] = count(cut(row, self.caps, self._carry(row, phases[w0 + i]), self.budget.span))
        first = min(COUNT_WINDOWS, self.num_windows)
        counted(0, first)  # in this thread: the order's and the lengths' tables made once, before any other reads them
        threads = min(available_cores(), COUNT_THREADS, self.num_windows - first)
        if threads <= 1:
            for w0 in range(first, self.num_windows, COUNT_WINDOWS):
                counted(w0, min(w0 + COUNT_WINDOWS, self.num_windows))
            return out
        # numpy's work here releases the GIL: the pass scales with the cores (it is the whole
        # start-up of a budget's epoch), a window a task to keep each thread's arrays small
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(threads, thread_name_prefix="mmpack-plan") as pool:
            list(pool.map(lambda w: counted(w, w + 1), range(first, self.num_windows)))
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
            batches, before = len(edges) - 1, int(self.starts[w])
            head = min(-before % self.deal, batches)
            groups = Permutation(max((batches - head) // self.deal, 1), order=self.order,
                                 seed=derive_key(self.seed, GROUPS, w), epoch=self.epoch)
            order = layout(np.arange(batches), batches=batches, before=before, deal=self.deal, groups=groups)
            held = self._held = (w, ids, lengths, edges, order)
        return held

    def _batch(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, lengths) of the epoch's g-th batch."""
        starts = self.starts
        w = int(np.searchsorted(starts, g, side="right")) - 1
        _, ids, lengths, edges, order = self.window_of(w)
        k = order[g - starts[w]]
        return ids[edges[k]:edges[k + 1]], lengths[edges[k]:edges[k + 1]]

    def batch(self, g: int) -> np.ndarray:
        """The ids of the epoch's g-th batch."""
        return self._batch(g)[0]

    def lengths_of_batch(self, g: int) -> np.ndarray:
        return self._batch(g)[1]


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
        """Batches each rank takes of epoch `epoch` from `cursor` (of the plan of `deal`)."""
        rest = max(self.plan(epoch, deal).total - cursor, 0)
        return rest // self.world_size if self.drop_last else -(-rest // self.world_size)

    def upcoming(self) -> Pass:
        epoch = self.epoch + 1 if self.partial and not self.resuming else self.epoch
        if self.next_cursor:
            return Pass(epoch, self.next_cursor, self.rank_batches(epoch, self.slices, self.next_cursor), self.slices)
        deal = self.fresh_slices()
        return Pass(epoch, 0, self.rank_batches(epoch, deal, 0), deal)

    def per_rank(self, cursor: int | None = None) -> int:
        """Batches (not samples: they hold a varying number) this rank takes of the next pass."""
        return self.upcoming().num_batches

    def num_batches(self) -> int:
        return self.upcoming().num_batches

    def batch_ids(self, p: Pass, b: int) -> np.ndarray:
        plan = self.plan(p.epoch, p.slices)
        g = p.cursor + b * self.world_size + self.rank
        if g >= plan.total:  # the last round made whole: the epoch's first batches again
            g = (g - plan.total) % max(plan.total, 1)
        return plan.batch(g)

    def first_repeat(self, p: Pass) -> int:
        """This rank's first batch of pass p that repeats one of the epoch (the last round made
        whole); p.num_batches where none does."""
        past = self.plan(p.epoch, p.slices).total - p.cursor - self.rank  # its batches before the epoch's end
        return min(max(-(-past // self.world_size), 0), p.num_batches)

    def dropped(self, p: Pass) -> int:
        """The epoch's batches no rank takes in pass p: with drop_last, the last round's, when short."""
        rest = max(self.plan(p.epoch, p.slices).total - p.cursor, 0)
        return rest % self.world_size if self.drop_last else 0

    def ids(self, p: Pass, first: int, stop: int) -> np.ndarray:
        """This rank's samples of batches [first, stop) of pass p, one after another."""
        parts = [self.batch_ids(p, b) for b in range(first, min(stop, p.num_batches))]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def ahead_of(self, p: Pass):
        this, after = self.twin(), self.twin()
        deal = self.fresh_slices()
        following = Pass(p.epoch + 1, 0, after.rank_batches(p.epoch + 1, deal, 0), deal)

        def ids(b: int) -> np.ndarray:
            return this.batch_ids(p, b) if b < p.num_batches else after.batch_ids(following, b - p.num_batches)
        return ids, p.num_batches + following.num_batches

    def twin(self) -> LengthEpochs:
        twin = super().twin()
        twin._plan = self._plan.fork() if self._plan is not None else None
        return twin

    def taken(self, p: Pass, batches: int) -> None:
        self.epoch = p.epoch
        self.cursor = min(p.cursor + batches * self.world_size, self.plan(p.epoch, p.slices).total)
        if batches >= p.num_batches:
            self.epoch, self.cursor, self.partial = p.epoch + 1, 0, False

    def load_state_dict(self, state: dict) -> None:
        before = (self.epoch, self.cursor, self.slices, self.resuming, self.partial, self.pinned)
        super().load_state_dict(state)
        total = self.plan(self.epoch, self.slices).total
        if self.cursor > total:
            cursor, epoch = self.cursor, self.epoch
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
