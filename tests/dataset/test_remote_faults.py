"""Faults of a dataset in object storage read from the user's side (issue 61), against the real
S3 server of `test_remote` and its faulty proxy: a body cut off mid-way is read again, keys the
store says expired are read again (or the error says why not), a throttling storm's end gives
the rate back, a killed reader's scratch is removed, a read-only cache dir is one line, and a
random order through a cache too small for its shards reads by rows or is refused before its
first batch, never fetching the dataset many times an epoch in silence."""

from __future__ import annotations

import pytest
import torch

from loaders import Loader, MMapDataset
from packer.cli import main

from .test_remote import _url, endpoint, s3  # noqa: F401 - the server and its environment, fixtures


def test_a_body_cut_off_on_the_manifest_and_on_a_first_shard_is_read_again(s3, built, tmp_path, monkeypatch):  # noqa: F811
    """A connection closed mid-body on the manifest (at the open) and on a shard the pass's
    first batch reads: each read again from its start, and the epoch is the local one (one cut
    ended the run, where the head's retries ride out 120 s)."""
    from ..faulty_proxy import FaultyProxy

    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    faults = ["cut@manifest.json", "cut@/image.npy"]
    proxy = FaultyProxy(s3, faults, target="/")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        ds, local = MMapDataset(url, cache_dir=tmp_path / "cut"), MMapDataset(built["images"])
        for a, b in zip(Loader(ds, 8, seed=4), Loader(local, 8, seed=4), strict=True):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
        assert proxy.used == faults
    finally:
        proxy.close()

