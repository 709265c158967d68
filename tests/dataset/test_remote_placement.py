"""Where a node's cache may live (packer.remote.placement): a cache dir on a network file system or
a FUSE mount is refused unless said node-private."""

from __future__ import annotations


import pytest

from loaders import MMapDataset
from packer.cli import main
from packer.errors import ConfigError

from .remote import NEEDS_SERVER, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


def test_a_cache_on_a_network_file_system_is_refused_unless_said_node_private(s3, built, tmp_path, monkeypatch):
    """flocks on NFS (or a FUSE store) may hold on this client alone: two nodes sharing the dir
    would each think they hold what the other writes. A cache_dir there is one line with the
    fix; MMPACK_CACHE_NODE_PRIVATE=1 says no other node uses it; the default cache, under a $HOME
    on NFS, moves to a node-local dir. (The mount table is stood in for: no NFS server here. A
    real FUSE mount is the next test's.)"""
    from packer.remote import placement

    shared = tmp_path / "home"
    table = tmp_path / "mountinfo"
    table.write_text(f"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
                     f"90 22 0:50 / {shared} rw,relatime shared:40 - nfs4 server:/home rw,vers=4.2\n")
    monkeypatch.setattr(placement, "MOUNTINFO", table)
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    with pytest.raises(ConfigError, match=r"on nfs4, a network file system.*MMPACK_CACHE_NODE_PRIVATE=1") as exc:
        MMapDataset(url, cache_dir=shared / "cache")
    assert "\n" not in str(exc.value) and not (shared / "cache").exists()
    shared.mkdir()
    (tmp_path / "linked").symlink_to(shared)  # a local-looking path into the NFS mount is on NFS too
    with pytest.raises(ConfigError, match="on nfs4, a network file system"):
        MMapDataset(url, cache_dir=tmp_path / "linked" / "cache")
    monkeypatch.setenv("MMPACK_CACHE_NODE_PRIVATE", "1")
    assert len(MMapDataset(url, cache_dir=shared / "cache")) == len(MMapDataset(built["images"]))
    monkeypatch.delenv("MMPACK_CACHE_NODE_PRIVATE")
    local = placement.node_local(shared / ".cache" / "mmpack" / "remote")
    assert placement.untrusted(local) is None and str(local).startswith(("/var/tmp/mmpack-", "/tmp/mmpack-"))
    assert placement.node_local(tmp_path / "remote") == tmp_path / "remote"  # a local default stays


def test_a_cache_dir_on_a_real_fuse_mount_is_refused(s3, built, tmp_path):
    """A real FUSE mount of s3fs's type (`tests.fuse_mount`: /dev/fuse and mount(2), no
    libfuse; it needs root): a cache_dir on it, or in it, is refused in one line, before anything
    is written there; a cache_dir beside it is not."""
    from .. import fuse_mount

    why = fuse_mount.available()
    if why:
        pytest.skip(f"no FUSE mount here: {why}")
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    point = tmp_path / "s3fs"
    point.mkdir()
    with fuse_mount.fuse_mount(point, "fuse.s3fs"):
        for where in (point, point / "cache"):
            with pytest.raises(ConfigError, match=r"on fuse.s3fs, a network file system.*NODE_PRIVATE=1") as exc:
                MMapDataset(url, cache_dir=where)
            assert "\n" not in str(exc.value)
        assert len(MMapDataset(url, cache_dir=tmp_path / "local")) == len(MMapDataset(built["images"]))
