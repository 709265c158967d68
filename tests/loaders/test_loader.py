"""Loader batches equal per-sample reads; resume is exact; ranks x workers cover the epoch
once; token windows match the token column."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packer.errors import ConfigError
from loaders.batch.source import BatchSource
from loaders import BatchedDataset, Loader, MMapDataset, MMapIterableDataset, StatefulDataLoader, TokenWindows, to_device
from loaders.batch.ragged import SHORT_PIECES


def pass_ids(loader) -> np.ndarray:
    """The sample ids the loader's next pass yields, in order."""
    plan = loader._epochs
    return plan.ids(plan.upcoming(), 0, plan.per_rank())


@pytest.fixture(params=["inline", "threaded"])
def pass_mode(request, monkeypatch):
    """Loader makes a pass's batches in the caller's thread when a batch is small, else in a
    producer thread: both ways, the same contract."""
    from loaders import loader as batches

    monkeypatch.setattr(batches, "INLINE_BELOW_BYTES", 1 << 62 if request.param == "inline" else 0)
    return request.param


class Counted(BatchSource):
    """A batch source (the contract Loader reads, declared) that counts the batches gathered, so a test
    waits for the producer to have made them instead of sleeping."""

    def __init__(self, source):
        import threading

        self.source, self.source_id, self.made = source, source.source_id, 0
        self.changed = threading.Condition()

    def __len__(self) -> int:
        return len(self.source)

    def alloc(self, *args):
        return self.source.alloc(*args)

    def gather(self, *args, **kwargs):
        batch = self.source.gather(*args, **kwargs)
        with self.changed:
            self.made += 1
            self.changed.notify_all()
        return batch

    def wait_for(self, n: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.made >= n, timeout=60), f"{self.made} of {n} batches made"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_batches_equal_per_sample_reads(built, threads, pass_mode, copies):
    ds = MMapDataset(built["images"])
    loader = Loader(ds, 7, seed=3, num_threads=threads)
    ids = pass_ids(loader)  # the sample ids this loader will yield, in order
    assert len(ids) == len(ds)
    pos = 0
    for batch in loader:
        for j in range(len(batch["key"])):
            ref = ds[int(ids[pos])]
            assert batch["key"][j] == ref["key"]
            assert torch.equal(batch["image"][j], ref["image"]) and batch["label"][j] == ref["label"]
            pos += 1
    assert pos == len(ds)


@pytest.mark.parametrize("curve,most,chosen", [
    ({1: 33, 2: 55, 4: 84, 8: 81, 16: 63}, 16, 4),  # the Loader of 0.4 on the 16-core host (issue 26)
    ({1: 54, 2: 99, 4: 98, 8: 144, 16: 93}, 16, 2),  # stops at the first doubling that does not pay
    ({1: 10, 2: 20, 4: 40, 8: 80, 16: 160, 32: 320, 48: 480}, 48, 48),  # scales on: up to every core
    ({1: 10, 2: 10.5}, 2, 1),  # under 10% faster: the core is left to training
    ({1: 10}, 1, 1),
])
def test_an_auto_thread_count_is_the_fewest_past_which_doubling_gains_under_10pc(curve, most, chosen):
    from loaders.loader import fewest_threads

    tried = []

    def seconds_with(n):
        tried.append(n)
        return 1 / curve[n]  # images/s -> seconds a batch

    threads, seconds = fewest_threads(seconds_with, most)
    assert threads == chosen and seconds == seconds_with(chosen)
    assert tried[0] == 1 and all(b == min(2 * a, most) for a, b in zip(tried, tried[1:-1]))


def test_the_default_thread_count_follows_from_the_machine_not_the_clock(built, monkeypatch):
    """Without num_threads a Loader takes the cores it may use, shared by the node's ranks, at
    most 16: the same count on its first pass as on its last, with no gather timed."""
    from loaders import loader as batches

    for cores, local, want in ((2, None, 2), (16, None, 16), (64, None, 16), (64, "8", 8), (16, "8", 2), (1, "4", 1),
                               (3, "x", 3)):
        monkeypatch.setattr(batches, "available_cores", lambda cores=cores: cores)
        if local is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
        assert batches.default_threads() == want
    monkeypatch.undo()
    monkeypatch.setattr(batches, "fewest_threads", lambda *a: pytest.fail("a default Loader timed its gathers"))
    ds = MMapDataset(built["images"])
    one = Loader(ds, 7, seed=3, num_threads=1)
    ref = [[b["key"] for b in one] for _ in range(2)]
    loader = Loader(ds, 7, seed=3)
    assert loader.num_threads == batches.default_threads()
    assert [[b["key"] for b in loader] for _ in range(2)] == ref and loader.num_threads == batches.default_threads()


def test_num_threads_auto_times_the_first_pass_once_and_gives_the_same_batches(built, monkeypatch):
    """num_threads="auto" times gathers at 1, 2, ... threads at the first pass only and keeps the
    count it chose (and a pool of that size); the batches do not depend on it."""
    from loaders import loader as batches

    ds = MMapDataset(built["images"])
    one = Loader(ds, 7, seed=3, num_threads=1)
    ref = [[b["key"] for b in one] for _ in range(2)]
    monkeypatch.setattr(batches, "default_threads", lambda: 2)
    for fake in (1, 2):
        looks = []

        def choose(seconds_with, most, fake=fake, looks=looks):
            looks.append(most)
            return fake, seconds_with(fake)

        monkeypatch.setattr(batches, "fewest_threads", choose)
        loader = Loader(ds, 7, seed=3, num_threads="auto")
        assert [[b["key"] for b in loader] for _ in range(2)] == ref
        assert looks == [2] and loader.num_threads == fake and (loader._pool is None) == (fake == 1)
    monkeypatch.undo()
    loader = Loader(ds, 7, seed=3, num_threads="auto")
    assert [b["key"] for b in loader] == ref[0] and 1 <= loader.num_threads <= batches.default_threads()


