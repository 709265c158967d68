"""Fetching ahead (loaders.lookahead): the shards of a pass's coming batches come before the
gather asks, and a cold first batch is waited out without spinning."""

from __future__ import annotations

import time

import numpy as np
import torch

from loaders import MMapDataset
from packer.cli import main

from .remote import NEEDS_SERVER, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


def test_the_fetch_ahead_waits_out_a_cold_first_batch_without_spinning():
    """While a pass's first batch reads its rows the fetch ahead waits, and the gather moving on
    (`at`, each batch) must not turn that wait into a busy loop: it would hold the GIL from the
    very gather it waits for (it made a first batch of 54 shards take 9 s instead of about 1)."""
    from loaders.lookahead import Lookahead
    from packer.remote.residency import Residency

    gather = Residency([], np.zeros(0, np.int64), [], lambda g: None)  # of no shards: its first batch never ends
    ahead = Lookahead(gather, lambda b: np.zeros(0, np.int64), lambda b: b < 4)
    waits, wait = [], ahead._wake.wait
    ahead._wake.wait = lambda timeout=None: waits.append(1) or wait(timeout)
    try:
        ahead.at(1)
        time.sleep(0.3)
        assert gather.cold and ahead._thread.is_alive()
        assert len(waits) < 100, f"{len(waits)} wakes in 0.3 s: the wait spins"
    finally:
        gather.cold = False
        ahead.close()


def test_ds_batched_over_a_url_fetches_its_coming_batches_shards_ahead(s3, large_rows, tmp_path):
    """`ds.batched` (what a DataLoader or StatefulDataLoader iterates) fetches the shards of its
    worker's coming batches ahead, as Loader does: shards the pass reads later arrive while it
    still waits at its first batch."""
    url = _url(tmp_path, "rows")
    assert main(["push", str(large_rows), url]) == 0
    local = MMapDataset(large_rows)
    ds = MMapDataset(url, cache_dir=tmp_path / "c")
    got, want = iter(ds.batched(8, shuffle=False)), iter(local.batched(8, shuffle=False))
    first = next(got)
    assert first["key"] == next(want)["key"]
    cache, last = ds.reader.cache, len(local.manifest.shards) - 1
    deadline = time.monotonic() + 60
    while not cache.present(last) and time.monotonic() < deadline:  # the pass's last shard, not asked for yet
        time.sleep(0.05)
    assert cache.present(last)
    for a, b in zip(got, want, strict=True):
        assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
    # and StatefulDataLoader's workers, which are handed keyed batches in the same round-robin
    from loaders import StatefulDataLoader

    ds = MMapDataset(url, cache_dir=tmp_path / "workers")
    got = iter(StatefulDataLoader(ds.batched(8, shuffle=False), num_workers=1, multiprocessing_context="fork",
                                  timeout=120))
    assert next(got)["key"] == first["key"]
    deadline = time.monotonic() + 60
    while not ds.reader.cache.present(last) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ds.reader.cache.present(last)
    del got


def test_a_gather_dropped_is_freed_at_once_its_residency_holding_it_weakly():
    """The residency tells its gather of each shard that comes or goes through the gather's own
    method, held weakly: a gather dropped mid-pass (its maps, and its reads by rows whose scratch
    goes with their object) is freed then, not whenever the garbage collector next runs."""
    import gc
    import weakref

    from packer.remote.residency import Residency

    class Gather:
        def __init__(self):
            self.residency, self.told = Residency([], np.zeros(0, np.int64), [], self.remap), []

        def remap(self, g):
            self.told.append(g)

    gc.disable()
    try:
        gather = Gather()
        gather.residency.changed(3)
        assert gather.told == [3]
        alive = weakref.ref(gather)
        del gather
        assert alive() is None
    finally:
        gc.enable()


def test_the_newest_pass_owns_the_order_eviction_follows_and_an_earlier_ones_end_leaves_it():
    """A pass's lookahead starts from an empty window (a forked worker's residency holds its
    parent's), and while an earlier pass's iterator is still open the newest pass's order is the
    one kept: the earlier one's news and its end change nothing."""
    from packer.remote.residency import Residency

    held = Residency([], np.zeros(0, np.int64), [], lambda g: None)
    old, new = object(), object()
    held.follow(old)
    held.ahead(old, frozenset({1}), {1: 0})
    held.follow(new)
    assert held.next_use(1) == float("inf")  # a new pass: nothing known ahead yet
    held.ahead(old, frozenset({2}), {2: 0})  # the earlier pass's thread, still running
    held.ahead(new, frozenset({3}), {3: 5})
    held.unfollow(old)
    assert held.next_use(3) == 5 and held.next_use(2) == float("inf")
    held.unfollow(new)
    assert held.next_use(3) == float("inf")
