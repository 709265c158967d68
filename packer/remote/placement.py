"""Where a node's cache may live. Its processes share it through flocks (an entry's fetch lock,
its ledger, the pins that keep a shard mapped), and those hold only among processes that see
the same locks. On a network file system they may not: NFS without a lock manager takes
`flock` as a lock on this client alone, a FUSE store (s3fs, gcsfuse) may take any lock and hold
none, Lustre mounted with `localflock` locks per node. Two nodes sharing such a dir would each
believe they hold what the other is writing, and one would map a file the other is replacing:
a silent wrong batch. So a cache dir on such a file system is refused in one line, unless the
user says that no other node uses it (MMPACK_CACHE_NODE_PRIVATE=1), and the default cache,
under $HOME (often NFS on a cluster), moves to a node-local dir there.
"""

from __future__ import annotations

import os
from pathlib import Path

from packer.errors import ConfigError

PRIVATE_ENV = "MMPACK_CACHE_NODE_PRIVATE"
# file systems whose locks other nodes may not see (the type /proc/self/mountinfo gives)
NETWORK = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "afs", "ncpfs", "lustre", "beegfs", "davfs",
                     "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.goofys", "fuse.blobfuse",
                     "fuse.blobfuse2", "fuse.mountpoint-s3", "fuse.juicefs", "fuse.glusterfs", "fuse.davfs"})
MOUNTINFO = Path("/proc/self/mountinfo")


def mounts() -> list[tuple[str, str]]:
    """(mount point, file system type) of this process's mounts; none where /proc is not there."""
    try:
        text = MOUNTINFO.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        fields = line.split()
        try:
            sep = fields.index("-")
        except ValueError:
            continue
        point = fields[4].encode().decode("unicode_escape")  # spaces and such come as \040
        out.append((point, fields[sep + 1]))
    return out


def fs_type(path: Path) -> str | None:
    """The type of the file system `path` is on: that of the longest mount point holding it once
    its symlinks are resolved (a local `~/.cache` linked to an NFS dir is on NFS)."""
    where = os.path.realpath(path)
    best, kind = "", None
    for point, fstype in mounts():
        if (where == point or where.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def untrusted(path: Path) -> str | None:
    """The network file system type `path` is on, where its locks cannot be trusted; else None."""
    kind = fs_type(path)
    return kind if kind in NETWORK or (kind or "").split(".", 1)[0] in NETWORK else None


def private() -> bool:
    return os.environ.get(PRIVATE_ENV, "").strip().lower() in ("1", "true", "yes")


def check(cache_dir: Path) -> None:
    """A cache dir given by the user: refused in one line where it is on a network file system
    (see the module) and this process could write it, unless MMPACK_CACHE_NODE_PRIVATE says no
    other node uses it. A read-only one (a cache filled once, shared read-only) takes no lock
    that matters: it is read as it is."""
    kind = untrusted(cache_dir)
    if kind and not private() and (not os.path.exists(cache_dir) or os.access(cache_dir, os.W_OK)):
        raise ConfigError(f"{cache_dir}: the cache is on {kind}, a network file system whose locks other nodes may "
                          f"not see; give a node-local cache_dir (local disk, /tmp), or set {PRIVATE_ENV}=1 if no other "
                          "node uses this dir")


def node_local(default: Path) -> Path:
    """The default cache dir, or a node-local one where the default is on a network file system
    ($HOME on a cluster): /var/tmp (kept across reboots where /tmp is not), else /tmp."""
    if untrusted(default) is None or private():
        return default
    for base in (Path("/var/tmp"), Path("/tmp")):
        if os.access(base, os.W_OK) and untrusted(base) is None:
            return base / f"mmpack-{os.getuid()}" / "remote"
    return default
