"""Mixtures: the stream's shares at every prefix, each source's own epochs, determinism, O(1)
memory at 10^9 samples a source, and a Loader over real datasets (resume: tests/contract.py)."""

from __future__ import annotations

import heapq
import tracemalloc
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders import BatchedDataset, Loader, Mixture, MMapDataset, PackedDocuments, TokenWindows
from loaders.order.blend import Blend, counts_before, sources_at
from loaders.order.sampler import Epochs
from packer.errors import ConfigError

weights_st = st.lists(st.floats(0.001, 1.0), min_size=1, max_size=6)


def _bound(k: int) -> float:
    """How far a source's count may be from its share at any prefix: under K/2 samples with K
    sources (one big source ahead of K - 1 small ones reaches (K - 1)/2: hypothesis found it)."""
    return k / 2


def _walk(w: np.ndarray, n: int) -> list[tuple[int, int]]:
    """The stream walked from its start: source k's j-th sample at time (2j + 1) / w_k, in time
    order, a tie to the lower source (what sources_at computes per position)."""
    heap = [(1 / wk, k, 0) for k, wk in enumerate(w)]
    heapq.heapify(heap)
    out = []
    while len(out) < n:
        _, k, j = heapq.heappop(heap)
        out.append((k, j))
        heapq.heappush(heap, ((2 * j + 3) / w[k], k, j + 1))
    return out


@settings(max_examples=60, deadline=None)
@given(weights=weights_st, n=st.integers(1, 3000))
def test_every_prefix_holds_each_source_by_its_weight(weights, n):
    w = np.asarray(weights) / sum(weights)
    source, j = sources_at(np.arange(n), w)
    assert list(zip(source.tolist(), j.tolist())) == _walk(w, n)
    far = 10**12 + np.arange(300)  # far out, computed alone, as continuous as the start
    k_far, j_far = sources_at(far, w)
    assert (np.diff(j_far[k_far == k_far[0]]) == 1).all()
    counts = np.zeros((n, len(w)))
    counts[np.arange(n), source] = 1
    seen = np.cumsum(counts, axis=0)
    expected = np.arange(1, n + 1)[:, None] * w[None, :]
    assert np.abs(seen - expected).max() < _bound(len(w))
    assert (counts_before([n], w)[0] == seen[-1]).all()  # the closed form agrees with the walk


@settings(max_examples=80, deadline=None)
@given(weights=weights_st, first=st.one_of(st.integers(0, 100), st.integers(0, 10**13)),
       n=st.integers(2, 2000), stride=st.integers(1, 12))
