"""The S3 server of the test_remote_* files (SeaweedFS on loopback, SigV4 enforced), one a test
process, with the environment that points at it; a dataset of large rows, read by rows."""

from __future__ import annotations

import pytest

from packer.cli import main

from bench.stores import KEY, SECRET, s3_server
from .remote import ROTATED


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
def large_rows(tmp_path_factory):
    """Photos of 112 x 112 (rows of 37,632 bytes: a block each, so read by rows) in 12 shards."""
    from bench import data

    root = tmp_path_factory.mktemp("rows")
    data.make_image_folders(root / "raw", 96, seed=5, max_side=160)
    assert main(["build", str(root / "raw"), str(root / "out"), "--image-size", "112", "--shard-size", "8", "-q"]) == 0
    return root / "out"
