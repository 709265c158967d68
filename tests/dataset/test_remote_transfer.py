"""`packer push` and `packer pull` against the S3 server (packer.remote.transfer): the same bytes both
ways, zstd-compressed pushes, files fetched verified (a damaged or overlong object refused, naming
it), and a push or pull killed at any instant finished when run again."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from loaders import Loader, MMapDataset, TokenWindows
from packer.cli import main
from packer.dataset import format as fmt
from packer.errors import IntegrityError

from ..trees import tree
from .remote import NEEDS_SERVER, _objects, _shard_bytes, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


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
