"""Cache limits (packer.remote.limits): too small a limit is refused saying what it needs, a block
window over it is a warning, and a node's ranks share it."""

from __future__ import annotations

import multiprocessing

import pytest

from loaders import Loader, MMapDataset
from packer.cli import main
from packer.errors import ConfigError

from .remote import NEEDS_SERVER, _bytes_on_disk, _read_all, _shard_bytes, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


def test_too_small_a_cache_limit_is_refused_saying_what_it_needs(s3, built, tmp_path):
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    with pytest.raises(ConfigError, match="must hold .* its largest shard"):
        MMapDataset(url, cache_limit="10KB")
    ds = MMapDataset(url, cache_limit=_shard_bytes(built["images"]) * 2 // 5)
    with pytest.raises(ConfigError, match="order='block'"):  # a random batch of 32 reads every shard
        Loader(ds, 32, seed=1)
    with pytest.raises(ConfigError, match="order='block'"):
        ds.batched(32, seed=1)
    with pytest.raises(ConfigError, match="never a cache"):
        MMapDataset(built["images"], cache_limit="1GB")
    with pytest.raises(ConfigError, match="cache_limit"):
        MMapDataset(url, cache_limit="lots")


def test_a_block_window_over_the_cache_limit_is_a_warning_naming_the_window_that_fits(s3, built, tmp_path):
    """Block order's batches draw from every shard of their window: a window whose shards the
    limit cannot hold would be fetched many times an epoch. Said once when the Loader is made,
    with the limit and the block_window that would do; with that window, nothing is said, and the
    epoch fetches each shard once."""
    import warnings

    from packer.remote.cache import ShardCache

    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    local = MMapDataset(built["images"])
    biggest = max(s.size_bytes for s in local.manifest.shards)
    ds = MMapDataset(url, cache_dir=tmp_path / "window", cache_limit=ShardCache(url, tmp_path / "x", local.manifest)
                     .index_bytes + 3 * biggest)
    with pytest.warns(UserWarning, match=r"block order's window of 8,192 samples reads shards of .* MB over and over"
                      r".* raise cache_limit by .* pass block_window=\d+$") as said:
        Loader(ds, 2, seed=1, order="block")
    window = int(str(said[0].message).rsplit("=", 1)[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = Loader(ds, 2, seed=1, order="block", block_window=window)
        keys = [k for batch in loader for k in batch["key"]]
    assert sorted(keys) == sorted(local[i]["key"] for i in range(len(local)))
    assert ds.bytes_downloaded <= 1.2 * sum(s.size_bytes for s in local.manifest.shards)
    with pytest.raises(ConfigError, match="block_window"):
        Loader(ds, 2, seed=1, block_window=2)  # random order has no window


def test_processes_sharing_a_limited_cache_read_everything_within_it(s3, built, tmp_path, monkeypatch):
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    limit, cache = _shard_bytes(built["images"]), tmp_path / "shared"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on this node: each takes half the limit
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_read_all, args=(url, str(cache), limit, out)) for _ in range(2)]
    for p in procs:
        p.start()
    keys = [out.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(60)
    local = MMapDataset(built["images"])
    assert keys == [[local[i]["key"] for i in range(len(local))]] * 2
    assert _bytes_on_disk(cache) <= limit, sorted((str(p), p.stat().st_size) for p in cache.rglob("*") if p.is_file())
