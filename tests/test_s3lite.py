"""bench/s3lite.py, our S3 server for hosts where SeaweedFS cannot go, read through mmpack's own
reader (obstore) as `bench remote` reads it: a pushed dataset gives the local samples, by whole
shards and by ranged GETs of rows; heads give sizes and the pushed checksum; ranges answer as S3
does (206, Content-Range, 416); a missing key is a one-line error; `bench remote --nodes` runs on
it. It checks no signature: what a store that does says is tested against SeaweedFS
(tests/dataset/test_remote*.py)."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import s3lite
from bench.stores import lite_server
from loaders import Loader, MMapDataset
from packer.cli import main
from packer.errors import ConfigError, IntegrityError

from tests.dataset.remote import aws_env, photo_rows, pointed_at

pytest.importorskip("obstore")


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with lite_server(tmp_path_factory.mktemp("s3lite")) as url:
        yield url


@pytest.fixture
def s3(endpoint, monkeypatch, tmp_path):
    """The standard AWS environment pointed at the server, and a cache of this test's own."""
    return pointed_at(endpoint, monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    """Photos of 112 x 112 (rows of 37,632 bytes: a block each, so a small cache reads them by
    ranged GETs) in 4 shards."""
    return photo_rows(tmp_path_factory.mktemp("rows"), 32, 112)


@pytest.fixture(scope="module")
def pushed(endpoint, rows, tmp_path_factory):
    """`rows` pushed once: its URL."""
    url = "s3://mmpack/lite/rows"
    with pytest.MonkeyPatch.context() as mp:
        for k, v in aws_env(endpoint).items():
            mp.setenv(k, v)
        assert main(["push", str(rows), url]) == 0
    return url


def _request(endpoint: str, method: str, path: str, **headers) -> tuple[int, dict, bytes]:
    host, port = endpoint.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, headers=headers)
        got = conn.getresponse()
        return got.status, {k.lower(): v for k, v in got.getheaders()}, got.read()
    finally:
        conn.close()


def test_a_pushed_dataset_reads_sample_for_sample_by_shards_and_by_ranged_rows(s3, rows, pushed, tmp_path):
    local = MMapDataset(rows)
    ds = MMapDataset(pushed, cache_dir=tmp_path / "whole")
    for i in range(len(local)):
        a, b = ds[i], local[i]
        assert a.keys() == b.keys() and a["key"] == b["key"]
        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(b[k]) else np.array_equal(a[k], b[k]) for k in b)
    # a cache under one shard: each batch's rows come by ranged GETs, checked against the block lists
    fixed = ds._cache.index_bytes
    limit = fixed + max(s.size_bytes for s in local.manifest.shards) * 2 // 3
    small = MMapDataset(pushed, cache_dir=tmp_path / "small", cache_limit=limit)
    for a, b in zip(Loader(small, 4, seed=2), Loader(local, 4, seed=2), strict=True):
        assert a["key"] == b["key"] and torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])
    assert small.traffic["gets"] > 2 * len(local.manifest.shards)  # ranges, not shards
    assert main(["verify", pushed]) == 0


def test_heads_give_each_files_size_and_the_checksum_it_was_pushed_with(s3, rows, pushed):
    import obstore as obs

    from packer.remote import client, transfer
    from packer.remote.url import Remote

    remote = Remote(pushed)
    store = client.store(remote)
    files = [f for s in MMapDataset(rows).manifest.shards for f in s.files]
    for f in files:
        head = client.head(obs, store, remote.key(f.path))
        assert head.meta["size"] == f.size_bytes == (rows / f.path).stat().st_size
        assert head.attributes[transfer.CHECKSUM_KEY].endswith(f.checksum)
    listed = {o["path"]: o["size"] for batch in obs.list(store, prefix=remote.prefix) for o in batch}
    assert {remote.key(f.path): f.size_bytes for f in files}.items() <= listed.items()


def test_a_large_object_goes_up_in_parts_and_comes_back_whole(s3, tmp_path):
    """obstore puts a file over 5 MiB as a multipart upload (create, parts, complete)."""
    import obstore as obs

    from packer.remote import client
    from packer.remote.url import Remote

    data = np.random.default_rng(0).integers(0, 256, 11 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "big").write_bytes(data)
    remote = Remote("s3://mmpack/lite/big")
    store = client.store(remote)
    with open(tmp_path / "big", "rb") as f:
        put = client.put(obs, store, remote.key("big.bin"), f, attributes={"mmpack-checksum": "x:1"})
    assert put["e_tag"].endswith('-3"')  # three parts
    got = client.get(obs, store, remote.key("big.bin"))
    assert bytes(got.bytes()) == data and got.attributes["mmpack-checksum"] == "x:1"
    assert bytes(obs.get_range(store, remote.key("big.bin"), start=(5 << 20) - 3, end=(5 << 20) + 3)) == \
        data[(5 << 20) - 3:(5 << 20) + 3]


