"""The S3 server of the test_remote_* files (SeaweedFS on loopback, SigV4 enforced), one a test
process, with the environment that points at it; a dataset of large rows, read by rows."""

from __future__ import annotations

import pytest

from bench.stores import s3_server
from .remote import ROTATED, photo_rows, pointed_at


@pytest.fixture(scope="session")
def endpoint(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3"), also=(ROTATED,)) as url:
        yield url


@pytest.fixture
def s3(endpoint, monkeypatch, tmp_path):
    """The standard AWS environment pointed at the loopback server, and a cache of this test's own."""
    return pointed_at(endpoint, monkeypatch, tmp_path)


@pytest.fixture(scope="session")
def large_rows(tmp_path_factory):
    """Photos of 112 x 112 (rows of 37,632 bytes: a block each, so read by rows) in 12 shards."""
    return photo_rows(tmp_path_factory.mktemp("rows"), 96, 112)
