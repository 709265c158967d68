"""Batches grouped by shape (`bucket_by="aspect"`): each image once an epoch, batches of one
bucket, little padding on real photos of both orientations, any position found alone
(resume: tests/contract.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders import Loader, Mixture, MMapDataset, StatefulDataLoader
from loaders.order.buckets import STEPS_PER_OCTAVE, ShapeBuckets, aspect_bucket
from packer.errors import ConfigError


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), group=st.integers(1, 64), buckets=st.integers(1, 9), seed=st.integers(0, 2**32))
def test_groups_hold_one_bucket_every_sample_once_and_any_position_is_found_alone(n, group, buckets, seed):
    bucket_of = lambda ids: (ids * 2654435761 % 97) % buckets  # noqa: E731 - any deterministic labelling
    walk = ShapeBuckets(n, bucket_of, group=group, seed=seed, epoch=2)(np.arange(n))
    assert sorted(walk.tolist()) == list(range(n))
    whole = n - sum(np.bincount(bucket_of(np.arange(n)), minlength=buckets) % group)
    for g in range(whole // group):  # the whole groups first, each of one bucket; the tail after them
        assert len(set(bucket_of(walk[g * group:(g + 1) * group]).tolist())) == 1
    fresh = ShapeBuckets(n, bucket_of, group=group, seed=seed, epoch=2)
    probe = np.sort(np.random.default_rng(seed).integers(0, n, 20))
    assert np.array_equal(fresh(probe[10:]), walk[probe[10:]])  # from the middle first,
    assert np.array_equal(fresh(probe[:10]), walk[probe[:10]])  # then behind it (walked again)
    other = ShapeBuckets(n, bucket_of, group=group, seed=seed, epoch=3)(np.arange(n))
    # another epoch, another walk: where there are enough groups that two random walks coincide
    # by chance less than once in millions (3 groups did so 1 time in 6: n=3, group=1 failed)
    assert n < 12 * group or not np.array_equal(other, walk)


def test_aspect_buckets_put_a_doubling_of_the_ratio_in_eight():
    shapes = np.array([[100, 100, 3], [100, 200, 3], [200, 100, 3], [100, 108, 3], [100, 120, 3]])
    assert aspect_bucket(shapes).tolist() == [0, -STEPS_PER_OCTAVE, STEPS_PER_OCTAVE, -1, -2]


def _canvas_use(loader) -> tuple[float, list[str]]:
    """The share of the batches' canvas bytes that are padding, and the keys in order."""
    image = canvas = 0
    keys = []
    for batch in loader:
        sizes = batch["image_size"].numpy()
        height, width = batch["image"].shape[1:3]
        image += int((sizes[:, 0] * sizes[:, 1]).sum())
        canvas += len(sizes) * height * width
        keys += batch["key"]
    return 1 - image / canvas, keys


def test_real_photos_of_both_orientations_waste_little_canvas_when_bucketed(built):
    ds = MMapDataset(built["aspect"], columns=["image", "key"])
    plain, keys = _canvas_use(Loader(ds, 8, seed=1))
    bucketed = Loader(ds, 8, seed=1, bucket_by="aspect")
    padding, first = _canvas_use(bucketed)
    _, second = _canvas_use(bucketed)
    assert padding <= 0.25 < plain
    assert sorted(first) == sorted(second) == sorted(keys) and len(set(first)) == len(first)  # once an epoch
    assert first != second  # a new order every epoch
    assert _canvas_use(Loader(ds, 8, seed=1, bucket_by="aspect"))[1] == first  # deterministic


def test_what_grouping_by_shape_refuses(built):
    with pytest.raises(ConfigError, match="own-sized images"):
        Loader(MMapDataset(built["images"]), 8, bucket_by="aspect")
    with pytest.raises(ConfigError, match="'aspect', 'length', 'length:COLUMN' or None"):
        Loader(MMapDataset(built["aspect"]), 8, bucket_by="size")
    mixture = Mixture([MMapDataset(built["aspect"])] * 2, [1, 1])
    with pytest.raises(ConfigError, match="Mixture"):
        Loader(mixture, 8, bucket_by="aspect")


def test_grouped_batches_go_to_spawned_workers(built):
    """A DataLoader started with spawn (macOS's, Windows') pickles the dataset with its epochs."""
    import pickle

    batched = MMapDataset(built["aspect"], columns=["image", "key"]).batched(8, seed=2, bucket_by="aspect")
    again = pickle.loads(pickle.dumps(batched))
    assert [b["key"] for b in again] == [b["key"] for b in batched]


def test_a_grouped_state_resumes_only_in_a_loader_grouped_the_same(built):
    """Batches grouped by shape are an order of their batch size: a state saved over them is
    refused, in one line naming what differs, by a loader with another batch size or without
    bucket_by (each took it before, and the epoch then showed some samples twice and others
    never), and a state saved without buckets by one with them; built the same, it goes on
    exactly."""
    ds = MMapDataset(built["aspect"], columns=["image", "key"])
    full = [k for b in Loader(ds, 8, seed=4, bucket_by="aspect") for k in b["key"]]
    saving = Loader(ds, 8, seed=4, bucket_by="aspect")
    it = iter(saving)
    head = [k for _ in range(3) for k in next(it)["key"]]
    state = saving.state_dict()
    plain = Loader(ds, 8, seed=4)
    next(iter(plain))
    for loading, saved, differs in (
            (Loader(ds, 16, seed=4, bucket_by="aspect"), state, "batch_size 8, this loader's 16"),
            (StatefulDataLoader(ds.batched(4, seed=4, bucket_by="aspect")), state, "batch_size 8, this loader's 4"),
            (Loader(ds, 8, seed=4), state, "bucket_by='aspect'.* this loader has bucket_by=None"),
            (StatefulDataLoader(ds.batched(8, seed=4)), state, "bucket_by='aspect'.* this loader has bucket_by=None"),
            (Loader(ds, 8, seed=4, bucket_by="aspect"), plain.state_dict(),
             "bucket_by=None, this loader has bucket_by='aspect'")):
        with pytest.raises(ConfigError, match=differs) as got:
            loading.load_state_dict(saved)
        assert "\n" not in str(got.value)
    again = Loader(ds, 8, seed=4, bucket_by="aspect", num_threads=1)
    again.load_state_dict(state)
    rest = [k for b in again for k in b["key"]]
    assert head + rest == full and len(set(full)) == len(full) == len(ds)
