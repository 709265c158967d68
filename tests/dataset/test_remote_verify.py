"""`packer verify URL` (packer.remote.verify): the bucket's objects hashed, or with --cache the
node's copies; a push run again repairs what it names."""

from __future__ import annotations

import json
import os


from loaders import MMapDataset
from packer.cli import main
from packer.dataset import format as fmt

from .remote import NEEDS_SERVER, _same_batches, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


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