@pytest.mark.parametrize("docs", ["long", "short"])
def test_padded_tokens_land_in_the_ring_and_equal_per_sample_reads(built, short_docs, docs):
    """Ragged tokens come back padded to the batch's longest sample, zeros after each, with
    their lengths, in the Loader's reused buffers: long documents copied one by one, short ones
    (in 1 KB shards, so batches span many shards) by one fancy-index copy per shard."""
    ds = MMapDataset(built["text"] if docs == "long" else short_docs[0])
    mean = np.mean([len(ds[i]["tokens"]) for i in range(len(ds))])
    assert (mean > SHORT_PIECES) == (docs == "long")
    loader = Loader(ds, 3 if docs == "long" else 7, seed=5, columns=["tokens", "key"])  # several batches per buffer
    ids = pass_ids(loader)
    pos = 0
    for batch in loader:
        tokens, lengths = batch["tokens"], batch["tokens_lengths"]
        assert any(tokens.data_ptr() == ring["tokens"].data_ptr() and lengths.data_ptr() == ring["tokens_lengths"].data_ptr()
                   for ring in loader._ring)
        assert tokens.is_contiguous() and tokens.shape == (len(batch["key"]), int(lengths.max()))
        for j in range(len(batch["key"])):
            ref = ds[int(ids[pos])]["tokens"]
            n = int(lengths[j])
            assert n == len(ref) and torch.equal(tokens[j, :n], ref) and not tokens[j, n:].any()
            pos += 1
    assert pos == len(ds)


def test_a_batch_wider_than_its_buffer_gets_a_fresh_one(built):
    ds = MMapDataset(built["text"])
    source = ds.batch_source(["tokens"])
    buffers = source.alloc(4, "huge")
    buffers["tokens"] = buffers["tokens"][:3]  # room for less than this batch
    got = source.gather(np.arange(4), buffers)
    assert got["tokens"].data_ptr() != buffers["tokens"].data_ptr()
    for j in range(4):
        n = int(got["tokens_lengths"][j])
        assert torch.equal(got["tokens"][j, :n], ds[j]["tokens"]) and not got["tokens"][j, n:].any()
    assert "tokens" not in source.alloc(4, "shared")  # per-batch buffers: sized by the gather


def test_resume_mid_epoch_is_exact(built, pass_mode):
    ds = MMapDataset(built["images"])
    full = [b["key"][:] for b in Loader(ds, 4, seed=11, columns=["key"])]
    first = Loader(ds, 4, seed=11, columns=["key"])
    it = iter(first)
    head = [next(it)["key"][:] for _ in range(5)]
    state = first.state_dict()
    assert {"seed", "epoch", "cursor", "order", "source", "num_samples"} <= set(state) and state["cursor"] == 20
    resumed = Loader(ds, 4, seed=11, columns=["key"], num_threads=1)
    resumed.load_state_dict(state)
    assert head + [b["key"][:] for b in resumed] == full


def test_epochs_advance_by_themselves_and_set_epoch_picks_one(built):
    ds = MMapDataset(built["images"])
    loader = Loader(ds, 8, columns=["key"])
    e0 = [k for b in loader for k in b["key"]]
    e1 = [k for b in loader for k in b["key"]]  # iterated again: the next epoch
    assert sorted(e0) == sorted(e1) and e0 != e1 and loader.epoch == 2
    loader.set_epoch(1)
    assert [k for b in loader for k in b["key"]] == e1
    loader.set_epoch(0)
    assert [k for b in loader for k in b["key"]] == e0


def test_a_loader_has_the_dataloader_attributes_training_loops_read(built):
    """`len(loader.dataset)`, `loader.batch_size`, `loader.drop_last`, as the PyTorch examples read
    them from a DataLoader (MNIST's progress line: batch_idx * len(data) of len(train_loader.dataset))."""
    ds = MMapDataset(built["images"])
    loader = Loader(ds, 8, drop_last=True, rank=1, world_size=2)
    assert loader.dataset is ds and len(loader.dataset) == len(ds) and (loader.batch_size, loader.drop_last) == (8, True)
    by_path = Loader(built["images"], 8)
    assert isinstance(by_path.dataset, MMapDataset) and len(by_path.dataset) == len(ds) and not by_path.drop_last


@pytest.mark.parametrize("world,workers", [(2, 1), (2, 2), (3, 2)])
def test_ranks_by_workers_cover_the_epoch_once(built, world, workers):
    ds = MMapDataset(built["images"], columns=["label", "key"])
    keys = []
    per_rank = []
    for rank in range(world):
        batched = BatchedDataset(ds, 6, seed=5, drop_last=True, rank=rank, world_size=world)
        dl = torch.utils.data.DataLoader(batched, batch_size=None, num_workers=workers)
        mine = [k for b in dl for k in b["key"]]
        single = [k for b in BatchedDataset(ds, 6, seed=5, drop_last=True, rank=rank, world_size=world) for k in b["key"]]
        assert mine == single  # the order does not depend on the worker count
        per_rank.append(len(mine))
        keys += mine
    assert len(set(per_rank)) == 1
    assert len(keys) == len(set(keys)) and len(ds) - len(keys) < world * 6