def test_ranges_answer_as_s3_does(s3, rows, pushed):
    path = next(f.path for f in MMapDataset(rows).manifest.shards[0].files if f.path.endswith("image.npy"))
    data, url = (rows / path).read_bytes(), f"/mmpack/lite/rows/{path}"
    n = len(data)
    for asked, first, last in (("bytes=0-0", 0, 0), (f"bytes={n - 1}-{n - 1}", n - 1, n - 1), ("bytes=-5", n - 5, n - 1),
                               ("bytes=100-", 100, n - 1), (f"bytes=10-{n + 50}", 10, n - 1), ("bytes=-999999999", 0, n - 1)):
        status, headers, body = _request(s3, "GET", url, Range=asked)
        assert (status, headers["content-range"], body) == (206, f"bytes {first}-{last}/{n}", data[first:last + 1]), asked
        assert int(headers["content-length"]) == last - first + 1
    for asked in (f"bytes={n}-", f"bytes={n + 7}-{n + 9}", "bytes=-0"):
        status, headers, body = _request(s3, "GET", url, Range=asked)
        assert (status, headers["content-range"]) == (416, f"bytes */{n}") and b"<Code>InvalidRange</Code>" in body
    for ignored in ("bytes=0-1,5-6", "lines=1-2", "bytes=9-3"):  # as S3: the whole object
        assert _request(s3, "GET", url, Range=ignored)[::2] == (200, data), ignored
    status, headers, body = _request(s3, "HEAD", url)
    assert (status, int(headers["content-length"]), body) == (200, n, b"") and headers["accept-ranges"] == "bytes"


@pytest.mark.parametrize("header, size, want", [
    (None, 10, None), ("bytes=0-0", 10, (0, 0)), ("bytes=9-", 10, (9, 9)), ("bytes=-3", 10, (7, 9)),
    ("bytes=2-100", 10, (2, 9)), ("bytes=-20", 10, (0, 9)), ("bytes=5-4", 10, None), ("bytes=0-1,3-4", 10, None),
    ("bytes=10-", 10, 416), ("bytes=-0", 10, 416), ("bytes=0-", 0, 416), ("bytes=-1", 0, 416)])
def test_byte_range(header, size, want):
    if want == 416:
        with pytest.raises(s3lite.S3Error) as e:
            s3lite.byte_range(header, size)
        assert e.value.status == 416
    else:
        assert s3lite.byte_range(header, size) == want


def test_a_missing_key_is_a_404_in_s3s_words_and_one_line_from_our_reader(s3, rows, pushed, tmp_path):
    import obstore as obs

    from packer.remote import client
    from packer.remote.url import Remote

    status, _, body = _request(s3, "GET", "/mmpack/lite/nothing/manifest.json")
    assert status == 404 and b"<Code>NoSuchKey</Code>" in body
    assert _request(s3, "HEAD", "/mmpack/lite/nothing/manifest.json")[::2] == (404, b"")
    with pytest.raises((IntegrityError, ConfigError)) as e:
        MMapDataset("s3://mmpack/lite/nothing", cache_dir=tmp_path / "c")
    assert "\n" not in str(e.value) and "s3://mmpack/lite/nothing" in str(e.value) and "<?xml" not in str(e.value)
    # a dataset whose shard file went missing from the store: its read names the file
    url = "s3://mmpack/lite/gone"
    assert main(["push", str(rows), url]) == 0
    remote, path = Remote(url), MMapDataset(rows).manifest.shards[0].files[0].path
    obs.delete(client.store(remote), remote.key(path))
    with pytest.raises(IntegrityError) as e:
        MMapDataset(url, cache_dir=tmp_path / "d")[0]
    assert "\n" not in str(e.value) and path in str(e.value) and "not found" in str(e.value)


def test_any_signature_is_accepted_and_only_the_standard_library_is_needed(s3, pushed, monkeypatch, tmp_path):
    """What it says in its docstring: it is for throughput on loopback, not for checking keys;
    and it runs where no wheel travels (python -S: no site-packages)."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    assert len(MMapDataset(pushed, cache_dir=tmp_path / "c")) == 32
    assert "any signature" in s3lite.__doc__.lower()
    script = Path(s3lite.__file__)
    out = subprocess.run([sys.executable, "-S", str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_bench_remote_nodes_runs_on_it(tmp_path):
    """`bench remote --nodes 2 --s3-server lite` (the smallest run): the JSON names our server and
    has each node's figures."""
    from bench.cli import main as bench

    out = tmp_path / "nodes.json"
    assert bench(["remote", "--images", "16", "--batch-size", "16", "--block-samples", "600", "--nodes", "2",
                  "--ranks-per-node", "1", "--link-mb", "500", "--node-caches", "1", "--s3-server", "lite",
                  "--work", str(tmp_path / "work"), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["s3_server"] == "lite" and "s3lite" in r["url"]
    run, = r["nodes"]["runs"]
    assert "refused" not in run and [n["node"] for n in run["nodes"]] == [0, 1]
    for node in run["nodes"]:
        cold, warm = node["epochs"]
        assert cold["bytes"] > 0 and cold["gets"] > 0 and cold["samples"] > 0 and cold["link_share"] is not None
        assert warm["samples"] == cold["samples"] and node["most_gets_per_object"] >= 1
