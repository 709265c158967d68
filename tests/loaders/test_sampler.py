"""Orders are permutations, deterministic in (seed, epoch), O(1) in memory whatever N, and as
uniform as numpy's; rank shares are equal-sized and cover the epoch; resume from any cursor,
with any world size, covers the rest once; a state loads only into the loader it came from."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders.order.orders import Permutation, epoch_order
from loaders.order.sampler import Epochs, Pass, resolve_topology, sliced
from packer.errors import ConfigError

orders = st.sampled_from(["random", "sequential", "block"])


@settings(max_examples=120, deadline=None)
@given(n=st.integers(0, 3000), order=orders, seed=st.integers(0, 2**63), epoch=st.integers(0, 10**6),
       block=st.integers(1, 300), window=st.integers(1, 900))
def test_orders_are_deterministic_permutations(n, order, seed, epoch, block, window):
    a = epoch_order(n, order=order, seed=seed, epoch=epoch, block_size=block, window=window)
    b = epoch_order(n, order=order, seed=seed, epoch=epoch, block_size=block, window=window)
    assert np.array_equal(a, b) and np.array_equal(np.sort(a), np.arange(n))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), order=orders, data=st.data())
def test_any_positions_give_the_ids_of_the_whole_order(n, order, data):
    """A batch's ids computed from its positions alone equal that part of the whole order."""
    whole = epoch_order(n, order=order, seed=4, epoch=2, block_size=17, window=100)
    positions = np.asarray(data.draw(st.lists(st.integers(0, n - 1), max_size=50)), dtype=np.int64)
    perm = Permutation(n, order=order, seed=4, epoch=2, block_size=17, window=100)
    assert np.array_equal(perm(positions), whole[positions])


def test_epochs_and_seeds_change_the_random_order():
    a = epoch_order(1000, order="random", seed=0, epoch=0)
    assert not np.array_equal(a, epoch_order(1000, order="random", seed=0, epoch=1))
    assert not np.array_equal(a, epoch_order(1000, order="random", seed=1, epoch=0))


