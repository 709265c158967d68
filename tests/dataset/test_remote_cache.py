"""The node-local cache of a dataset in object storage (packer.remote.cache, its ledger and part
files): a limit held over epochs, a filled read-only cache, readers killed at any instant, and a
limited reader that never holds up another."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from loaders import Loader, MMapDataset
from packer.cli import main

from ..trees import tree
from .remote import NEEDS_SERVER, _bytes_on_disk, _killed_reader, _same_batches, _shard_bytes, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


def test_a_cache_limit_below_the_dataset_holds_for_three_epochs_and_gives_the_local_batches(s3, built, tmp_path):
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    before, total = tree(built["images"]), _shard_bytes(built["images"])
    limit, cache = total * 2 // 5, tmp_path / "limited"
    ds, local = MMapDataset(url, cache_dir=cache, cache_limit=limit), MMapDataset(built["images"])
    for epoch in range(3):
        batches = 0
        for a, b in zip(Loader(ds, 8, shuffle=False, num_threads=2), Loader(local, 8, shuffle=False)):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
            assert _bytes_on_disk(cache) <= limit
            batches += 1
        assert batches == -(-len(local) // 8)
    # each shard about once an epoch (this order reads them in turn; the next epoch's first
    # shards are fetched at the end of this one)
    assert ds.bytes_downloaded <= 3 * 1.1 * total
    for i in range(0, len(local), 7):  # sample by sample too, one shard mapped at a time
        assert ds[i]["key"] == local[i]["key"]
        assert _bytes_on_disk(cache) <= limit
    assert tree(built["images"]) == before  # nothing outside the cache is touched


def test_a_filled_cache_on_a_read_only_mount_is_read_and_a_gap_in_it_is_one_line(s3, built, tmp_path):
    """A cache filled once and mounted read-only on the nodes (no pin, fetch or stamp can be
    written there) gives the local batches; a shard it lacks is a one-line error."""
    import subprocess
    import sys

    url, cache = _url(tmp_path, "images"), tmp_path / "ro"
    assert main(["push", str(built["images"]), url]) == 0
    _same_batches(MMapDataset(url, cache_dir=cache), MMapDataset(built["images"]))
    for p in cache.rglob(".pin"):
        p.unlink()  # as a cache copied without them
    read = ("import sys, torch\nfrom loaders import Loader, MMapDataset\nfrom packer.errors import ConfigError\n"
            "ds, local = MMapDataset(sys.argv[1], cache_dir=sys.argv[2]), MMapDataset(sys.argv[3])\n"
            "try:\n    n = sum(torch.equal(a['image'], b['image']) for a, b in zip(Loader(ds, 8, seed=2), "
            "Loader(local, 8, seed=2), strict=True))\n"
            "    print('equal', n)\nexcept ConfigError as exc:\n    print('error', exc)\n")
    mount = f"mount --bind {cache} {cache} && mount -o remount,bind,ro {cache} && "
    probe = subprocess.run(["unshare", "-m", "sh", "-c", mount + f"! touch {cache}/x"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("no read-only bind mount here (needs root, or user namespaces for unshare)")
    run = lambda: subprocess.run(["unshare", "-m", "sh", "-c", mount + f'"{sys.executable}" -c "$0" "$@"', read, url,
                                  str(cache), str(built["images"])], capture_output=True, text=True)
    out = run()
    batches = -(-len(MMapDataset(built["images"])) // 8)
    assert out.stdout.split() == ["equal", str(batches)], out.stderr[-2000:]
    next(cache.rglob("image.npy")).unlink()
    out = run()
    assert out.stdout.startswith("error") and "read-only" in out.stdout and out.stdout.count("\n") == 1, out.stdout


def test_ranks_on_separate_caches_each_fetch_their_part_of_the_epoch(s3, built, tmp_path):
    """Nodes with a cache each: in sequential order a rank reads a contiguous part of the epoch
    (its slice), so it downloads its part's shards, not every shard as interleaved ranks did."""
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    local, total = MMapDataset(built["images"]), _shard_bytes(built["images"])
    assert len(local.manifest.shards) >= 6
    seen = []
    for rank in range(3):
        ds = MMapDataset(url, cache_dir=tmp_path / f"node{rank}")
        loader = Loader(ds, 8, shuffle=False, rank=rank, world_size=3, drop_last=True)
        seen += [k for batch in loader for k in batch["key"]]
        assert ds.bytes_downloaded <= total * (1 / 3 + 1.5 / len(local.manifest.shards))
    assert len(seen) == len(set(seen)) and len(local) - len(seen) < 3 * 8