def test_iterable_twin_order_independent_of_workers(built):
    it = MMapIterableDataset(built["images"], seed=2, chunk=4, columns=["key"])
    direct = [s["key"] for s in it]
    assert it._epochs.epoch == 1  # iterated in this process: the next epoch comes next
    it.set_epoch(0)
    dl = torch.utils.data.DataLoader(it, batch_size=4, num_workers=2)
    assert [k for b in dl for k in b["key"]] == direct
    assert sorted(direct) == sorted(MMapDataset(built["images"])[i]["key"] for i in range(len(it)))


def test_token_windows_match_the_token_stream(built, pass_mode):
    ds = MMapDataset(built["text"])
    stream = np.concatenate([ds[i]["tokens"].numpy() for i in range(len(ds))]).astype(np.int64)
    for seq_len, stride in [(16, None), (50, 7), (300, 300)]:
        tw = TokenWindows(built["text"], seq_len, stride)
        s = stride or seq_len
        assert len(tw) == (len(stream) - seq_len - 1) // s + 1
        for i in (0, 1, len(tw) // 2, len(tw) - 1):
            x, y = tw[i]
            assert x.tolist() == stream[i * s: i * s + seq_len].tolist()
            assert y.tolist() == stream[i * s + 1: i * s + seq_len + 1].tolist()
        seen = 0
        for x, y in Loader(tw, 9, seed=1):
            assert torch.equal(x[:, 1:], y[:, :-1])
            seen += x.shape[0]
        assert seen == len(tw)


def test_to_device_without_cuda_yields_the_same_batches(built):
    ds = MMapDataset(built["images"], columns=["label"])
    a = [b["label"].clone() for b in Loader(ds, 8, seed=1)]
    b = [x["label"].clone() for x in to_device(Loader(ds, 8, seed=1), "cpu")]
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_device_on_cuda(built):
    ds = MMapDataset(built["images"], columns=["image", "label"])
    loader = Loader(ds, 8, seed=1, device="cuda")
    assert loader.pin_memory
    ref = [b["image"].clone() for b in Loader(ds, 8, seed=1, pin_memory=False)]
    for got, want in zip(loader, ref):
        assert got["image"].is_cuda and torch.equal(got["image"].cpu(), want)
    # every batch held on the device, read only after the epoch: no copy from a pinned buffer
    # that the producer had already filled with a later batch (an asynchronous copy's race)
    for threads in (1, 4):
        held = list(Loader(ds, 8, seed=1, device="cuda", num_threads=threads))
        torch.cuda.synchronize()
        assert len(held) == len(ref)
        assert all(torch.equal(got["image"].cpu(), want) for got, want in zip(held, ref)), threads


def test_a_host_batch_is_let_go_only_after_its_copy_and_next_never_waits_on_its_own_copy(monkeypatch):
    """to_device's order, with CUDA's stream and events stood in for (this runs without a GPU):
    each host batch is dropped only once its copy's event was synchronized (else Loader could
    refill the buffer under the DMA), and the copy issued in a `next()` is never waited for in
    that same `next()` (the consumer would wait out every copy while the GPU idles)."""
    import gc
    import weakref

    log: list = []

    class Event:
        def __init__(self):
            self.k = None

        def record(self, stream):
            self.k = len([e for e in log if e[0] == "issued"])
            log.append(("issued", self.k))

        def synchronize(self):
            log.append(("synced", self.k))

    class Host(dict):  # a host batch; its "device batch" is a new dict of the same values
        pass

    fake = type("S", (), {"wait_event": lambda self, e: None})()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: fake)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: fake)

    def hosts(n):
        for k in range(n):
            h = Host(image=k)
            weakref.finalize(h, lambda k=k: log.append(("dropped", k)))
            yield h
            del h

    for stop_after in (None, 2):  # to the end, and a consumer that stops early
        log.clear()
        it = to_device(hosts(8), "cuda", prefetch=2)
        for taken, batch in enumerate(it, 1):
            assert type(batch) is dict and batch["image"] == taken - 1
            gc.collect()
            issued = max(k for what, k in log if what == "issued")
            assert ("synced", issued) not in log, log  # this next() did not wait on its own copy
            if taken == stop_after:
                break
        it.close()
        gc.collect()
        for what, k in log:
            if what == "dropped":
                assert log.index(("synced", k)) < log.index(("dropped", k)), log
        assert {k for what, k in log if what == "issued"} == {k for what, k in log if what == "dropped"}


DIST_SCRIPT = r"""
import os, sys, json, torch, torch.distributed as dist
from loaders import Loader
dist.init_process_group("gloo")
loader = Loader(sys.argv[1], 5, seed=9, columns=["key"])
keys = [k for b in loader for k in b["key"]]
out = [None] * dist.get_world_size()
dist.all_gather_object(out, (loader.rank, loader.world_size, keys))
if dist.get_rank() == 0:
    print(json.dumps(out))
dist.destroy_process_group()
"""