def test_an_order_over_ten_billion_samples_is_computed_per_position():
    """Nothing of size N is made: the first batch of an epoch over 10^10 (or 10^15) samples."""
    for n in (10**10, 10**15):
        perm = Permutation(n, order="random", seed=1, epoch=3)
        ids = perm(np.arange(256))
        assert len(set(ids.tolist())) == 256 and ids.min() >= 0 and ids.max() < n
        assert ids.max() > n // 2  # spread over the whole range, not the first ids
        plan = Epochs(n, 256, shuffle=True, order=None, seed=1, drop_last=False, rank=1, world_size=8)
        assert plan.num_batches() == -(-(-(-n // 8)) // 256)
        assert len(plan.batch_ids(plan.start(), 12345)) == 256
    block = Permutation(10**10, order="block", seed=0, epoch=0)(np.arange(8192))
    assert len(np.unique(block // 1024)) <= 9  # one window of reads: a few blocks


def test_block_order_stays_local():
    ids = epoch_order(100_000, order="block", seed=3, epoch=0, block_size=1000, window=4000)
    # every window of 4000 consecutive reads touches at most 4-5 blocks of 1000 ids
    blocks = [len(np.unique(ids[i:i + 4000] // 1000)) for i in range(0, 100_000, 4000)]
    assert max(blocks) <= 5
    # and every block of ids is read in a few windows, not scattered over the epoch
    where = np.empty(100_000, np.int64)
    where[ids] = np.arange(100_000)
    spread = [np.ptp(where[b * 1000:(b + 1) * 1000]) for b in range(100)]
    assert max(spread) < 2 * 4000


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 4000), parts=st.integers(2, 12), block=st.integers(1, 300), window=st.integers(1, 900),
       seed=st.integers(0, 2**63))
def test_block_order_in_parts_keeps_each_parts_blocks_every_epoch(n, parts, block, window, seed):
    """Cut in parts (one per rank), block order is still a permutation each epoch, and each part
    reads the same blocks every epoch, in another order: a node whose share is cached fetches
    nothing in the next epoch (a part reads past its own blocks only in the block two parts share)."""
    from loaders.order.orders import _part_start

    starts = _part_start(np.arange(parts + 1), n, parts)
    epochs = [epoch_order(n, order="block", seed=seed, epoch=e, block_size=block, window=window, parts=parts)
              for e in range(3)]
    held = []
    for ids in epochs:
        assert np.array_equal(np.sort(ids), np.arange(n))
        held.append([set((ids[starts[k]:starts[k + 1]] // block).tolist()) for k in range(parts)])
        for k in range(parts):  # about its share of blocks: the ones wholly its own, and at most two shared
            own = starts[k + 1] // block - -(-starts[k] // block)
            assert len(held[-1][k]) <= max(own, 0) + 2
    assert held[0] == held[1] == held[2]
    if n >= 4 * block * parts and n >= 2 * window:  # the order within a part changes by epoch
        assert not np.array_equal(epochs[0], epochs[1])


def test_ranks_in_block_order_read_the_same_blocks_every_epoch_and_an_older_state_resumes_as_dealt():
    """Through the sampler: each of 4 ranks reads the same blocks in epochs 0, 1 and 2; together they
    read each id once an epoch. A state of version 4 (block order dealt anew each epoch) resumes
    its epoch in the order that wrote it, and the next epoch is pinned."""
    n, world, batch = 20_000, 4, 16

    def blocks(plan, p):
        return set((plan.ids(p, 0, plan.per_rank(p.cursor)) // 1024).tolist())

    seen = {}
    for r in range(world):
        plan = Epochs(n, batch, shuffle=True, order="block", seed=5, drop_last=False, rank=r, world_size=world)
        for epoch in range(3):
            plan.set_epoch(epoch)
            p = plan.start()
            ids = plan.ids(p, 0, plan.per_rank())
            seen.setdefault(epoch, []).append(ids)
            assert blocks(plan, p) == blocks(plan, Pass(0, 0, p.num_batches, world))
            plan.taken(p, p.num_batches)
    for epoch, parts in seen.items():
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))
    old = {"version": 4, "source": "", "num_samples": n, "order": "block", "seed": 5, "drop_last": False,
           "buckets": None, "epoch": 1, "cursor": 64, "slices": world}
    plan = Epochs(n, batch, shuffle=True, order="block", seed=5, drop_last=False, rank=2, world_size=world)
    plan.load_state_dict(old)
    p = plan.start()
    assert not p.pinned
    dealt = Permutation(n, order="block", seed=5, epoch=1)(sliced(64 + 2 + world * np.arange(8), n, world))
    assert plan.ids(p, 0, 8).tolist() == dealt.tolist()
    assert plan.state_dict()["pinned"] is False
    plan.taken(p, p.num_batches)
    assert plan.start().pinned and plan.state_dict()["version"] == 5
    with pytest.raises(ConfigError, match="pinned"):
        plan.load_state_dict({**plan.state_dict(), "pinned": 1})


def test_block_window_is_block_orders_window_and_part_of_its_state():
    n, batch = 20_000, 16
    plans = [Epochs(n, batch, shuffle=True, order="block", seed=5, drop_last=False, rank=0, world_size=1,
                    block_window=w) for w in (8192, 1024)]
    ids = [plan.ids(plan.start(), 0, 4096) for plan in plans]
    assert not np.array_equal(ids[0], ids[1])
    assert np.unique(ids[1][:1024] // 1024).size == 1  # a window of 1,024: one block at a time
    assert plans[1].state_dict()["block_window"] == 1024
    with pytest.raises(ConfigError, match="block_window=1024, this loader has block_window=8192"):
        plans[0].load_state_dict(plans[1].state_dict())
    older = {k: v for k, v in plans[0].state_dict().items() if k != "block_window"}
    plans[0].load_state_dict(older)  # a state without it: the window every earlier version had
    with pytest.raises(ConfigError, match="block_window"):
        Epochs(n, batch, shuffle=True, order="random", seed=5, drop_last=False, rank=0, world_size=1, block_window=64)


def _chi2_z(counts: np.ndarray) -> float:
    """How far a table of counts is from uniform, in standard deviations of the chi-square
    statistic (normal approximation, fine for thousands of degrees of freedom)."""
    expected = counts.sum() / counts.size
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.size - 1
    return (chi2 - dof) / math.sqrt(2 * dof)


def _position_counts(orders: list[np.ndarray], n: int) -> np.ndarray:
    counts = np.zeros((n, n), np.int64)
    for o in orders:
        counts[o, np.arange(n)] += 1
    return counts


@pytest.mark.parametrize("n", [64, 100])  # a power of two, and one that needs cycle walking
def test_random_order_places_every_id_anywhere_as_uniformly_as_numpy(n):
    """Position of each id over 6,000 epochs: a chi-square of the id x position table within
    4 sigma of uniform, as numpy's permutation (the same statistic) is."""
    epochs = 6000
    ours = _position_counts([epoch_order(n, order="random", seed=9, epoch=e) for e in range(epochs)], n)
    rng = np.random.default_rng(9)
    theirs = _position_counts([rng.permutation(n) for _ in range(epochs)], n)
    assert abs(_chi2_z(theirs)) < 4  # the threshold holds for numpy, the reference
    assert abs(_chi2_z(ours)) < 4


def test_random_order_pairs_and_correlations_as_numpy():
    # consecutive pairs (a, b) at the start of the order: uniform over the 16 x 15 pairs
    n, epochs = 16, 20000
    pairs = np.zeros((n, n), np.int64)
    for e in range(epochs):
        o = epoch_order(n, order="random", seed=2, epoch=e)
        pairs[o[0], o[1]] += 1
    off_diagonal = pairs[~np.eye(n, dtype=bool)]
    assert np.all(np.diag(pairs) == 0) and abs(_chi2_z(off_diagonal)) < 4
    # over a large epoch: no correlation between neighbours, or between position and id
    n = 200_000
    bound = 4 / math.sqrt(n)  # 4 sigma of the sample correlation of independent values
    for o in (epoch_order(n, order="random", seed=5, epoch=1), np.random.default_rng(5).permutation(n)):
        assert abs(np.corrcoef(o[:-1], o[1:])[0, 1]) < bound
        assert abs(np.corrcoef(o, np.arange(n))[0, 1]) < bound
        assert np.mean(np.abs(np.diff(o)) == 1) < 10 / n  # neighbours in id are not kept together


def _epochs(n, batch, *, rank=0, world=1, drop_last=False, seed=0, source="s", order=None):
    return Epochs(n, batch, shuffle=True, order=order, seed=seed, drop_last=drop_last, rank=rank,
                     world_size=world, source=source)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 500), world=st.integers(1, 8), batch=st.integers(1, 40), drop_last=st.booleans(),
       cursor_frac=st.floats(0, 1), seed=st.integers(0, 1000))
def test_rank_shares_are_equal_and_cover_the_rest_once(n, world, batch, drop_last, cursor_frac, seed):
    cursor = int(cursor_frac * n)
    shares = []
    for r in range(world):
        plan = _epochs(n, batch, rank=r, world=world, drop_last=drop_last, seed=seed)
        plan.load_state_dict({**plan.state_dict(), "cursor": cursor})
        shares.append(plan.ids(plan.upcoming(), 0, plan.per_rank()))
    assert len({len(s) for s in shares}) == 1
    taken = np.concatenate(shares)
    order = epoch_order(n, order="random", seed=seed, epoch=0)
    rest = set(order[sliced(np.arange(cursor, n), n, world)].tolist())  # the global order's rest
    if drop_last:
        assert len(taken) == len(set(taken.tolist())) and set(taken.tolist()) <= rest
        assert len(rest) - len(taken) < world * batch
    else:
        assert set(taken.tolist()) >= rest and len(taken) - len(rest) < world


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 400), w1=st.integers(1, 6), w2=st.integers(1, 6), b1=st.integers(1, 16),
       b2=st.integers(1, 16), steps=st.integers(0, 30))
def test_elastic_resume_covers_the_epoch_once(n, w1, w2, b1, b2, steps):
    """`steps` global steps on w1 ranks of batch b1, a state, then w2 ranks of batch b2 from it:
    every sample exactly once (drop_last=False pads only the very end of the epoch)."""
    seen = []
    steps = min(steps, n // (b1 * w1))
    states = []
    for r in range(w1):
        plan = _epochs(n, b1, rank=r, world=w1, seed=7)
        p = plan.start()
        seen += plan.ids(p, 0, steps * b1).tolist()
        plan.taken(p, steps)
        states.append(plan.state_dict())
    assert all(s == states[0] for s in states)  # every rank saves the same state
    if states[0]["epoch"] == 1:  # the steps were the whole epoch: the state is the next one's start
        assert states[0]["cursor"] == 0 and sorted(seen) == list(range(n))
        return
    for r in range(w2):
        plan = _epochs(n, b2, rank=r, world=w2, seed=7)
        plan.load_state_dict(states[0])
        seen += plan.ids(plan.upcoming(), 0, plan.per_rank()).tolist()
    assert set(seen) == set(range(n))
    assert len(seen) - n < w2  # only the final padding repeats


def test_set_epoch_keeps_the_cursor_of_the_epoch_it_is_in():
    plan = _epochs(100, 10)
    plan.load_state_dict({**plan.state_dict(), "epoch": 3, "cursor": 40})
    plan.set_epoch(3)  # the top of the README loop, for the epoch of the state
    assert (plan.epoch, plan.cursor) == (3, 40)
    p = plan.start()
    plan.taken(p, p.num_batches)  # the rest of epoch 3
    assert (plan.epoch, plan.cursor) == (4, 0)
    plan.set_epoch(4)
    assert (plan.epoch, plan.cursor) == (4, 0)
    plan.taken(plan.start(), 2)
    plan.set_epoch(7)  # another epoch: from its start
    assert (plan.epoch, plan.cursor) == (7, 0)


def test_a_state_loads_only_into_a_loader_of_the_same_samples_and_order():
    state = _epochs(100, 10, seed=1, source="a").state_dict()
    for other in (_epochs(101, 10, seed=1, source="a"), _epochs(100, 10, seed=2, source="a"),
                  _epochs(100, 10, seed=1, source="b"), _epochs(100, 10, seed=1, source="a", order="block")):
        with pytest.raises(ConfigError, match="the state is for"):
            other.load_state_dict(state)
    _epochs(100, 7, seed=1, source="a", world=3).load_state_dict(state)  # batch size and world size may change
    for bad in ({"seed": 1, "epoch": 0, "cursor": 0, "order": "random"},  # a state of mmpack 0.3
                {**state, "cursor": 101}, {**state, "epoch": -1}, {**state, "cursor": "3"}):
        with pytest.raises(ConfigError):
            _epochs(100, 10, seed=1, source="a").load_state_dict(bad)


@given(n=st.integers(0, 2000), batch=st.integers(1, 40), workers=st.integers(1, 9))
def test_workers_shares_partition_the_pass(n, batch, workers):
    epochs = Epochs(n, batch, shuffle=True, order=None, seed=0, drop_last=False, rank=0, world_size=1)
    p = epochs.upcoming()
    got = sorted(b for w in range(workers) for b in epochs.batches(p, w, workers))
    assert got == list(range(p.num_batches)) == list(epochs.batches(p))
    assert [epochs.clip(p, k) for k in (0, 1, 5, 10**6)] == [min(k, p.num_batches) for k in (0, 1, 5, 10**6)]


def test_topology_sources(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (resolve_topology().rank, resolve_topology().world_size) == (2, 4)
    assert resolve_topology(1, 3).rank == 1


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 300), batch=st.integers(1, 40), world=st.integers(1, 3), cursor=st.integers(0, 300),
       order=st.sampled_from(["random", "block", "sequential"]), workers=st.integers(1, 3))
def test_what_a_lookahead_reads_is_the_pass_then_the_next_epoch(n, batch, world, cursor, order, workers):
    """`Epochs.ahead_of(p, w, k)`: worker w's batches (w, w + k, ...) of pass p, then its batches
    of the next epoch from its start, as the epochs themselves give them, whatever their own
    caches hold meanwhile."""
    kw = dict(shuffle=True, order=order, seed=3, drop_last=False, rank=world - 1, world_size=world)
    epochs = Epochs(n, batch, **kw)
    epochs.load_state_dict({**epochs.state_dict(), "epoch": 2, "cursor": min(cursor, n)})
    p = epochs.start()
    following = Epochs(n, batch, **kw)
    following.set_epoch(3)
    q = following.start()
    for worker in range(workers):
        ids, more = epochs.ahead_of(p, worker, workers)
        want = [epochs.batch_ids(p, b) for b in range(worker, p.num_batches, workers)]
        want += [following.batch_ids(q, b) for b in range(worker, q.num_batches, workers)]
        assert [more(i) for i in range(len(want) + 2)] == [True] * len(want) + [False] * 2
        for i in reversed(range(len(want))):  # backwards: a chunk cache shared with the epochs would be stale
            assert np.array_equal(ids(i), want[i])


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 3000), slices=st.integers(1, 9), data=st.data())
def test_slices_give_each_rank_a_contiguous_part_of_the_epoch(n, slices, data):
    """The global order is the epoch's order cut in `slices` parts walked side by side: a
    bijection, and the positions one of S interleaved ranks reads are its own part's, in order."""
    g = sliced(np.arange(n), n, slices)
    assert sorted(g.tolist()) == list(range(n))
    r = data.draw(st.integers(0, slices - 1))
    mine = g[r::slices]
    lengths = [len(range(s, n, slices)) for s in range(slices)]
    assert mine.tolist() == list(range(sum(lengths[:r]), sum(lengths[:r + 1])))


def test_ranks_read_their_own_part_of_the_epoch_and_a_state_without_slices_resumes_interleaved():
    n, world, batch = 1000, 4, 8
    for r in range(world):  # sequential order: rank r's samples are the r-th quarter of the ids
        plan = Epochs(n, batch, shuffle=False, order=None, seed=0, drop_last=False, rank=r, world_size=world)
        p = plan.start()
        assert p.slices == world and plan.state_dict()["slices"] == world
        assert plan.ids(p, 0, plan.per_rank()).tolist() == list(range(250 * r, 250 * (r + 1)))
    # a state of the previous version (no slices: one part) resumes as it was written, the
    # remaining positions dealt interleaved; the next epoch is cut for the ranks there are
    old = {"version": 2, "source": "", "num_samples": n, "order": "sequential", "seed": 0, "epoch": 0, "cursor": 96}
    plan = Epochs(n, batch, shuffle=False, order=None, seed=0, drop_last=False, rank=1, world_size=2)
    plan.load_state_dict(old)
    p = plan.start()
    assert p.slices == 1 and plan.ids(p, 0, 4).tolist() == [97, 99, 101, 103]
    plan.taken(p, p.num_batches)
    assert plan.start().slices == 2 and plan.state_dict()["version"] == 5
    with pytest.raises(ConfigError, match="slices"):
        plan.load_state_dict({**plan.state_dict(), "slices": 0})


def test_a_state_from_before_drop_last_and_buckets_were_recorded():
    """States of version 2 (mmpack 0.4.0, which had no bucket_by) and 3 record neither drop_last
    nor buckets: they load, as before, into loaders without buckets, with either drop_last; a
    loader with buckets refuses them (their batch size is not known), saying so."""
    from loaders.order.buckets import Bucketed

    for version in (2, 3):
        old = {"version": version, "source": "s", "num_samples": 100, "order": "random", "seed": 0, "epoch": 1,
               "cursor": 40, "slices": 1}
        for drop_last in (False, True):
            plan = _epochs(100, 10, drop_last=drop_last)
            plan.load_state_dict(old)
            assert plan.start().cursor == 40
        grouped = Epochs(100, 10, shuffle=True, order=None, seed=0, drop_last=False, rank=0, world_size=1, source="s",
                         stream=Bucketed(lambda ids: ids % 2, 10, bucket_by="aspect", column="image"))
        with pytest.raises(ConfigError, match=f"version {version}.* records neither bucket_by nor a batch size"):
            grouped.load_state_dict(old)