def test_a_run_of_positions_merged_from_its_start_is_what_each_position_alone_gives(weights, first, n, stride):
    """sources_at reads sorted, dense positions off one merge of the sources' next events; each
    position alone (counts_before's corrections) must give the same, ties included."""
    w = np.asarray(weights) / sum(weights)
    g = first + stride * np.arange(n)
    source, j = sources_at(g, w)
    alone = [sources_at([p], w) for p in g.tolist()[:: max(1, n // 50)]]
    assert [(int(k[0]), int(c[0])) for k, c in alone] == list(zip(source.tolist(), j.tolist()))[:: max(1, n // 50)]
    c = counts_before(g, w)
    assert (c[np.arange(n), source] == j).all()


def test_sources_permuted_in_one_pass_give_each_sources_own_order():
    """A random-order mixture permutes every source's samples in one Feistel pass, a key and a
    size per sample: the ids must be each source's own Permutation's."""
    from loaders.order.blend import SOURCE_KEY
    from loaders.order.orders import Permutation, derive_key

    blend = Blend([7, 1000, 65537], [1, 3, 2], num_samples=5000)
    ids = np.concatenate([blend.order_for(order="random", seed=11, epoch=e)(np.arange(5000)) for e in range(3)])
    source, j = blend.at(np.arange(15000))
    for k, n in enumerate(blend.sizes):
        own_epoch, pos = np.divmod(j[source == k], n)
        expected = [Permutation(n, order="random", seed=derive_key(11, SOURCE_KEY, k), epoch=int(e))([p])[0]
                    for e, p in zip(own_epoch.tolist(), pos.tolist())]
        assert (ids[source == k] - blend.offsets[k]).tolist() == expected


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4), data=st.data(),
       order=st.sampled_from(["random", "sequential", "block"]), seed=st.integers(0, 2**64 - 1))
def test_each_source_sees_its_samples_once_in_each_of_its_own_epochs(sizes, data, order, seed):
    weights = data.draw(st.lists(st.floats(0.01, 1.0), min_size=len(sizes), max_size=len(sizes)))
    blend = Blend(sizes, weights, num_samples=data.draw(st.integers(1, 50)))
    stream = np.concatenate([blend.order_for(order=order, seed=seed, epoch=e)(np.arange(blend.num_samples))
                             for e in range(12)])
    source = blend.source_of(stream)
    for k, n in enumerate(sizes):
        own = stream[source == k] - blend.offsets[k]
        for e in range(len(own) // n):  # every whole own epoch: a permutation of its samples
            assert sorted(own[e * n:(e + 1) * n].tolist()) == list(range(n))
    again = Blend(sizes, weights, num_samples=blend.num_samples).order_for(order=order, seed=seed, epoch=3)
    assert np.array_equal(again(np.arange(blend.num_samples)), stream[3 * blend.num_samples:4 * blend.num_samples])


def test_sources_of_a_billion_samples_each_open_and_resume_in_constant_memory():
    """No per-sample array anywhere: three sources of 10^9 samples, a batch in the middle of
    epoch 7, a state saved and loaded, under a few MB of Python allocations."""
    tracemalloc.start()
    blend = Blend([10**9] * 3, [5, 3, 2])
    epochs = Epochs(blend.num_samples, 256, shuffle=True, order=None, seed=9, drop_last=False, rank=1,
                    world_size=8, source="big", stream=blend)
    epochs.load_state_dict({**epochs.state_dict(), "epoch": 7, "cursor": 123_456_789})
    p = epochs.start()
    ids = epochs.batch_ids(p, 1000)
    state = epochs.state_dict()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(ids) == 256 and peak < 8 << 20
    assert [s["epoch"] for s in state["sources"]] == [7, 4, 2]  # 14.1e9 positions in: 0.5, 0.3, 0.2 of it
    assert Counter(blend.source_of(ids).tolist()).keys() <= {0, 1, 2}


@pytest.fixture(scope="module")
def tokens_of(built):
    """Two datasets with the same columns: the text dataset, and the pairs dataset's tokens."""
    return [MMapDataset(built[k], columns=["tokens", "key"]) for k in ("text", "pairs")]


def test_a_loader_over_a_mixture_gives_each_source_its_share_in_every_batch_prefix(tokens_of):
    mixture = Mixture(tokens_of, [0.7, 0.3], num_samples=200)
    loaders = [Loader(mixture, 16, seed=4, num_threads=t) for t in (1, 2)]
    runs = [[{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in loader]
            for loader in loaders]
    seen = np.zeros(2)
    for batch, other in zip(*runs):
        assert list(batch) == ["tokens", "key", "tokens_lengths", "source"] and batch["source"].dtype == torch.int64
        assert batch["key"] == other["key"] and torch.equal(batch["tokens"], other["tokens"])  # any thread count
        seen += np.bincount(batch["source"].numpy(), minlength=2)
        assert np.abs(seen - seen.sum() * mixture.weights).max() < 1
        for k, key in zip(batch["source"].tolist(), batch["key"]):
            assert key in _keys(tokens_of[k])
    assert seen.sum() == 200


def _keys(ds) -> set[str]:
    if not hasattr(ds, "_all_keys"):
        ds._all_keys = {ds[i]["key"] for i in range(len(ds))}
    return ds._all_keys


def test_a_small_source_upsampled_repeats_its_samples_in_new_orders(tokens_of):
    small = MMapDataset(tokens_of[1].root, columns=["tokens", "key"])
    mixture = Mixture([tokens_of[0], small], [1, 1], num_samples=12 * len(small))
    loader = Loader(mixture, 8, seed=2)
    keys = [key for batch in loader for key, k in zip(batch["key"], batch["source"].tolist()) if k == 1]
    n = len(small)
    rounds = [keys[i * n:(i + 1) * n] for i in range(len(keys) // n)]
    assert len(rounds) >= 2 and all(sorted(r) == sorted(rounds[0]) for r in rounds)  # each whole, once
    assert len({tuple(r) for r in rounds}) == len(rounds)  # in a new order each time


def test_token_windows_mix_into_x_y_and_the_source(built):
    windows = [TokenWindows(built["text"], 32), TokenWindows(built["pairs"], 8)]
    with pytest.raises(ConfigError, match="seq_len"):
        Mixture(windows, [1, 1])
    mixture = Mixture([TokenWindows(built["text"], 16), TokenWindows(built["pairs"], 16)], [3, 1])
    x, y, source = next(iter(Loader(mixture, 8, seed=1)))
    assert x.shape == y.shape == (8, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert source.tolist().count(0) == 6
    direct = [TokenWindows(built["text"], 16), TokenWindows(built["pairs"], 16)]
    ids = Loader(mixture, 8, seed=1)._epochs
    first = ids.batch_ids(ids.upcoming(), 0) - mixture.blend.offsets[source.numpy()]
    for row, k, i in zip(x, source.tolist(), first.tolist()):
        assert torch.equal(row, direct[k][i][0])
    assert next(iter(BatchedDataset(mixture, 8, seed=1)))[2].tolist() == source.tolist()


def test_what_a_mixture_refuses(tokens_of, built):
    with pytest.raises(ConfigError, match="one weight per source"):
        Mixture(tokens_of, [1])
    with pytest.raises(ConfigError, match="positive"):
        Mixture(tokens_of, [1, 0])
    with pytest.raises(ConfigError, match="columns"):
        Mixture([MMapDataset(built["text"]), MMapDataset(built["pairs"])], [1, 1])
    with pytest.raises(ConfigError, match="one kind at a time"):
        Mixture([PackedDocuments(built["text"], 64), TokenWindows(built["text"], 64)], [1, 1])
    with pytest.raises(ConfigError, match="seq_len"):
        Mixture([PackedDocuments(built["text"], 64), PackedDocuments(built["pairs"], 32)], [1, 1])
    saved = Loader(Mixture(tokens_of, [0.7, 0.3]), 8, seed=1)
    next(iter(saved))
    with pytest.raises(ConfigError, match="source"):  # other weights: another stream
        Loader(Mixture(tokens_of, [0.5, 0.5]), 8, seed=1).load_state_dict(saved.state_dict())


def test_a_curriculum_goes_on_with_new_weights_from_where_the_state_stopped(tokens_of):
    """reweighted_from: the same stream up to the state's place, then the new weights from each
    source's count there; a state saved after that rebuilds the same stream, in a fresh loader."""
    first = Loader(Mixture(tokens_of, [0.9, 0.1], num_samples=240), 16, seed=3)
    it = iter(first)
    head = [next(it)["source"].tolist() for _ in range(5)]
    state = first.state_dict()
    with pytest.raises(ConfigError, match="reweighted_from"):
        Loader(Mixture(tokens_of, [0.5, 0.5], num_samples=240), 16, seed=3).load_state_dict(state)
    later = Loader(Mixture(tokens_of, [0.5, 0.5], num_samples=240, reweighted_from=state), 16, seed=3)
    later.load_state_dict(state)
    batches = iter(later)
    tail = [next(batches) for _ in range(4)]
    counts = np.bincount(np.concatenate([b["source"].numpy() for b in tail]), minlength=2)
    assert abs(counts[0] - counts[1]) <= 2 and state["sources"] != later.state_dict()["sources"]
    taken = np.array([s["epoch"] * n + s["cursor"] for s, n in zip(state["sources"], map(len, tokens_of))])
    assert (taken == np.bincount(np.concatenate(head), minlength=2)).all()
    saved = later.state_dict()
    now = np.array([s["epoch"] * n + s["cursor"] for s, n in zip(saved["sources"], map(len, tokens_of))])
    assert (now == taken + counts).all()  # each source went on from where it stopped
    rest = [b["key"] for b in batches]
    again = Loader(Mixture(tokens_of, [0.5, 0.5], num_samples=240, reweighted_from=saved), 16, seed=3)
    again.load_state_dict(saved)
    assert [b["key"] for b in again] == rest
    with pytest.raises(ConfigError, match="num_samples=240"):
        Mixture(tokens_of, [0.5, 0.5], reweighted_from=state)


def test_packed_documents_mix_by_rows_with_the_segments_of_each(built, short_docs):
    """Each row of a mixed batch is its source's row, and cu_seqlens cuts the batch where each
    row's own segments end (what a batch of those rows from one source says, row by row)."""
    views = [PackedDocuments(built["text"], 64), PackedDocuments(short_docs[0], 64)]
    mixture = Mixture(views, [1, 2])
    loader = Loader(mixture, 6, seed=2)
    epochs = loader._epochs
    ids = epochs.batch_ids(epochs.upcoming(), 0)
    batch = next(iter(loader))
    source = batch["source"].numpy()
    assert set(source.tolist()) == {0, 1}
    cuts = [0]
    for r, (k, i) in enumerate(zip(source.tolist(), (ids - mixture.blend.offsets[source]).tolist())):
        one = views[k].gather(np.array([i]), views[k].alloc(1, "plain"))
        for name in ("tokens", "position_ids", "lengths"):
            assert torch.equal(batch[name][r], one[name][0])
        cuts += (r * 64 + one["cu_seqlens"].numpy()[1:]).tolist()
    assert batch["cu_seqlens"].tolist() == cuts



def test_datasets_whose_labels_name_other_classes_do_not_mix(built, image_raw, tmp_path):
    """Label 0 of one dataset is not label 0 of another built from other folders: mixing their
    label columns would train on the wrong class silently, so it is refused (without labels, fine)."""
    import shutil

    from packer.cli import main

    raw = tmp_path / "raw"
    for k, src in enumerate(sorted(p for p in image_raw.rglob("*.jpg"))[:4]):
        (raw / ("cats" if k % 2 else "dogs")).mkdir(parents=True, exist_ok=True)
        shutil.copy(src, raw / ("cats" if k % 2 else "dogs") / src.name)
    assert main(["build", str(raw), str(tmp_path / "pets"), "--image-size", "64", "-q"]) == 0
    ours, pets = MMapDataset(built["images"]), MMapDataset(tmp_path / "pets")
    assert list(ours.columns) == list(pets.columns) and ours.classes != pets.classes
    with pytest.raises(ConfigError, match="classes differ"):
        Mixture([ours, pets], [1, 1])
    unlabeled = Mixture([MMapDataset(built["images"], columns=["image", "key"]),
                         MMapDataset(tmp_path / "pets", columns=["image", "key"])], [1, 1])
    assert "label" not in next(iter(Loader(unlabeled, 4)))
    assert Mixture([ours, MMapDataset(built["images"])], [1, 1])  # the same classes mix