def test_real_torch_distributed_gloo_two_ranks(built, tmp_path):
    script = tmp_path / "dist.py"
    script.write_text(DIST_SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    procs = [subprocess.Popen([sys.executable, str(script), str(built["images"])],
                              env={**env, "RANK": str(r), "WORLD_SIZE": "2"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    import json

    result = json.loads(outs[0][0])
    assert [(r, w) for r, w, _ in result] == [(0, 2), (1, 2)]
    a, b = result[0][2], result[1][2]
    n = len(MMapDataset(built["images"]))
    assert len(a) == len(b) and set(a) | set(b) == {MMapDataset(built["images"])[i]["key"] for i in range(n)}
    assert len(a) + len(b) - n < 2


def test_abandoning_an_epoch_near_its_end_does_not_hang(built, pass_mode):
    """The consumer stops while the producer is handing over the end of the epoch: the next
    pass starts at once (the producer never blocks on a queue nobody reads), from the epoch's
    beginning."""
    import threading

    ds = MMapDataset(built["images"])
    counted = Counted(ds.batch_source())
    loader = Loader(counted, 4, num_threads=1)
    n, seen = len(loader), []

    def epochs():
        for _ in range(3):
            start = counted.made
            it = iter(loader)
            for _ in range(n - 1):
                next(it)
            counted.wait_for(start + (n if pass_mode == "threaded" else n - 1))
            del it  # the producer has made the whole epoch and is handing over its end
            seen.append(sum(len(b["label"]) for b in loader))  # the whole epoch again

    t = threading.Thread(target=epochs, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "abandoning an iterator hung the loader"
    assert seen == [len(ds)] * 3


def test_batched_dataset_resumes_mid_epoch_with_another_worker_count(built):
    ds = MMapDataset(built["images"], columns=["image", "label", "key"])

    def keys(bd, workers):
        dl = torch.utils.data.DataLoader(bd, batch_size=None, num_workers=workers)
        return [tuple(b["key"]) for b in dl]

    bd = ds.batched(6, seed=3)
    bd.set_epoch(2)
    full = keys(bd, 2)
    dl = StatefulDataLoader(ds.batched(6, seed=3), num_workers=2)
    dl.set_epoch(2)
    it = iter(dl)
    assert [tuple(next(it)["key"]) for _ in range(5)] == full[:5]
    state = dl.state_dict()  # the loop took 5 batches, then the job stopped
    assert state["epoch"] == 2 and state["cursor"] == 30
    again = StatefulDataLoader(ds.batched(6, seed=3), num_workers=1)
    again.load_state_dict(state)
    assert [tuple(b["key"]) for b in again] == full[5:]


def test_stateful_dataloader_called_as_torchdatas_is_the_same_loader(built):
    """`StatefulDataLoader(ds, batch_size=6, shuffle=True, seed=3)`, as torchdata's is called, is
    `StatefulDataLoader(ds.batched(6, shuffle=True, seed=3))`: the same batches, the same state;
    a dataset without its batch size, or one batched twice, is a one-line error saying what to give."""
    ds = MMapDataset(built["images"], columns=["key"])
    ours = StatefulDataLoader(ds.batched(6, seed=3, drop_last=True), num_workers=1)
    theirs = StatefulDataLoader(ds, 6, True, seed=3, drop_last=True, num_workers=2)
    assert [tuple(b["key"]) for b in ours] == [tuple(b["key"]) for b in theirs]
    it = iter(theirs)
    next(it)
    again = StatefulDataLoader(ds, batch_size=6, shuffle=True, seed=3, drop_last=True)
    again.load_state_dict(theirs.state_dict())
    assert [tuple(b["key"]) for b in again] == [tuple(b["key"]) for b in it]
    in_order = [k for b in StatefulDataLoader(ds, batch_size=6) for k in b["key"]]  # no shuffle given: as torchdata
    assert in_order == [ds[i]["key"] for i in range(len(ds))]
    windows = TokenWindows(built["text"], 16)
    assert len(StatefulDataLoader(windows, batch_size=4)) == len(BatchedDataset(windows, 4))
    with pytest.raises(ConfigError, match=r"StatefulDataLoader\(ds, batch_size=64\)"):
        StatefulDataLoader(ds)
    with pytest.raises(ConfigError, match="has its batch size and order already"):
        StatefulDataLoader(ds.batched(6), batch_size=6)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_batches_made_here_first_then_in_spawned_workers_are_the_same(built, context):
    """A BatchedDataset that already made batches in this process (its maps opened, their
    addresses noted) pickles as small as a fresh one, and spawned workers open their own maps:
    the maps' bytes went whole into the pickle before, and their addresses are another
    process's."""
    import pickle

    ds = MMapDataset(built["images"], columns=["image", "label", "key"])
    bd = ds.batched(6, shuffle=False)
    here = list(bd)
    assert len(pickle.dumps(bd)) < 100_000
    dl = torch.utils.data.DataLoader(bd, batch_size=None, num_workers=2, multiprocessing_context=context)
    there = list(dl)
    assert [b["key"] for b in there] == [b["key"] for b in here]
    assert all(torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"]) for a, b in zip(here, there))


@pytest.mark.parametrize("num_buffers", [2, 3])
def test_a_held_batch_is_never_refilled(built, num_buffers, pass_mode):
    """The producer runs ahead while the caller holds a batch: the ring must not reuse it."""
    ds = MMapDataset(built["images"])
    counted = Counted(ds.batch_source())
    loader = Loader(counted, 8, seed=5, num_threads=2, num_buffers=num_buffers)
    ids = pass_ids(loader)
    ahead = num_buffers - 1 if pass_mode == "threaded" else 0
    pos = 0
    for k, batch in enumerate(loader, 1):
        counted.wait_for(min(k + ahead, len(loader)))  # the producer has filled every free buffer
        for j in range(len(batch["label"])):
            assert torch.equal(batch["image"][j], ds[int(ids[pos + j])]["image"])
        pos += len(batch["label"])
    assert pos == len(ds)


def test_string_column_gather_keeps_non_ascii_keys(tmp_path):
    """Keys are gathered per batch in one vectorised take; non-ASCII names decode per sample."""
    import shutil

    from bench import data
    import packer

    photos = sorted(data.fetch(data.SKLEARN).glob("*.jpg"))
    names = ["a/plain.jpg", "café/crème brûlée.jpg", "a/after.jpg", "日本/写真.jpg", "a/zz.jpg", "ünï/x.jpg"]
    for i, name in enumerate(names):
        (tmp_path / "raw" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(photos[i % len(photos)], tmp_path / "raw" / name)
    packer.build(tmp_path / "raw", tmp_path / "out", image_size=16, shard_size="2", workers=1)
    ds = MMapDataset(tmp_path / "out")
    assert len(ds.reader.shard_ends) > 1  # the gather crosses shards
    for shuffle, seed in [(False, 0), (True, 1), (True, 2)]:
        loader = Loader(ds, 3, shuffle=shuffle, seed=seed, num_threads=1)
        ids = pass_ids(loader)
        keys = [k for batch in loader for k in batch["key"]]
        assert keys == [ds[int(i)]["key"] for i in ids]
    assert sorted(set(keys)) == sorted(names)


@pytest.mark.parametrize("threads,num_buffers", [(1, 2), (2, 2), (2, 3)])
def test_kept_batches_stay_what_they_were(built, threads, num_buffers, pass_mode):
    """`list(loader)`: every batch equals the per-sample reads of its ids, keys and tensors
    alike, after the whole epoch was gathered; then the ring lets the extra buffers go."""
    ds = MMapDataset(built["images"])
    loader = Loader(ds, 8, seed=2, num_threads=threads, num_buffers=num_buffers)
    ids = pass_ids(loader).tolist()
    batches = list(loader)
    assert sum(len(b["key"]) for b in batches) == len(ds) and len(loader._ring) >= len(batches)
    for k, batch in enumerate(batches):
        for j, i in enumerate(ids[8 * k: 8 * (k + 1)]):
            ref = ds[i]
            assert batch["key"][j] == ref["key"] and batch["label"][j] == ref["label"]
            assert torch.equal(batch["image"][j], ref["image"])
    del batches, batch
    for batch in loader:  # the held buffers are free again: reused, and the spares let go
        pass
    assert len(loader._ring) == num_buffers


def test_a_view_held_one_step_longer_is_not_overwritten(built, pass_mode):
    """Code that keeps the previous batch's labels (or a numpy view of a tensor) for one more
    step: the ring fills another buffer meanwhile."""
    ds = MMapDataset(built["images"], columns=["image", "label"])
    loader = Loader(ds, 4, seed=8, num_threads=2)
    ids = pass_ids(loader).tolist()
    previous, previous_image, seen = None, None, 0
    for batch in loader:
        if previous is not None:
            want = [int(ds[i]["label"]) for i in ids[seen - 4: seen]]
            assert previous.tolist()[:len(want)] == want
            assert np.array_equal(previous_image, ds[ids[seen - 4]]["image"].numpy())
        previous, previous_image = batch["label"][:], batch["image"][0].numpy()
        seen += len(batch["label"])
        del batch


@pytest.mark.parametrize("step_s", [0.0, 0.01])
def test_the_usual_loop_reuses_its_buffers_without_allocating(built, step_s, pass_mode):
    import time

    ds = MMapDataset(built["images"])
    loader = Loader(ds, 4, seed=1, num_threads=2)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            time.sleep(step_s)
    assert len(loader._ring) == loader.num_buffers == 3


def test_token_ids_reach_the_model_as_int64_on_every_path(built):
    """nn.Embedding and cross_entropy take every token batch as it comes, no cast."""
    from loaders import PackedDocuments

    emb, vocab = torch.nn.Embedding(30522, 4), 30522
    text = built["text"]
    ds = MMapDataset(text)

    def check(tokens, targets=None):
        assert tokens.dtype == torch.int64
        out = emb(tokens)
        if targets is not None:
            torch.nn.functional.cross_entropy(out.reshape(-1, 4) @ torch.zeros(4, vocab), targets.reshape(-1))

    check(ds[0]["tokens"])
    check(next(iter(Loader(ds, 3, columns=["tokens"])))["tokens"])
    check(next(iter(torch.utils.data.DataLoader(ds, batch_size=1)))["tokens"])
    check(next(iter(StatefulDataLoader(ds.batched(3, columns=["tokens"]))))["tokens"])
    check(next(iter(StatefulDataLoader(MMapIterableDataset(text, chunk=1, columns=["tokens"]))))["tokens"])
    windows = TokenWindows(text, 32)
    check(*windows[0])
    check(*next(iter(Loader(windows, 4))))
    check(*next(iter(StatefulDataLoader(BatchedDataset(windows, 4), num_workers=1))))
    check(next(iter(Loader(PackedDocuments(text, 128), 2)))["tokens"])
    pairs = MMapDataset(built["pairs"])
    check(next(iter(Loader(pairs, 2, columns=["tokens"])))["tokens"])


def test_stateful_dataloader_follows_epochs_with_persistent_workers_as_loader_does(built):
    """Its workers get (pass, batch) keys from the main process: epochs advance and a loaded
    state takes effect even in workers that live across epochs; the batches are Loader's."""
    ds = MMapDataset(built["images"], columns=["label", "key"])
    ref = Loader(ds, 8, seed=1)
    want = [[tuple(b["key"]) for b in ref] for _ in range(3)]
    assert want[0] != want[1] != want[2]
    dl = StatefulDataLoader(ds.batched(8, seed=1), num_workers=2, persistent_workers=True)
    it = iter(dl)
    got = [[tuple(next(it)["key"]) for _ in range(3)]]
    state = dl.state_dict()
    got[0] += [tuple(b["key"]) for b in it]
    got.append([tuple(b["key"]) for b in dl])
    dl.load_state_dict(state)  # back into epoch 0, in the same live workers
    assert [tuple(b["key"]) for b in dl] == want[0][3:]
    got.append([tuple(b["key"]) for b in dl])  # and on: epoch 1 follows the resumed epoch 0
    assert got == [want[0], want[1], want[1]]


def test_a_plain_dataloader_over_batched_advances_epochs_where_it_can_and_warns_where_it_cannot(built):
    """In this process (no workers) and in persistent workers the dataset object that iterates
    is the one that advances; non-persistent workers start from the main process's object, which
    they cannot advance: a shuffled one that was never given an epoch warns there."""
    import warnings

    from loaders.batched import warn_if_epochs_repeat

    ds = MMapDataset(built["images"], columns=["label", "key"])
    ref = Loader(ds, 8, seed=4)
    want = [[tuple(b["key"]) for b in ref] for _ in range(2)]
    for workers, persistent in ((0, False), (2, True)):
        dl = torch.utils.data.DataLoader(ds.batched(8, seed=4), batch_size=None, num_workers=workers,
                                         persistent_workers=persistent)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = [[tuple(b["key"]) for b in dl] for _ in range(2)]
        assert got == want, (workers, persistent)
    batched = ds.batched(8, seed=4)  # what a non-persistent worker starts from
    with pytest.warns(UserWarning, match="set_epoch"):
        warn_if_epochs_repeat(batched._epochs, batched._epoch_given)
    batched.set_epoch(0)  # the README's loop: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_epochs_repeat(batched._epochs, batched._epoch_given)


def test_the_native_copies_are_built_where_a_c_compiler_is():
    """`pip install` builds loaders/batch/_copy.c with the compiler Python names; without one the
    gather runs in numpy, to the same bytes but slower, so a build that failed quietly would
    show only as speed. MMPACK_NATIVE=0 turns the native copies off."""
    import shutil
    import sysconfig

    from loaders.batch import native

    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None or os.environ.get("MMPACK_NATIVE") == "0":
        pytest.skip(f"no C compiler ({compiler}) on this machine, or the native copies turned off")
    assert native.LIB is not None, "loaders/batch/_copy.c was not built: run pip install -e . again and read its output"
    off = subprocess.run([sys.executable, "-c", "from loaders.batch import native; print(native.LIB is None)"],
                         env={**os.environ, "MMPACK_NATIVE": "0"}, capture_output=True, text=True)
    assert off.stdout.strip() == "True", off.stderr


@settings(max_examples=60, deadline=None)
@given(data=st.data(), threads=st.integers(1, 4), stream=st.booleans(), on_pool=st.booleans())
def test_the_native_copies_equal_numpys_for_any_shapes_ids_and_threads(data, threads, stream, on_pool):
    """`rows_copy` and `canvas_copy` with the native copies and with numpy's: the same bytes, for any
    sample size (odd ones too: rows that straddle cache lines), dtype, shard split, repeated ids
    and thread count, streamed or not, on a C pool or range by range on Python threads. The
    numpy copies are the oracle."""
    from concurrent.futures import ThreadPoolExecutor

    from loaders.batch import native
    from loaders.batch.canvas import canvas_copy
    from loaders.batch.rows import in_shares, rows_copy
    from packer.dataset.reader import ColumnArrays

    if native.LIB is None:
        pytest.skip("the native copies were not built (no C compiler at install time)")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    dtype = np.dtype(data.draw(st.sampled_from(["|u1", "<i2", "<f4", "<f8"])))
    per_shard = data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=4))
    n = data.draw(st.integers(1, 12))
    shard = rng.integers(0, len(per_shard), n)
    rows = np.array([rng.integers(0, per_shard[k]) for k in shard], np.int64)
    order = np.lexsort((rows, shard))
    pool, copiers = ThreadPoolExecutor(threads), native.Pool(threads)

    def run(copy):
        if on_pool and isinstance(copy, native.Job):
            with copiers.running(copy, threads):
                return
        for f in in_shares(copy, n, pool, threads):
            f.result()

    # fixed-shape rows, as the gather of an image column
    shape = data.draw(st.tuples(st.integers(1, 40), st.integers(1, 9), st.sampled_from([1, 3])))
    fixed = [ColumnArrays(rng.integers(0, 100, (m, *shape)).astype(dtype)) for m in per_shard]
    regions = native.regions([a.values for a in fixed])
    want, got = np.full((n, *shape), 7, dtype), np.full((n, *shape), 7, dtype)
    run(rows_copy(want, fixed, None, shard, rows, order))
    saved = native.STREAM_FROM
    native.STREAM_FROM = 0 if stream else 1 << 62
    try:
        run(rows_copy(got, fixed, regions, shard, rows, order))
    finally:
        native.STREAM_FROM = saved
    assert np.array_equal(want, got)
    # ragged images into a canvas
    channels = data.draw(st.sampled_from([1, 3]))
    ragged = []
    for m in per_shard:
        sizes = rng.integers(0, 12, (m, 2))
        samples = [rng.integers(1, 100, (h, w, channels)).astype(dtype) for h, w in sizes]
        lengths = [s.size for s in samples]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        values = np.concatenate([s.reshape(-1) for s in samples]) if sum(lengths) else np.zeros(0, dtype)
        ragged.append(ColumnArrays(values, offsets, np.column_stack([sizes, np.full(m, channels)]).astype(np.int64)))
    regions = native.regions([a.values for a in ragged])
    canvases = []
    for addr in (None, regions):
        fill, out = canvas_copy("x", ragged, addr, shard, rows, order, {}, "test")
        out["x"].fill_(7)  # stale bytes, which the fill must overwrite
        run(fill)
        canvases.append(out)
    assert torch.equal(canvases[0]["x"], canvases[1]["x"]) and torch.equal(canvases[0]["x_size"], canvases[1]["x_size"])


def test_a_forked_child_gathers_without_its_parents_copy_threads(built):
    """A process forked from one whose Loader has a pool of C copy threads has none of those
    threads, and its copy of the pool's locks may be held (the fork came mid-batch): its
    gathers copy by themselves, the same bytes, and do not hang. A pool that was shut down
    does the same."""
    import signal
    import threading
    import time

    from loaders.batch import native

    if native.LIB is None:
        pytest.skip("the native copies were not built (no C compiler at install time)")
    ds = MMapDataset(built["images"], columns=["image", "label"])
    loader = Loader(ds, 7, seed=3, num_threads=2)
    ids = pass_ids(loader)[:7]
    assert isinstance(loader._pool_of(2), native.Pool)  # made at the first pass, or here
    stop = threading.Event()

    counted = Counted(loader.source)  # the children gather from the source itself

    def busy():  # gathers on the pool the whole time, so that the fork comes mid-job
        buffers = counted.alloc(7, "plain")
        while not stop.is_set():
            counted.gather(ids, buffers, loader._pool, 2)

    thread = threading.Thread(target=busy)
    thread.start()
    counted.wait_for(2)  # the pool is at work
    try:
        children = []
        for _ in range(5):
            pid = os.fork()
            if pid == 0:  # the child: the same gather, on the inherited pool object
                ok = False
                try:
                    buffers = loader.source.alloc(7, "plain")
                    batch = loader.source.gather(ids, buffers, loader._pool, 2)
                    ok = all(torch.equal(batch["image"][j], ds[int(i)]["image"]) for j, i in enumerate(ids))
                finally:
                    os._exit(0 if ok else 1)
            children.append(pid)
            time.sleep(0.003)
    finally:
        stop.set()
        thread.join()
    deadline = time.monotonic() + 20
    for pid in children:
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            for p in children:
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)
            pytest.fail("a forked child's gather hung")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    loader._pool.shutdown()
    ids = pass_ids(loader)
    seen = 0
    for batch in loader:  # an epoch on a pool that was shut down
        for j in range(len(batch["label"])):
            assert torch.equal(batch["image"][j], ds[int(ids[seen])]["image"])
            seen += 1
    assert seen == len(ds)


EXITS_MID_BATCH = """
import sys
import numpy as np
from loaders import Loader, MMapDataset
loader = Loader(MMapDataset(sys.argv[1]), 4, num_threads=1)
gather, small = loader.source.gather, np.arange(256) % 8
def busy_gather(*args, **kwargs):  # the producer inside numpy's C++ (GIL released) most of the time
    for _ in range(3000):
        np.unique(small)
    return gather(*args, **kwargs)
loader.source.gather = busy_gather
it = iter(loader)
next(it)
next(it)  # and exit, the next batches being made
"""


def test_a_script_that_exits_while_batches_are_being_made_ahead_exits_cleanly(built, tmp_path):
    """Python ends daemon threads at exit when they next take the GIL, by a forced unwind that
    aborts the process if it passes C++ code that had released the GIL (numpy's unique): the
    Loader stops its producers before that. Without it, 5 of 6 such runs aborted (exit 134,
    'terminate called without an active exception')."""
    script = tmp_path / "peek.py"
    script.write_text(EXITS_MID_BATCH)
    for _ in range(3):
        res = subprocess.run([sys.executable, str(script), str(built["images"])], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0 and "terminate" not in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("make", ["Loader", "StatefulDataLoader"])
def test_a_peek_or_a_break_costs_the_next_pass_nothing(built, make, pass_mode):
    """`next(iter(loader))` to see the shapes, then the README's loop: epoch 0 trains on every
    sample; a `break` out of an evaluation pass leaves the next evaluation whole. Only a loaded
    state resumes mid-epoch (as with torch's DataLoader and torchdata's StatefulDataLoader)."""
    ds = MMapDataset(built["images"], columns=["image", "label", "key"])

    def new():
        if make == "Loader":
            return Loader(ds, 8, seed=1, num_threads=2)
        return StatefulDataLoader(ds.batched(8, seed=1), num_workers=0)

    loader = new()
    peek = next(iter(loader))
    assert peek["image"].shape[1:] == ds[0]["image"].shape
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append(sorted(k for b in loader for k in b["key"]))
    assert epochs == [sorted(ds[i]["key"] for i in range(len(ds)))] * 2
    evaluation = new()
    for b in evaluation:
        break
    assert sum(len(b["key"]) for b in evaluation) == len(ds)
    # a state saved mid-epoch still resumes there, in a loader built like it
    it = iter(evaluation)
    done = [k for _ in range(3) for k in next(it)["key"]]
    state = evaluation.state_dict()
    again = new()
    again.load_state_dict(state)
    rest = [k for b in again for k in b["key"]]
    assert sorted(done + rest) == sorted(ds[i]["key"] for i in range(len(ds)))
    assert len(again) == -(-len(ds) // 8)  # the resumed pass is over: the next is whole
    # passes cut short without set_epoch (a step budget per "epoch") draw a new order each time,
    # as a shuffled DataLoader's iterators do: the same first batches every time would train on
    # a fixed subset of the data
    short = new()
    firsts = []
    for _ in range(3):
        for i, batch in enumerate(short):
            if i == 2:
                break
            firsts.append(tuple(batch["key"]))
    assert len(set(firsts)) == len(firsts) == 6


def test_a_dropped_loader_frees_its_buffers_without_the_garbage_collector(built, monkeypatch):
    """No reference cycle keeps a dropped Loader (its ring of batch buffers, hundreds of MB for
    keep-aspect canvases) or its dataset's reader lock alive until the cyclic GC runs; close()
    and `with` free them at once, and a pass left open then ends with an error, not a hang."""
    import gc
    import weakref

    from loaders import loader as batches
    from packer.errors import ConfigError

    monkeypatch.setattr(batches, "INLINE_BELOW_BYTES", 0)  # a producer thread, whose pass close() stops
    gc.collect()
    gc.disable()
    try:
        ds = MMapDataset(built["images"])
        loader = Loader(ds, 8, num_threads=2)
        it = iter(loader)
        next(it)  # a pass left open: its producer is running
        del it
        for _ in loader:
            pass
        ref, reader = weakref.ref(loader), weakref.ref(ds.reader)
        del loader, ds
        assert ref() is None and reader() is None
        with Loader(MMapDataset(built["images"]), 8) as loader:
            keys = [k for b in loader for k in b["key"]]
            it = iter(loader)
            next(it)
        assert loader._ring is None and loader._pool is None and not loader._running
        with pytest.raises(ConfigError, match="closed while the pass was open"):
            for _ in it:
                pass
        assert [k for b in loader for k in b["key"]] != keys  # usable again: the next epoch
    finally:
        gc.enable()


@pytest.mark.parametrize("call,match", [
    (lambda ds: Loader(ds, 4, seed="x"), "seed must be an int"),
    (lambda ds: Loader(ds, 4, seed=2**64), "seed must be a non-negative int below 2\\*\\*64"),
    (lambda ds: Loader(ds, 4, seed=-1), "seed must be a non-negative int"),
    (lambda ds: Loader(ds, True), "batch_size must be an int"),
    (lambda ds: Loader(ds, 0), "batch_size must be an int >= 1"),
    (lambda ds: Loader(ds, 4, num_threads=0), "num_threads 0 is outside"),
    (lambda ds: Loader(ds, 4, num_buffers=1), "num_buffers 1 is outside"),
    (lambda ds: Loader(ds, 4).set_epoch(-1), "epoch must be a non-negative int"),
    (lambda ds: Loader(ds, 4).set_epoch(None), "epoch must be an int, not NoneType"),
    (lambda ds: Loader(ds, 4).set_epoch(2**64), "epoch must be a non-negative int below"),
    (lambda ds: ds.batched(4).set_epoch(1.5), "epoch must be an int, not float"),
    (lambda ds: Loader(torch.utils.data.TensorDataset(torch.zeros(4)), 2), "not TensorDataset"),
    (lambda ds: Loader(ds, 4).load_state_dict({**Loader(ds, 4).state_dict(), "cursor": True}), "cursor True"),
    (lambda ds: Loader(ds, 4).load_state_dict({**Loader(ds, 4).state_dict(), "epoch": 2**64}), "epoch"),
])
def test_bad_arguments_and_states_are_one_line_config_errors(built, call, match):
    """cursor=True was taken as 1 (a sample skipped), epochs and seeds of 2**64 wrapped onto
    smaller ones' orders, set_epoch(-1) was taken and its state then refused, and a seed of the
    wrong type or a TensorDataset gave foreign errors."""
    from packer.errors import ConfigError

    ds = MMapDataset(built["images"])
    with pytest.raises(ConfigError, match=match):
        call(ds)


def test_ranks_in_block_order_read_each_sample_once_an_epoch_and_keep_their_blocks(tmp_path, minilm):
    """From the user's side: 3 ranks' Loaders in block order over 3,000 documents (two blocks of
    1,024 and a tail, cut in three parts inside blocks). Every epoch each key comes once over
    the ranks; each rank reads the same keys every epoch, in another order; rank 0's state taken
    mid-epoch resumes on 2 ranks and they read the rest of the epoch once."""
    import json

    from packer.cli import main

    (tmp_path / "raw").mkdir()
    with open(tmp_path / "raw" / "docs.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": f"document {i}"}) + "\n" for i in range(3000))
    assert main(["build", str(tmp_path / "raw"), str(tmp_path / "out"), "--tokenizer", str(minilm), "-q"]) == 0
    ds = MMapDataset(tmp_path / "out", columns=["key"])
    everything = sorted(ds[i]["key"] for i in range(len(ds)))

    def keys(loader, batches=None):
        import itertools

        return [k for batch in itertools.islice(loader, batches) for k in batch["key"]]
    loaders = [Loader(ds, 16, seed=3, order="block", rank=r, world_size=3) for r in range(3)]
    read = []
    for epoch in range(2):
        for loader in loaders:
            loader.set_epoch(epoch)
        read.append([keys(loader) for loader in loaders])
        assert sorted(k for part in read[-1] for k in part) == everything
    assert [set(p) for p in read[0]] == [set(p) for p in read[1]] and read[0] != read[1]
    for loader in loaders:
        loader.set_epoch(2)
    taken = [keys(loader, 20) for loader in loaders]  # 20 batches each, then a checkpoint
    state = loaders[0].state_dict()
    rest = []
    for r in range(2):
        resumed = Loader(ds, 16, seed=3, order="block", rank=r, world_size=2)
        resumed.load_state_dict(state)
        rest += keys(resumed)
    assert state["cursor"] == 20 * 16 * 3
    assert sorted([k for part in taken for k in part] + rest) == everything
