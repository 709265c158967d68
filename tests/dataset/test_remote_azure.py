"""Azure Blob Storage (az://) against a real Azurite, where it is installed (`npm install -g
azurite`): the same client with another store; what differs by store."""

from __future__ import annotations

import shutil

import pytest
import torch

from loaders import Loader, MMapDataset
from packer.cli import main
from packer.dataset import format as fmt
from packer.errors import ConfigError

from .azure import AZURE_ACCOUNT, AZURE_KEY, azure_server
from ..trees import tree
from .remote import NEEDS_SERVER, _objects

pytestmark = NEEDS_SERVER  # as the S3 server's tests: skipped where obstore or SeaweedFS is missing


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    """A real Azurite on loopback (shared-key auth enforced), where it is installed."""
    if shutil.which("azurite-blob") is None:
        pytest.skip("no Azurite (npm install -g azurite)")
    with azure_server(tmp_path_factory.mktemp("azurite")) as url:
        yield url


@pytest.fixture
def az(azurite, monkeypatch, tmp_path):
    """The client's AZURE_* environment pointed at Azurite, and a cache of this test's own."""
    for k, v in {"AZURE_STORAGE_ACCOUNT_NAME": AZURE_ACCOUNT, "AZURE_STORAGE_ACCOUNT_KEY": AZURE_KEY,
                 "AZURE_STORAGE_ENDPOINT": azurite, "AZURE_ALLOW_HTTP": "true"}.items():
        monkeypatch.setenv(k, v)
    from packer.remote import transfer

    monkeypatch.setattr(transfer, "DEFAULT_CACHE", tmp_path / "cache" / "mmpack" / "remote")
    return f"az://mmpack/{tmp_path.name}"


def test_az_push_then_pull_gives_the_same_dataset(az, built, tmp_path, capsys):
    url = f"{az}/images"
    assert main(["push", str(built["images"]), url]) == 0
    assert main(["pull", url, str(tmp_path / "copy")]) == 0
    assert tree(tmp_path / "copy") == tree(built["images"])
    assert main(["verify", url]) == 0 and "verified" in capsys.readouterr().out
    assert main(["push", str(built["images"]), url, "--zstd"]) == 0  # the archive form over it
    assert fmt.MANIFEST_NAME not in _objects(url) and fmt.ARCHIVE_NAME in _objects(url)
    local = MMapDataset(built["images"])
    assert [r["key"] for r in MMapDataset(url, cache_dir=tmp_path / "zstd")] == [r["key"] for r in local]


def test_az_a_loader_through_a_limited_cache_in_ranges_gives_the_local_batches(az, built, tmp_path, monkeypatch):
    from packer.remote import transfer

    monkeypatch.setattr(transfer, "RANGE_BYTES", 16384)
    url = f"{az}/images"
    assert main(["push", str(built["images"]), url]) == 0
    local = MMapDataset(built["images"])
    limit = sum(s.size_bytes for s in local.manifest.shards) * 2 // 5
    ds = MMapDataset(url, cache_dir=tmp_path / "limited", cache_limit=limit)
    for _ in range(2):
        for a, b in zip(Loader(ds, 8, shuffle=False), Loader(local, 8, shuffle=False), strict=True):
            assert a["key"] == b["key"] and torch.equal(a["image"], b["image"])
    assert 0 < ds.bytes_downloaded


def test_az_a_wrong_key_and_a_missing_dataset_are_one_line_errors(az, built, monkeypatch, capsys):
    with pytest.raises(ConfigError, match="no mmpack dataset there"):
        MMapDataset(f"{az}/nothing-here")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "bm90LXRoZS1rZXk=")
    with pytest.raises(ConfigError, match="AZURE_STORAGE_ACCOUNT_KEY"):
        MMapDataset(f"{az}/nothing-here")
    assert main(["push", str(built["images"]), f"{az}/images"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "access denied" in err
