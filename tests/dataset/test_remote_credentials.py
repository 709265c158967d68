"""S3 keys from a profile (packer.remote.credentials), read again as its file changes: keys
rotated mid-run."""

from __future__ import annotations

import time

import torch

from loaders import Loader, MMapDataset
from packer.cli import main

from bench.stores import KEY, SECRET
from .remote import NEEDS_SERVER, ROTATED, _url, profile

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


def test_keys_from_a_profile_are_read_again_as_its_file_changes_so_a_rotation_mid_run_goes_on(s3, built, tmp_path,
                                                                                             monkeypatch):
    """No keys in the environment: they come from the profile's credentials file, which a
    cluster's helper rewrites before the old keys expire. Between two epochs (a limited cache:
    the second fetches again) the file gets new keys and the store starts refusing the old ones
    (403 ExpiredToken at a proxy): the second epoch goes on with the new keys, batch for batch."""
    from ..faulty_proxy import FaultyProxy

    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0  # (with the environment's keys)
    creds = profile(tmp_path, monkeypatch, (KEY, SECRET))
    proxy = FaultyProxy(s3, [], target="/")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        local = MMapDataset(built["images"])
        ds = MMapDataset(url, cache_dir=tmp_path / "c", cache_limit=sum(s.size_bytes for s in local.manifest.shards) * 2 // 5)
        for epoch in range(2):
            if epoch == 1:
                creds.write_text(f"[default]\naws_access_key_id = {ROTATED[0]}\naws_secret_access_key = {ROTATED[1]}\n")
                time.sleep(0.5)
                proxy.refused, before = f"Credential={KEY}/".encode(), proxy.gets
            for a, b in zip(Loader(ds, 8, shuffle=False), Loader(local, 8, shuffle=False), strict=True):
                assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
        assert proxy.gets > before and proxy.refusals == 0  # the second epoch fetched, with the new keys only
    finally:
        proxy.close()
