"""Stamps of cached files: each file's size, times and inode when its checksum last held, kept
per shard dir (STAMPS), so that a file changed since (a byte written over it by any process,
a copy put in its place) is hashed again before it is mapped, where every other read costs a
stat: a shard's data files when a process pins it, the entry's index files when it is opened.
A cache written before stamps is hashed once per file, then stamped."""

from __future__ import annotations

import json
import os
from pathlib import Path

from packer.dataset import format as fmt

STAMPS = ".verified"  # in each shard dir


def name_of(entry: fmt.FileEntry) -> str:
    return entry.path.rsplit("/", 1)[-1]


def stat_key(path: Path) -> list[int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def read_stamps(where: Path) -> dict:
    try:
        stamps = json.loads((where / STAMPS).read_text())
        return stamps if isinstance(stamps, dict) else {}
    except (OSError, ValueError):
        return {}


def stamps_bound(names: list[str]) -> int:
    """The most bytes a shard's stamps take: its files' names, four numbers of 20 digits each."""
    return len(json.dumps({n: [10**19] * 4 for n in names}).encode())


def write_stamps(where: Path, stamps: dict) -> None:
    """Not fsynced (`parts.write_whole`): stamps lost with a crash of the machine only make their
    files hashed again, and an fsync a shard was most of a small download's time."""
    from packer.remote.parts import write_whole

    try:
        write_whole(where / STAMPS, json.dumps(stamps).encode())
    except OSError:  # a read-only cache: each reader hashes its changed files instead
        pass


def unchanged(root: Path, entries: list[fmt.FileEntry]) -> bool:
    """Whether each of `entries` (files of one shard dir under entry `root`) is as its stamp says."""
    if not entries:
        return True
    stamps = read_stamps((root / entries[0].path).parent)
    return all(stamps.get(name_of(e)) == stat_key(root / e.path) for e in entries)


def recheck(root: Path, entries: list[fmt.FileEntry], every: bool = False) -> tuple[list, list]:
    """Of `entries` (files of one shard dir under entry `root`), those there whole whose stat
    differs from their stamp (`every`: all those there) hashed again: (those that match, whose
    stamps are written; those that do not, for the caller to remove)."""
    from packer.remote.parts import whole

    if not entries:
        return [], []
    where = (root / entries[0].path).parent
    stamps, good, bad = read_stamps(where), [], []
    for entry in entries:
        path = root / entry.path
        if not whole(path, entry.size_bytes) or not every and stamps.get(name_of(entry)) == stat_key(path):
            continue
        (good if matches(path, entry) else bad).append(entry)
    if good:
        stamps.update({name_of(e): stat_key(root / e.path) for e in good})
        write_stamps(where, stamps)
    return good, bad


def matches(path: Path, entry: fmt.FileEntry) -> bool:
    """Whether the file's bytes hash to the manifest's checksum (read once, a MB at a time)."""
    digest = fmt.hasher(entry.algo)
    if digest is None:
        return False
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest() == entry.checksum
