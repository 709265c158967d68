"""Reads finer than a shard (packer.remote.rows, its block lists packer.remote.blocks): a batch's
rows by ranged GETs under a limit below the dataset or below a shard, each block checked."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from loaders import Loader, MMapDataset
from packer.cli import main
from packer.dataset import format as fmt
from packer.errors import ConfigError, IntegrityError

from .remote import NEEDS_SERVER, _bytes_on_disk, _killed_reader, _shard_bytes, _through_proxy, _url, photo_rows

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


@pytest.fixture(scope="module")
def rows_48k(tmp_path_factory):
    """Photos of 128 x 128 (rows of 49,152 bytes, 48 KiB: a block each, so read by rows) in 16 shards of 8."""
    return photo_rows(tmp_path_factory.mktemp("rows48k"), 128, 128)


def test_random_order_at_a_third_of_the_dataset_reads_its_rows_by_range_within_the_limit(s3, large_rows, tmp_path,
                                                                                        monkeypatch):
    """A random batch reads every shard, so whole shards under a limit of a third were refused (or
    fetched the dataset many times an epoch): the rows come by ranged GETs of their blocks, each
    checked against the file's block list, about the dataset once an epoch as counted by a proxy,
    and the batches are the local ones, in a Loader and in forked DataLoader workers."""
    url = _url(tmp_path, "rows")
    assert main(["push", str(large_rows), url]) == 0
    local, total = MMapDataset(large_rows), _shard_bytes(large_rows)
    fixed = MMapDataset(url, cache_dir=tmp_path / "other")._cache.index_bytes
    limit, cache = fixed + total * 3 // 10, tmp_path / "third"
    proxy = _through_proxy(s3, monkeypatch)
    try:
        ds = MMapDataset(url, cache_dir=cache, cache_limit=limit)
        for epoch in range(2):
            before = proxy.body_bytes
            for a, b in zip(Loader(ds, 16, seed=3), Loader(local, 16, seed=3), strict=True):
                assert a["key"] == b["key"] and torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
                assert _bytes_on_disk(cache) <= limit
            assert (proxy.body_bytes - before) / total <= 1.2, (epoch, (proxy.body_bytes - before) / total)
        assert ds.traffic["gets"] > 2 * len(local) // 16  # ranges, not shards
        # forked DataLoader workers (their requests through the helper) read by rows too
        from loaders import StatefulDataLoader

        got = StatefulDataLoader(ds.batched(16, seed=3), num_workers=2, multiprocessing_context="fork", timeout=120)
        for a, b in zip(got, Loader(local, 16, seed=3), strict=True):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
        assert _bytes_on_disk(cache) <= limit
    finally:
        proxy.close()


def test_a_random_epoch_at_40_percent_through_a_cache_holding_whole_shards_completes_within_the_limit(
        s3, rows_48k, tmp_path, monkeypatch):
    """A random epoch under a limit of 40% reads its batches by rows, and maps whole the shards the
    cache holds already (left by an earlier pass in order, or by samples read by index). A batch's
    rows took their room first, evicting present shards the same batch was to map, which it then
    fetched again whole into a cache its own rows held: it waited 120 s for "other processes" (there
    were none) and failed. The epoch completes, its batches the local ones, within the limit, at
    most 1.2x the dataset over the link."""
    from packer.remote import cache as cache_module

    monkeypatch.setattr(cache_module, "WAIT_FOR_ROOM_S", 5)  # (a wait for room that never comes fails sooner)
    url = _url(tmp_path, "rows48k")
    assert main(["push", str(rows_48k), url]) == 0
    local, total = MMapDataset(rows_48k), _shard_bytes(rows_48k)
    assert len(local.manifest.shards) == 16 and local[0]["image"].numel() == 48 * 1024
    limit = MMapDataset(url, cache_dir=tmp_path / "other")._cache.index_bytes + total * 4 // 10
    proxy = _through_proxy(s3, monkeypatch)
    try:
        for warm in ("in order", "by index"):
            cache = tmp_path / warm.replace(" ", "-")
            ds = MMapDataset(url, cache_dir=cache, cache_limit=limit)
            if warm == "in order":
                for a, b in zip(Loader(ds, 32, shuffle=False), Loader(local, 32, shuffle=False), strict=True):
                    assert a["key"] == b["key"]
            else:
                assert all(torch.equal(ds[i]["image"], local[i]["image"]) for i in range(0, len(local), 16))
            assert sum(ds.reader.cache.present(k) for k in range(16)) >= 4, warm  # whole shards held
            before = proxy.body_bytes
            for a, b in zip(Loader(ds, 32, seed=0), Loader(local, 32, seed=0), strict=True):
                assert a["key"] == b["key"] and torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
                assert _bytes_on_disk(cache) <= limit
            assert (proxy.body_bytes - before) / total <= 1.2, (warm, (proxy.body_bytes - before) / total)
    finally:
        proxy.close()


def test_a_limit_below_one_shard_reads_batches_by_rows(s3, large_rows, tmp_path):
    """Reads by rows need room for a batch's rows, not a shard: a limit below the largest shard
    opens (it was refused) and a Loader and ds.batched give the local batches within it; a read
    that needs a whole shard (a sample by index) is the one-line refusal."""
    url = _url(tmp_path, "rows")
    assert main(["push", str(large_rows), url]) == 0
    local, cache = MMapDataset(large_rows), tmp_path / "small"
    fixed = MMapDataset(url, cache_dir=tmp_path / "other")._cache.index_bytes
    limit = fixed + max(s.size_bytes for s in local.manifest.shards) * 2 // 3
    ds = MMapDataset(url, cache_dir=cache, cache_limit=limit)
    for a, b in zip(Loader(ds, 4, seed=2), Loader(local, 4, seed=2), strict=True):
        assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
        assert _bytes_on_disk(cache) <= limit
    for a, b in zip(ds.batched(4, shuffle=False), local.batched(4, shuffle=False), strict=True):
        assert torch.equal(a["image"], b["image"])
    with pytest.raises(ConfigError, match="cache_limit .* too small"):
        ds[0]


def test_a_reader_by_rows_killed_at_any_instant_leaves_nothing_a_later_reader_would_use(s3, large_rows, tmp_path):
    """A scratch is its process's own: killed mid-fetch, it is never read by another, and the
    next count of the entry removes it and its bytes."""
    from packer.remote.rows import SCRATCH

    url = _url(tmp_path, "rows")
    assert main(["push", str(large_rows), url]) == 0
    local, cache = MMapDataset(large_rows), tmp_path / "killed"
    limit = MMapDataset(url, cache_dir=tmp_path / "other")._cache.index_bytes + _shard_bytes(large_rows) * 3 // 10
    for delay in (0.0, 0.05, 0.2):
        pid = _killed_reader(url, cache, limit, 16, "random", delay)
        ds = MMapDataset(url, cache_dir=cache, cache_limit=limit)
        for a, b in zip(Loader(ds, 16, seed=7), Loader(local, 16, seed=7), strict=True):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
            assert _bytes_on_disk(cache) <= limit
        with ds.reader.cache.accounting() as ledger:
            ledger.recount()  # what a reader that finds no room does: the dead scratch goes
            assert ledger.used == ds.reader.cache.usage()
        assert not [p for p in cache.rglob(f"{SCRATCH}/*") if str(pid) in p.name]


def test_a_cold_first_batch_waits_for_its_rows_not_every_shard_it_touches(s3, large_rows, tmp_path, monkeypatch):
    """The first batch of a pass (here a gather's first, without the fetch ahead that a Loader or
    `ds.batched` runs beside it) touches most shards: it comes by ranged reads of its rows (and its
    shards' small files), far less than the dataset; the next batches come in whole shards."""
    from packer.remote import residency

    monkeypatch.setattr(residency, "COLD_ROWS_BYTES", 0)  # a dataset of 3.5 MB stands for a large one
    url = _url(tmp_path, "rows")
    assert main(["push", str(large_rows), url]) == 0
    local, total = MMapDataset(large_rows), _shard_bytes(large_rows)
    keys = [k for b in Loader(local, 8, shuffle=False) for k in b["key"]]
    ids = np.random.default_rng(4).permutation(len(local))[:8]
    proxy = _through_proxy(s3, monkeypatch)
    try:
        ds = MMapDataset(url, cache_dir=tmp_path / "cold")
        gather = ds.batch_source()
        first = gather.gather(ids, gather.alloc(8, "plain"))
        assert first["key"] == [keys[i] for i in ids] and torch.equal(first["image"], local.batch_source().gather(
            ids, local.batch_source().alloc(8, "plain"))["image"])
        touched = {ds.reader.locate(int(i))[0] for i in ids}
        assert len(touched) >= 4 and proxy.body_bytes < total / 4, (touched, proxy.body_bytes / total)
        assert not any(ds.reader.cache.present(k) for k in touched)
        second = gather.gather(ids, gather.alloc(8, "plain"))  # then whole shards, as before
        assert second["key"] == first["key"] and all(ds.reader.cache.present(k) for k in touched)
        for a, b in zip(ds.batched(8, seed=4), local.batched(8, seed=4), strict=True):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
    finally:
        proxy.close()


def test_a_damaged_range_is_fetched_again_then_refused_naming_the_object_and_a_damaged_list_reads_whole(
        s3, large_rows, tmp_path, monkeypatch):
    """A block whose bytes do not match its list is fetched once more, then an IntegrityError
    names the object; a block list that does not match the manifest is not used (the file comes
    whole, verified as before)."""
    from packer.remote import client, residency

    monkeypatch.setattr(residency, "COLD_ROWS_BYTES", 0)  # a first batch by rows, as of a large dataset
    from packer.remote.url import Remote

    url = _url(tmp_path, "rows")
    assert main(["push", str(large_rows), url]) == 0
    local = MMapDataset(large_rows)
    image = next(f for f in local.manifest.shards[0].files if f.path.endswith("image.npy"))
    remote = Remote(url)
    store, obs = client.store(remote), client.obstore(remote)
    data = bytearray((large_rows / image.path).read_bytes())
    data[fmt.NPY_HEADER_BYTES + 5] ^= 0x01  # in the first row, its size kept
    obs.put(store, remote.key(image.path), bytes(data))
    ds = MMapDataset(url, cache_dir=tmp_path / "c")
    with pytest.raises(IntegrityError, match=f"{image.path}: bytes 128 to .* do not match its block list"):
        next(iter(ds.batched(4, shuffle=False)))
    assert main(["push", str(large_rows), url]) == 0  # repaired
    listed = bytearray(bytes(obs.get(store, remote.key(image.path + ".blocks")).bytes()))
    listed[20] ^= 0xFF
    obs.put(store, remote.key(image.path + ".blocks"), bytes(listed))
    ds = MMapDataset(url, cache_dir=tmp_path / "d")
    got, want = next(iter(ds.batched(4, shuffle=False))), next(iter(local.batched(4, shuffle=False)))
    assert torch.equal(got["image"], want["image"])
    assert ds.traffic["bytes"] >= image.size_bytes  # the file came whole
