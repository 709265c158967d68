"""One limit over a whole cache dir (packer.remote.cachedir): stale builds go, entries a process
has open stay."""

from __future__ import annotations

import multiprocessing


from loaders import MMapDataset
from packer.cli import main
from packer.dataset import format as fmt

from .remote import NEEDS_SERVER, _bytes_on_disk, _read_all, _same_batches, _shard_bytes, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


def test_one_limit_bounds_the_whole_cache_dir_stale_builds_go_open_ones_stay(s3, built, tmp_path):
    """A URL pushed again (a new build: a new cache entry) under one cache_limit: the entries no
    process has open go, the least recently opened first, so the cache dir stays within the
    limit however many builds came; an entry a process has open stays."""
    url, cache = _url(tmp_path, "nightly"), tmp_path / "c"
    images, pairs = _shard_bytes(built["images"]), _shard_bytes(built["pairs"])
    limit = images + pairs // 2  # both builds whole do not fit
    ctx = multiprocessing.get_context("spawn")
    for k in ("pairs", "images", "pairs"):  # each push a new build at the URL
        assert main(["push", str(built[k]), url]) == 0
        out = ctx.Queue()
        reader = ctx.Process(target=_read_all, args=(url, str(cache), limit, out))
        reader.start()
        keys = out.get(timeout=180)
        reader.join(60)
        local = MMapDataset(built[k])
        assert keys == [local[i]["key"] for i in range(len(local))]
        assert _bytes_on_disk(cache) <= limit, sorted((str(p), p.stat().st_size) for p in cache.rglob("*") if p.is_file())
    assert len([e for e in cache.glob("*/*") if e.is_dir()]) <= 2
    kept = MMapDataset(url, cache_dir=cache, cache_limit=limit)  # open in this process: held
    _same_batches(kept, MMapDataset(built["pairs"]))
    held = kept.reader.root
    assert main(["push", str(built["images"]), url]) == 0
    fresh = MMapDataset(url, cache_dir=cache, cache_limit=limit)  # in what the held entry leaves
    _same_batches(fresh, MMapDataset(built["images"]), shuffle=False)
    assert held.is_dir() and (held / fmt.MANIFEST_NAME).is_file()
    _same_batches(kept, MMapDataset(built["pairs"]))  # and still reads