def test_the_cache_ledger_torn_or_counting_a_dead_process_is_counted_again_from_the_files(s3, built, tmp_path):
    """The ledger (bytes and shards present, in the accounting file) spares each download a
    count of every shard's files; a torn one, or one still counting part files of a killed
    process, must be counted again from the files, not shrink the cache or break the limit."""
    from packer.remote.cache import ACCOUNTING

    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    total, cache = _shard_bytes(built["images"]), tmp_path / "ledger"
    limit = total * 2 // 5
    ds, local = MMapDataset(url, cache_dir=cache, cache_limit=limit), MMapDataset(built["images"])
    keys = [k for b in Loader(local, 8, shuffle=False) for k in b["key"]]

    def epoch():
        got = [k for b in Loader(ds, 8, shuffle=False) for k in b["key"]]
        assert got == keys and _bytes_on_disk(cache) <= limit
    epoch()
    shards = ds.reader.cache
    with shards.accounting() as ledger:
        assert ledger.used == shards.usage() > 0 and ledger.present()
        ledger.add(limit)  # a killed process's reservation, never renamed nor removed
    epoch()
    with shards.accounting() as ledger:
        assert ledger.used == shards.usage()
    accounting = next(cache.rglob(ACCOUNTING))
    accounting.write_bytes(accounting.read_bytes()[:30] + b"torn")
    epoch()
    with shards.accounting() as ledger:
        assert ledger.used == shards.usage()


HOLDER = """
import sys
from loaders import MMapDataset
ds = MMapDataset(sys.argv[1], cache_dir=sys.argv[2], cache_limit=None if sys.argv[3] == "-" else int(sys.argv[3]))
for i in map(int, sys.argv[4].split(",")):
    ds[i]  # a reader without a limit keeps each shard it mapped pinned
print("read", flush=True)
sys.stdin.read()
"""


@pytest.mark.timing
def test_a_reader_is_never_held_up_behind_a_limited_one_waiting_for_room(s3, built, tmp_path):
    """A limited reader that waits for room (a reader without a limit pins the other shards)
    waits outside the shard's fetch lock: another reader fetches that shard at once, and the
    limited one then finds it there, where both waited 120 s before (WAIT_FOR_ROOM_S)."""
    import subprocess
    import sys

    from packer.remote.cache import WAIT_FOR_ROOM_S

    url, cache = _url(tmp_path, "images"), str(tmp_path / "c")
    assert main(["push", str(built["images"]), url]) == 0
    local = MMapDataset(built["images"])
    starts = np.cumsum([0] + [s.num_samples for s in local.manifest.shards])
    last = str(starts[-2])  # the last shard's first sample
    fixed = MMapDataset(url, cache_dir=tmp_path / "other")._cache.index_bytes  # index files, manifests, stamps
    tight = fixed + max(s.size_bytes for s in local.manifest.shards) * 3 // 2  # one shard's room, not the holder's
    run = lambda *args: subprocess.Popen([sys.executable, "-c", HOLDER, url, cache, *args], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
    holder = run("-", ",".join(str(i) for i in starts[:-2]))  # every shard but the last, pinned
    try:
        assert holder.stdout.readline() == "read\n"
        limited = run(str(tight), last)  # needs the last shard: no room while the holder pins the rest
        time.sleep(2)
        assert limited.poll() is None
        start = time.monotonic()
        free = run("-", last)
        assert free.stdout.readline() == "read\n"
        assert time.monotonic() - start < WAIT_FOR_ROOM_S / 4  # (all of it and more before)
        assert limited.stdout.readline() == "read\n"  # it found the shard there
        for p in (limited, free):
            p.communicate("")
            assert p.returncode == 0
    finally:
        holder.communicate("")


def test_a_killed_fetch_leaves_no_part_file_behind_without_a_limit_either(s3, built, tmp_path):
    from packer.remote.cache import ShardCache

    url, cache = _url(tmp_path, "images"), tmp_path / "c"
    assert main(["push", str(built["images"]), url]) == 0
    ds, local = MMapDataset(url, cache_dir=cache), MMapDataset(built["images"])
    assert ds[0]["key"] == local[0]["key"]  # the entry's ledger is made and valid from here on
    shard = ds._cache.shard_dir(1)
    shard.mkdir(parents=True, exist_ok=True)
    entry = ds._cache.bulk[1][0]
    dead = shard / f".{entry.path.rsplit('/', 1)[-1]}.part-999999-1"  # a part file whose writer is gone
    dead.write_bytes(b"x" * entry.size_bytes)
    first = local.manifest.shards[0].num_samples
    assert isinstance(ds._cache, ShardCache) and ds[first]["key"] == local[first]["key"]
    assert not dead.exists() and not list(cache.rglob("*.part-*"))


def test_a_reader_killed_at_any_instant_leaves_nothing_a_later_reader_would_use(s3, built, tmp_path):
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    limit, cache = _shard_bytes(built["images"]) * 2 // 5, tmp_path / "killed"
    local = MMapDataset(built["images"])
    for delay in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8):
        _killed_reader(url, cache, limit, 8, "sequential", delay)
        ds = MMapDataset(url, cache_dir=cache, cache_limit=limit)
        with Loader(ds, 8, shuffle=False, num_threads=1) as loader:  # its close unpins: the next reader may evict
            for a, b in zip(loader, Loader(local, 8, shuffle=False), strict=True):
                assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
        assert _bytes_on_disk(cache) <= limit
    assert not [p for p in cache.rglob("*.part-*")]  # a killed writer's part files are removed by the next reader
