"""Batches planned by length (`bucket_by="length"`, `max_tokens`, `max_seconds`): the plan as pure
functions of integers (any lengths, budgets, world sizes, seeds: every epoch a permutation cut
into batches within their budget, as many on every rank, a resume at any cursor the uninterrupted
run's rest, on any world size), and the loaders from the user's side (resume in a fresh process:
tests/contract.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders import Loader, Mixture, MMapDataset, StatefulDataLoader, AudioClips, TokenWindows
from loaders.order.lengths import EDGES, Budget, bounds, bucket_of, count, cut, fixed_count, layout
from loaders.order.orders import Permutation
from loaders.order.planned import DatasetOrder, LengthEpochs
from packer.errors import ConfigError

budgets = st.one_of(
    st.builds(Budget, batch_size=st.integers(1, 40)),
    st.builds(Budget, batch_size=st.one_of(st.none(), st.integers(1, 40)), max_tokens=st.integers(1, 3000),
              cost=st.sampled_from(["linear", "quadratic"])))
lengths_lists = st.lists(st.one_of(st.integers(0, 300), st.integers(0, 10**6)), min_size=1, max_size=400)


def _epochs(lengths, budget, *, world=1, rank=0, seed=0, drop_last=False, window=64, order=None):
    lengths = np.asarray(lengths, np.int64)
    return LengthEpochs(len(lengths), budget, positions_of=DatasetOrder(len(lengths), 8192), lengths=lambda ids: lengths[ids],
                        bucket_by="length", column="tokens", window=window, shuffle=True, order=order, seed=seed,
                        drop_last=drop_last, rank=rank, world_size=world, source="s")


def _within(budget: Budget, lengths: np.ndarray) -> bool:
    """A batch within its budget, or a single sample over it."""
    if budget.batch_size is not None and len(lengths) > budget.batch_size:
        return False
    if budget.max_tokens is None or len(lengths) == 1:
        return True
    return len(lengths) * float(budget.cost_of([lengths.max()])[0]) <= budget.max_tokens


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 50), min_size=1, max_size=40), budget=budgets, carry=st.integers(0, 100))
def test_a_window_is_cut_into_batches_within_their_budget_from_its_bucket_counts(counts, budget, carry):
    counts = np.asarray(counts + [0] * (len(EDGES) - len(counts)), np.int64)
    caps = budget.capacities()
    first = np.flatnonzero(counts)
    carry = carry % int(caps[first[0]]) if len(first) else 0
    edges = bounds(cut(counts, caps, carry, budget.span))
    assert edges[0] == 0 and edges[-1] == counts.sum() and (np.diff(edges) > 0).all()
    assert len(edges) - 1 == count(cut(counts, caps, carry, budget.span))
    bucket = np.repeat(np.arange(len(EDGES)), counts)
    longest = EDGES[bucket]  # each sorted sample at its bucket's longest
    for a, b in zip(edges[:-1], edges[1:]):
        assert _within(budget, longest[a:b])
        assert budget.span is None or bucket[b - 1] - bucket[a] < budget.span  # a budget's batch: one length
    if budget.max_tokens is None:  # a fixed size: the count in closed form
        assert len(edges) - 1 == fixed_count(np.array([counts.sum()]), np.array([carry]), budget.batch_size)[0]
        assert (np.diff(edges)[1:-1] == budget.batch_size).all()


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(0, 3 << 20), st.integers(0, 1 << 62)), max_size=50))
def test_a_lengths_bucket_is_the_first_edge_at_or_above_it(lengths):
    assert bucket_of(lengths).tolist() == np.searchsorted(EDGES, np.asarray(lengths, np.int64), side="left").tolist()
    assert (EDGES[bucket_of(lengths)] >= np.asarray(lengths, np.int64)).all()


@settings(max_examples=200, deadline=None)
@given(batches=st.integers(0, 300), before=st.integers(0, 1000), deal=st.integers(1, 9), seed=st.integers(0, 99))
def test_a_windows_batches_are_dealt_a_permutation_in_steps_of_one_length(batches, before, deal, seed):
    """Each step of `deal` batches that lies in the window holds consecutive sorted batches, and
    the steps begun by the window before and ended by the next hold the window's shortest."""
    groups = Permutation(max((batches - min(-before % deal, batches)) // deal, 1), order="random", seed=seed, epoch=0)
    got = layout(np.arange(batches), batches=batches, before=before, deal=deal, groups=groups)
    assert sorted(got.tolist()) == list(range(batches))
    head = min(-before % deal, batches)
    whole = (batches - head) // deal
    for q in range(whole):
        step = got[head + q * deal: head + (q + 1) * deal]
        assert step.max() - step.min() == deal - 1
    edge = np.concatenate([got[:head], got[head + whole * deal:]])
    assert sorted(edge.tolist()) == list(range(len(edge)))


def _run(epochs, epoch_batches=None):
    """Every batch of the next pass, as lists of ids."""
    p = epochs.start()
    out = [epochs.batch_ids(p, b).tolist() for b in epochs.batches(p)]
    assert len(out) == epochs.count(p)
    epochs.taken(p, len(out))
    return out


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 5000), min_size=100, max_size=1500), max_tokens=st.integers(1, 20000),
       seed=st.integers(0, 2**32))
