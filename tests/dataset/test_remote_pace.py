"""Requests to a store that fails them (packer.remote.pace): resets, 503s, pauses and flipped bytes
tried again, a burst of SlowDowns ridden out at a lower rate, a store that never answers an error
at the deadline. The pace itself on a simulated clock: tests/dataset/test_pace.py."""

from __future__ import annotations

import time

import pytest
import torch

from loaders import Loader, MMapDataset
from packer.cli import main

from bench.stores import KEY, SECRET
from .remote import NEEDS_SERVER, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


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


def test_a_store_that_restarts_is_ridden_out(s3, built, tmp_path, monkeypatch):
    """Refused connections are tried again until the deadline, not ten times (over in about 2 s,
    inside any restart); an answer silent for READ_TIMEOUT_S is broken and tried again: the
    batches are the local dataset's."""
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


@pytest.mark.timing
def test_a_store_that_never_answers_is_an_error_in_seconds(s3, built, tmp_path, monkeypatch, capsys):
    """A store that never answers is a one-line error once MMPACK_REMOTE_DEADLINE has passed,
    where ten tries of the client's 30 s each took minutes."""
    from packer.remote import client

    from ..faulty_proxy import FaultyProxy

    monkeypatch.setattr(client, "READ_TIMEOUT_S", 2.0)  # (10 s for users) for a quicker test
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
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
    assert took < 3 * (3 + client.READ_TIMEOUT_S), f"a store that never answers took {took:.0f} s to be an error"
    monkeypatch.setenv("MMPACK_REMOTE_DEADLINE", "soon")
    assert main(["info", url]) == 2
    err = capsys.readouterr().err
    assert "MMPACK_REMOTE_DEADLINE" in err and err.count("\n") == 1


@pytest.mark.timing
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
    assert time.monotonic() - start >= 0.85 * 4  # the deadline's 4 s, not ten quick tries
