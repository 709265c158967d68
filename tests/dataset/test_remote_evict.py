"""Eviction from a cache entry (packer.remote.evict): by next use across an epoch's end, and another
process's least recently used shards before this one's own."""

from __future__ import annotations

import os

import torch

from loaders import Loader, MMapDataset
from packer.cli import main

from .remote import NEEDS_SERVER, _shard_bytes, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


def test_a_sequential_order_at_half_the_dataset_fetches_about_half_of_it_each_epoch(s3, tmp_path):
    """Eviction by next use across the epoch's end: beyond what the lookahead sees, the shard
    read last goes first (in a cyclic order it is read last again), and a limited cache fetches
    only the next few batches ahead, so it keeps the next epoch's first shards; evicting the
    oldest, behind a window of half the cache, fetched the whole dataset every epoch."""
    from bench import data

    raw, out = tmp_path / "raw", tmp_path / "many"  # many shards, each a few batches: as large datasets are
    data.make_image_folders(raw, 200, seed=3, max_side=64)
    assert main(["build", str(raw), str(out), "--image-size", "16", "--shard-size", "4", "-q"]) == 0
    url = _url(tmp_path, "images")
    assert main(["push", str(out), url]) == 0
    local, total = MMapDataset(out), _shard_bytes(out)
    fixed = MMapDataset(url, cache_dir=tmp_path / "other")._cache.index_bytes
    ds = MMapDataset(url, cache_dir=tmp_path / "half", cache_limit=fixed + total // 2)
    shares = []
    for epoch in range(4):
        before = ds.bytes_downloaded
        for a, b in zip(Loader(ds, 1, shuffle=False), Loader(local, 1, shuffle=False), strict=True):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
        shares.append((ds.bytes_downloaded - before) / total)
    assert shares[0] <= 1.05 and all(s <= 0.6 for s in shares[1:]), shares


def test_eviction_takes_another_processs_least_recently_used_shard_and_its_own_most_recent(s3, built, tmp_path):
    """Two readers of one node's cache (two ShardCaches: their pins are separate open files, as
    two processes' are). Beyond what a reader's order shows, another reader's shards go least
    recently used first (in block order it reads its last ones again within its window: taking
    its most recent made each node fetch 1.3-1.5x its share an epoch at a quarter of it), and
    the reader's own most recently used first (an order that goes round uses it last again)."""
    from packer.remote.cache import ShardCache

    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    manifest = MMapDataset(built["images"]).manifest
    root = tmp_path / "node"
    probe = ShardCache(url, root, manifest)
    sizes = probe.sizes  # each shard's data files (its index files are held apart)
    shard = sorted(range(len(sizes)), key=lambda k: sizes[k])[-5:]  # the largest last: any one evicted makes room
    least = min(sizes[k] for k in shard[:4])
    limit = probe.index_bytes + sum(sizes[k] for k in shard) - least + 1  # room for four, one short of five
    other, me = ShardCache(url, root, manifest, limit), ShardCache(url, root, manifest, limit)
    for k in range(4):
        other.acquire(shard[k])
        stamp = 1_000_000_000 * (k + 1)  # used in the order 0, 1, 2, 3
        os.utime(other.shard_dir(shard[k]) / ".pin", ns=(stamp, stamp))
    other.release_all()
    me.acquire(shard[4])  # room for one: another reader's least recently used goes
    assert [other.present(shard[k]) for k in range(5)] == [False, True, True, True, True]
    for k in (4, 1):  # now two of its own, used 4 then 1
        me.acquire(shard[k])
        stamp = 10_000_000_000 + 1_000_000_000 * k * (k == 1)
        os.utime(me.shard_dir(shard[k]) / ".pin", ns=(stamp, stamp))
    me.release_all()
    other.acquire(shard[0])  # to the other reader, 4 is another's (1, 2, 3 its own): 4 goes before its own
    assert [me.present(shard[k]) for k in range(5)] == [True, True, True, True, False]