def test_a_budgets_counts_made_in_threads_are_the_counts_of_one_thread(lengths, max_tokens, seed):
    """The epoch's pass over the lengths (each window's batch count) runs in threads past its
    first windows: the same counts as in one thread, and the plan they start is served whole."""
    from loaders.order import planned

    lengths = np.asarray(lengths, np.int64)
    plans = []
    for threads in (planned.COUNT_THREADS, 1):
        saved = planned.COUNT_THREADS
        planned.COUNT_THREADS = threads
        try:
            plan = _epochs(lengths, Budget(max_tokens=max_tokens), seed=seed, window=16).plan(0, 1)
            plans.append(plan.starts.tolist())
        finally:
            planned.COUNT_THREADS = saved
    assert plans[0] == plans[1] and len(plans[0]) > 6  # windows past the first four: threads counted them
    served = sorted(i for g in range(plan.total) for i in plan.batch(g).tolist())
    assert served == list(range(len(lengths)))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 5000), min_size=80, max_size=1500), max_tokens=st.integers(1, 20000),
       seed=st.integers(0, 2**32), data=st.data())
def test_a_plan_counts_its_windows_only_as_far_as_its_batches_are_asked_for(lengths, max_tokens, seed, data):
    """The first batch needs the first windows' counts, not the epoch's; any batch asked for in
    any order (a resumed cursor's, a worker's) is the one of the plan counted whole."""
    from loaders.order import planned

    lengths = np.asarray(lengths, np.int64)
    whole = _epochs(lengths, Budget(max_tokens=max_tokens), seed=seed, window=16).plan(0, 1)
    batches = [whole.batch(g).tolist() for g in range(whole.total)]
    lazy = _epochs(lengths, Budget(max_tokens=max_tokens), seed=seed, window=16).plan(0, 1)
    assert lazy.exists(0) and lazy.batch(0).tolist() == batches[0]
    assert lazy._counts.counted <= planned.COUNT_WINDOWS < lazy.num_windows  # 80 lengths or more: 5 windows or more
    for g in data.draw(st.lists(st.integers(0, len(batches) + 3), max_size=12)):
        assert lazy.exists(g) == (g < len(batches))
        if g < len(batches):
            assert lazy.batch(g).tolist() == batches[g]
    assert lazy.starts.tolist() == whole.starts.tolist()


def test_a_pass_by_a_budget_starts_and_checkpoints_without_counting_its_epoch():
    """What a loop does with the first batch of a pass (start, has, the ids, taken, a state)
    counts the first windows only; len() counts them all."""
    from loaders.order import planned

    lengths = np.random.default_rng(0).integers(1, 3000, 20000)
    for world, drop_last in ((1, False), (3, True)):
        epochs = _epochs(lengths, Budget(max_tokens=6000), window=16, world=world, drop_last=drop_last)
        p = epochs.start()
        first = [epochs.batch_ids(p, b) for b in itertools.islice(epochs.batches(p), 2)]
        epochs.taken(p, 2)
        state = epochs.state_dict()
        plan = epochs.plan(0, world)
        assert len(first) == 2 and plan._counts.counted <= 2 * planned.COUNT_WINDOWS < plan.num_windows
        assert state["cursor"] == 2 * world and epochs.count(p) == len(list(epochs.batches(p))) > 100
        assert plan._counts.counted == plan.num_windows


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_lists, budget=budgets, world=st.integers(1, 5), seed=st.integers(0, 2**32),
       drop_last=st.booleans())
