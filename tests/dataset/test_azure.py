"""Datasets in Azure Blob Storage (az://container/prefix), against a real Azurite on loopback
(shared-key auth enforced): the same client code as s3:// with another store, so the checks here
are the ones that differ by store: push then pull, readers through a limited cache (in ranges),
and the errors of a wrong key and a missing dataset. Skipped where Azurite is not installed
(`npm install -g azurite`)."""

from __future__ import annotations

import shutil

import pytest
import torch

from loaders import Loader, MMapDataset
from packer.cli import main
from packer.errors import ConfigError, IntegrityError

from bench.stores import AZURE_ACCOUNT, AZURE_KEY, azure_server
from ..trees import tree

pytest.importorskip("obstore")
if shutil.which("azurite-blob") is None:
    pytest.skip("no Azurite (npm install -g azurite)", allow_module_level=True)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    with azure_server(tmp_path_factory.mktemp("azurite")) as url:
        yield url


@pytest.fixture
def az(endpoint, monkeypatch, tmp_path):
    """The client's AZURE_* environment pointed at Azurite, and a cache of this test's own."""
    for k, v in {"AZURE_STORAGE_ACCOUNT_NAME": AZURE_ACCOUNT, "AZURE_STORAGE_ACCOUNT_KEY": AZURE_KEY,
                 "AZURE_STORAGE_ENDPOINT": endpoint, "AZURE_ALLOW_HTTP": "true"}.items():
        monkeypatch.setenv(k, v)
    from packer.dataset import remote

    monkeypatch.setattr(remote, "DEFAULT_CACHE", tmp_path / "cache" / "mmpack" / "remote")
    return f"az://mmpack/{tmp_path.name}"


def test_push_then_pull_gives_the_same_dataset(az, built, tmp_path, capsys):
    url = f"{az}/images"
    assert main(["push", str(built["images"]), url]) == 0
    assert main(["pull", url, str(tmp_path / "copy")]) == 0
    assert tree(tmp_path / "copy") == tree(built["images"])
    assert main(["verify", url]) == 0 and "verified" in capsys.readouterr().out


def test_a_loader_through_a_limited_cache_in_ranges_gives_the_local_batches(az, built, tmp_path, monkeypatch):
    from packer.dataset import remote

    monkeypatch.setattr(remote, "RANGE_BYTES", 16384)
    url = f"{az}/images"
    assert main(["push", str(built["images"]), url]) == 0
    local = MMapDataset(built["images"])
    limit = sum(s.size_bytes for s in local.manifest.shards) * 2 // 5
    ds = MMapDataset(url, cache_dir=tmp_path / "limited", cache_limit=limit)
    for _ in range(2):
        for a, b in zip(Loader(ds, 8, shuffle=False), Loader(local, 8, shuffle=False), strict=True):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
    assert 0 < ds.bytes_downloaded


def test_a_wrong_key_and_a_missing_dataset_are_one_line_errors(az, built, monkeypatch, capsys):
    with pytest.raises(IntegrityError, match="not found"):
        MMapDataset(f"{az}/nothing-here")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "bm90LXRoZS1rZXk=")
    with pytest.raises(ConfigError, match="AZURE_STORAGE_ACCOUNT_KEY"):
        MMapDataset(f"{az}/nothing-here")
    assert main(["push", str(built["images"]), f"{az}/images"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "access denied" in err
