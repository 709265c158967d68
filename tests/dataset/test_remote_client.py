"""The object-store client (packer.remote.client): wrong credentials and a missing dataset are
one-line errors, forked DataLoader workers make their requests in processes of their own, and a
URL without the remote extra installed is one line."""

from __future__ import annotations


import pytest
import torch

from loaders import Loader, MMapDataset
from packer.cli import main
from packer.errors import ConfigError

from .remote import NEEDS_SERVER, _shard_bytes, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


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


def test_without_the_remote_extra_a_url_is_one_line_naming_it(tmp_path):
    import subprocess
    import sys

    code = ("import sys; sys.modules['obstore'] = None; from packer.cli import main; "
            "sys.exit(main(['info', 's3://bucket/photos']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "pip install 'mmpack[remote]'" in out.stderr