def test_every_epoch_is_a_permutation_cut_in_batches_within_budget_and_as_many_on_every_rank(
        lengths, budget, world, seed, drop_last):
    lengths = np.asarray(lengths, np.int64)
    for epoch in range(2):
        ranks = []
        for r in range(world):
            epochs = _epochs(lengths, budget, world=world, rank=r, seed=seed, drop_last=drop_last)
            epochs.set_epoch(epoch)
            ranks.append(_run(epochs))
        assert len({len(batches) for batches in ranks}) == 1  # as many batches on every rank: no rank hangs DDP
        plan = epochs.plan(epoch, world)
        whole = [plan.batch(g).tolist() for g in range(plan.total)]
        assert sorted(i for b in whole for i in b) == list(range(len(lengths)))  # each sample once
        for batch in whole:
            assert batch and _within(budget, lengths[batch])
        dealt = [b for step in zip(*ranks) for b in step]  # rank r's j-th is the plan's j*W + r
        if drop_last:
            assert dealt == whole[:len(dealt)] and len(whole) - len(dealt) < world
        else:
            repeats = [whole[i % len(whole)] for i in range(len(dealt) - len(whole))]  # DistributedSampler's
            assert dealt[:len(whole)] == whole and dealt[len(whole):] == repeats and len(repeats) < world


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_lists, budget=budgets, w1=st.integers(1, 4), w2=st.integers(1, 4), at=st.floats(0, 1),
       seed=st.integers(0, 2**32))
def test_a_resume_at_any_cursor_goes_on_with_the_plan_on_any_world_size(lengths, budget, w1, w2, at, seed):
    """Some steps on w1 ranks (a share `at` of the epoch's, short of its end), a state (the same
    on every rank), then w2 ranks from it in fresh epochs: the batches that follow are the
    uninterrupted plan's rest, each once."""
    whole = None
    states, heads = [], []
    for r in range(w1):
        epochs = _epochs(lengths, budget, world=w1, rank=r, seed=seed)
        p = epochs.start()
        take = min(int(at * epochs.count(p)), max(epochs.count(p) - 1, 0))
        heads.append([epochs.batch_ids(p, b).tolist() for b in range(take)])
        epochs.taken(p, take)
        states.append(epochs.state_dict())
        plan = epochs.plan(0, w1)
        whole = [plan.batch(g).tolist() for g in range(plan.total)]
    assert all(s == states[0] for s in states)
    state = states[0]
    if state["epoch"] == 1:
        return
    taken = [b for step in zip(*heads) for b in step]
    assert taken == whole[:len(taken)] and state["cursor"] == len(taken)  # the state is where the ranks stopped
    rest = []
    for r in range(w2):
        epochs = _epochs(lengths, budget, world=w2, rank=r, seed=seed)
        epochs.load_state_dict(state)
        rest.append(_run(epochs))
    assert len({len(batches) for batches in rest}) == 1
    dealt = [b for step in zip(*rest) for b in step]
    if state["cursor"] == 0:  # nothing taken: the epoch starts afresh, its plan dealt for the ranks there are
        plan = epochs.plan(0, w2)
        whole = [plan.batch(g).tolist() for g in range(plan.total)]
    tail = whole[state["cursor"]:]
    assert dealt[:len(tail)] == tail and len(dealt) - len(tail) < w2


def test_an_epoch_of_a_billion_samples_opens_and_gives_its_first_batch_from_one_window():
    """A fixed batch size: the epoch's batch count is closed form and batch 0 needs window 0
    alone, whatever N (a budget's count is the epoch's pass over the lengths: bench sampler)."""
    n = 10**9

    def lengths(ids):  # a length per id, never an array of N
        return (np.asarray(ids) * 2654435761 % 1000 + 1).astype(np.int64)

    epochs = LengthEpochs(n, Budget(batch_size=256), positions_of=DatasetOrder(n, 8192), lengths=lengths,
                          bucket_by="length", column="tokens", shuffle=True, order=None, seed=1, drop_last=False,
                          rank=3, world_size=8, source="s")
    p = epochs.start()
    assert abs(epochs.count(p) - n / 256 / 8) < n / 65536  # within a batch a window of N / (256 x 8)
    ids = epochs.batch_ids(p, 0)
    assert len(set(ids.tolist())) == len(ids) and len(ids) <= 256 and ids.max() > n // 100
    assert np.ptp(lengths(ids)) <= 10  # of about one length: 65,536 lengths of 1,000 values sorted


