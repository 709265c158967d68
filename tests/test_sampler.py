"""Orders are permutations, deterministic in (seed, epoch); rank shares are equal-sized and
cover the epoch; resume from any cursor, with any world size, covers the rest once."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders.sampler import epoch_order, rank_share, resolve_topology, worker_batches

orders = st.sampled_from(["random", "sequential", "block"])


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 3000), order=orders, seed=st.integers(0, 2**31), epoch=st.integers(0, 50),
       block=st.integers(1, 300), window=st.integers(1, 900))
def test_orders_are_deterministic_permutations(n, order, seed, epoch, block, window):
    a = epoch_order(n, order=order, seed=seed, epoch=epoch, block_size=block, window=window)
    b = epoch_order(n, order=order, seed=seed, epoch=epoch, block_size=block, window=window)
    assert np.array_equal(a, b) and np.array_equal(np.sort(a), np.arange(n))


def test_epochs_and_seeds_change_the_random_order():
    a = epoch_order(1000, order="random", seed=0, epoch=0)
    assert not np.array_equal(a, epoch_order(1000, order="random", seed=0, epoch=1))
    assert not np.array_equal(a, epoch_order(1000, order="random", seed=1, epoch=0))


def test_block_order_stays_local():
    ids = epoch_order(100_000, order="block", seed=3, epoch=0, block_size=1000, window=4000)
    # every window of 4000 consecutive reads touches at most 4-5 blocks of 1000 ids
    blocks = [len(np.unique(ids[i:i + 4000] // 1000)) for i in range(0, 100_000, 4000)]
    assert max(blocks) <= 5


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 500), world=st.integers(1, 8), batch=st.integers(1, 40), drop_last=st.booleans(),
       cursor_frac=st.floats(0, 1), seed=st.integers(0, 1000))
def test_rank_shares_are_equal_and_cover_the_rest_once(n, world, batch, drop_last, cursor_frac, seed):
    order = epoch_order(n, order="random", seed=seed, epoch=0)
    cursor = int(cursor_frac * n)
    shares = [rank_share(order, cursor, rank=r, world_size=world, batch_size=batch, drop_last=drop_last)
              for r in range(world)]
    assert len({len(s) for s in shares}) == 1
    taken = np.concatenate(shares)
    rest = set(order[cursor:].tolist())
    if drop_last:
        assert len(taken) == len(set(taken.tolist())) and set(taken.tolist()) <= rest
        assert len(rest) - len(taken) < world * batch
    else:
        assert set(taken.tolist()) >= rest and len(taken) - len(rest) < world


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 400), w1=st.integers(1, 6), w2=st.integers(1, 6), batch=st.integers(1, 16),
       steps=st.integers(0, 30))
def test_elastic_resume_covers_the_epoch_once(n, w1, w2, batch, steps):
    """Run `steps` global steps on w1 ranks, resume on w2 ranks: every sample exactly once
    (drop_last=False pads only the very end of the epoch)."""
    order = epoch_order(n, order="random", seed=7, epoch=2)
    seen = []
    shares = [rank_share(order, 0, rank=r, world_size=w1, batch_size=batch, drop_last=False) for r in range(w1)]
    steps = min(steps, n // (batch * w1))
    for r in range(w1):
        seen += shares[r][: steps * batch].tolist()
    cursor = steps * batch * w1
    for r in range(w2):
        seen += rank_share(order, cursor, rank=r, world_size=w2, batch_size=batch, drop_last=False).tolist()
    assert set(seen) == set(range(n))
    assert len(seen) - n < w2  # only the final padding repeats


@given(batches=st.integers(0, 200), workers=st.integers(1, 9))
def test_worker_batches_partition(batches, workers):
    got = sorted(b for w in range(workers) for b in worker_batches(batches, w, workers))
    assert got == list(range(batches))


def test_topology_sources(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (resolve_topology().rank, resolve_topology().world_size) == (2, 4)
    assert resolve_topology(1, 3).rank == 1