def test_the_plan_is_a_pure_function_of_seed_epoch_and_budget():
    lengths = np.random.default_rng(0).lognormal(4, 1, 5000).astype(np.int64)
    runs = [_run(_epochs(lengths, Budget(max_tokens=2000), seed=s, window=1024)) for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]
    one = _epochs(lengths, Budget(max_tokens=2000), seed=1, window=1024)
    one.set_epoch(1)
    assert _run(one) != runs[0]  # another epoch, another plan
    # sequential order: windows of consecutive ids, each's batches shortest first
    seq = _epochs(lengths, Budget(batch_size=50), order="sequential", window=1024)
    first = [lengths[b].max() for b in _run(seq)[:20]]
    assert first == sorted(first)


def _epoch_keys(loader, key: str = "key"):
    return [k for batch in loader for k in batch[key]]


def test_loader_bucket_by_length_takes_each_clip_once_in_batches_of_one_length(built):
    ds = MMapDataset(built["audio"], columns=["audio", "key"])
    random = Loader(ds, 4, seed=3)
    keys = _epoch_keys(random)
    bucketed = Loader(ds, 4, seed=3, bucket_by="length")
    first, second = _epoch_keys(bucketed), _epoch_keys(bucketed)
    assert sorted(first) == sorted(second) == sorted(keys) and len(set(first)) == len(first)
    assert first != second  # another order every epoch
    # real recordings of 0.2 to 10 s: a fifth of random batches' padding (measured: 11% against 53%)
    assert bucketed.padding.epochs[1]["share"] < random.padding.epochs[0]["share"] / 4
    batch = next(iter(Loader(ds, 4, seed=3, bucket_by="length:audio")))
    assert batch["audio"].shape[1] == int(batch["audio_lengths"].max())
    assert Loader(ds, 4, seed=3, bucket_by="length:audio").padding.column == "audio"


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_last_rounds_batches_repeated_or_dropped_are_counted(built, drop_last):
    ds = MMapDataset(built["audio"], columns=["audio", "key"])
    total = len(Loader(ds, 4, seed=3, bucket_by="length"))  # the plan's, on one rank
    world = next(w for w in (5, 6, 7) if total % w)  # a last round short: the last rank repeats, or it is dropped
    loader = Loader(ds, 4, seed=3, bucket_by="length", rank=world - 1, world_size=world, drop_last=drop_last)
    taken = sum(1 for _ in loader)
    own = len(range(world - 1, total, world))  # the plan's batches this rank is dealt
    figures = loader.padding.epochs[0]
    assert taken == (total // world if drop_last else -(-total // world))
    repeats = 0 if drop_last else taken - own
    assert figures["repeated_batches"] == repeats and (drop_last or repeats == 1)
    assert figures["dropped_batches"] == (total % world if drop_last else 0)


def test_a_budgets_batches_are_the_same_whether_or_not_len_counted_the_epoch_first(built):
    """From the user's side, on the real clips: a loop that never asks len() gets the batches, and
    the count, of one that asks it first; and so do StatefulDataLoader's workers, each counting
    the plan as they reach it."""
    ds = MMapDataset(built["audio"], columns=["audio", "key"])

    def keys(loader):
        return [list(batch["key"]) for batch in loader]
    counted = Loader(ds, max_seconds=0.5, seed=2)
    total = len(counted)
    want = keys(counted)
    assert len(want) == total > 1
    assert keys(Loader(ds, max_seconds=0.5, seed=2)) == want  # no len() first
    workers = StatefulDataLoader(ds.batched(max_seconds=0.5, seed=2), num_workers=2)
    assert keys(workers) == want


def test_max_tokens_batches_hold_what_fits_the_budget_and_count_the_samples_over_it(built):
    captions = MMapDataset(built["pairs"], columns=["tokens", "key"])
    loader = Loader(captions, max_tokens=96, seed=1)
    sizes, keys = [], []
    for batch in loader:
        n, width = batch["tokens"].shape
        assert width == int(batch["tokens_lengths"].max()) and n * width <= 96
        sizes.append(n)
        keys += batch["key"]
    assert sorted(keys) == sorted(_epoch_keys(Loader(captions, 64, shuffle=False)))  # each caption once
    assert max(sizes) >= 2 * min(sizes)  # short captions in big batches, long ones in small
    figures = loader.padding.epochs[0]
    assert figures["padded"] <= 96 * figures["batches"] and figures["share"] < 0.1
    docs = MMapDataset(built["text"], columns=["tokens", "key"])  # the stdlib's sources: many over 2,048 tokens
    loader = Loader(docs, max_tokens=2048, seed=1)
    over = sum(1 for b in loader if len(b["key"]) == 1 and int(b["tokens_lengths"][0]) > 2048)
    assert loader.padding.epochs[0]["over_budget"] == over > 0


def test_max_seconds_batches_whole_clips_and_stateful_workers_make_the_same_batches(built):
    ds = MMapDataset(built["audio"], columns=["audio", "key"])
    loader = Loader(ds, max_seconds=6.0, seed=2, num_threads=1)
    mine = [(b["key"], tuple(b["audio"].shape)) for b in loader]
    assert all(n * width <= 6 * 16000 or n == 1 for _, (n, width) in mine)
    stateful = StatefulDataLoader(ds.batched(max_seconds=6.0, seed=2), num_workers=2)
    assert [(b["key"], tuple(b["audio"].shape)) for b in stateful] == mine
    assert stateful.padding.epochs[0]["padded"] == loader.padding.epochs[0]["padded"]
    import pickle  # a spawned worker (macOS's, Windows') gets the epochs pickled, the plan made again there

    batched = ds.batched(max_seconds=6.0, seed=2)
    next(iter(batched))  # its plan made (a pass left early: the next one is epoch 1's, unless told)
    again = pickle.loads(pickle.dumps(batched))
    again.set_epoch(0)
    assert [(b["key"], tuple(b["audio"].shape)) for b in again] == mine


def test_a_mixture_of_datasets_sharing_the_column_is_planned_by_length(built):
    from collections import Counter

    mixture = Mixture([MMapDataset(built[k], columns=["tokens", "key"]) for k in ("text", "pairs")], [2, 1])
    loader = Loader(mixture, max_tokens=2048, seed=4)
    batches = list(loader)
    stream = Counter(k for b in Loader(mixture, 64, seed=4) for k in b["key"])  # the epoch's samples by weight
    assert Counter(k for b in batches for k in b["key"]) == stream and sum(stream.values()) == len(mixture)
    assert all(b["tokens"].shape[0] * b["tokens"].shape[1] <= 2048 or len(b["key"]) == 1 for b in batches)
    assert loader.padding.epochs[0]["share"] < 0.1


def test_what_planning_by_length_refuses(built):
    with pytest.raises(ConfigError, match="ragged"):
        Loader(MMapDataset(built["images"]), 8, bucket_by="length")
    with pytest.raises(ConfigError, match="one length"):
        Loader(TokenWindows(built["text"], 64), max_tokens=512)
    with pytest.raises(ConfigError, match="one length"):
        Loader(AudioClips(built["audio"], 0.5), 8, bucket_by="length")
    with pytest.raises(ConfigError, match="length:nope"):
        Loader(MMapDataset(built["text"]), 8, bucket_by="length:nope")
    with pytest.raises(ConfigError, match="audio"):
        Loader(MMapDataset(built["text"]), max_seconds=2.0)
    with pytest.raises(ConfigError, match="not both"):
        Loader(MMapDataset(built["audio"]), max_seconds=2.0, max_tokens=100)
    with pytest.raises(ConfigError, match="weighs a budget"):
        Loader(MMapDataset(built["text"]), 8, cost="quadratic")
    with pytest.raises(ConfigError, match="batch_size, or a budget"):
        Loader(MMapDataset(built["text"]))
    with pytest.raises(ConfigError, match="'length', 'length:COLUMN' or None"):
        Loader(MMapDataset(built["text"]), max_tokens=100, bucket_by="aspect")


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12), steps=st.sampled_from([1, 2]), data=st.data())
def test_lengths_come_from_the_index_offsets_of_each_samples_shard(sizes, steps, data):
    """`RaggedLengths`: a sample's length is its offsets' difference in its own shard (frames, for
    stereo audio), however the shards are sized."""
    import types

    from loaders.source import RaggedLengths
    from packer.dataset import format as fmt

    lengths = [np.asarray(data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)), np.int64) for n in sizes]
    offsets = [np.concatenate([[0], np.cumsum(x * steps)]) for x in lengths]
    reader = types.SimpleNamespace(
        shard_ends=np.cumsum(sizes).tolist(),
        manifest=types.SimpleNamespace(column=lambda name: fmt.Column(name, "<i2", (None,) if steps == 1 else (None, 2))),
        index=lambda k, name: types.SimpleNamespace(offsets=offsets[k]))
    every = np.concatenate(lengths)
    ids = np.asarray(data.draw(st.lists(st.integers(0, len(every) - 1), max_size=60)), np.int64)
    assert RaggedLengths([reader], "audio")(ids).tolist() == every[ids].tolist()
