"""FORMAT.md section 6: the checksum of every column file (the manifest's) and of every
compressed file (an archive's), and the hashers of every readable version's algorithms."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import xxhash

from packer.dataset.format.layout import CHECKSUM
from packer.dataset.format.npy import NPY_HEADER_BYTES, parse_npy_header

# -- 6. Integrity: the checksum of every column file (manifest) and compressed file (archive) -
# A column file's checksum is XXH3-128 over the XXH3-128 digests of its blocks: its header, then
# its rows in blocks of whole rows (one row per block from 32 KiB rows up). Each block can be
# hashed by whoever writes it, in any order, while it is still in the CPU's cache: the processes
# decoding one shard's images hash the rows they write, and no one reads the shard back.
BLOCK_BYTES = 64 * 1024  # rows per block: as many as fit, at least one


def rows_per_block(row_bytes: int) -> int:
    return max(1, BLOCK_BYTES // max(1, row_bytes))


def block_digest(data) -> bytes:
    """XXH3-128 of one block (any buffer), its 16 bytes in canonical (big-endian) order."""
    return xxhash.xxh3_128_digest(data)


def checksum_of_blocks(digests) -> str:
    """The checksum of a file from its blocks' digests, in file order (the header's first)."""
    h = xxhash.xxh3_128()
    for digest in digests:
        h.update(digest)
    return h.hexdigest()


def data_block_bytes(header: bytes) -> int:
    """Bytes per data block of a column file that starts with `header`: whole rows of its shape;
    BLOCK_BYTES when it is not a header of ours (a damaged file must hash, to a mismatch)."""
    try:
        dtype, shape = parse_npy_header(header)
    except ValueError:
        return BLOCK_BYTES
    row = np.dtype(dtype).itemsize * math.prod(shape[1:])
    return rows_per_block(row) * row if row else BLOCK_BYTES


class FileChecksum:
    """CHECKSUM of a column file fed its bytes in order, in pieces of any size (update /
    hexdigest, like hashlib). A file shorter than a header is one block of what it holds.
    `keep`: its blocks' digests kept too (`digests()`): the block list a push puts beside a
    column file in object storage, which lets a reader check a range of it (FORMAT.md 9)."""

    def __init__(self, keep: bool = False):
        self._head, self._block, self._left = bytearray(), 0, 0
        self._blocks, self._current = xxhash.xxh3_128(), xxhash.xxh3_128()
        self._kept = bytearray() if keep else None

    def _add(self, digest: bytes) -> None:
        self._blocks.update(digest)
        if self._kept is not None:
            self._kept += digest

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        if not self._block:
            need = NPY_HEADER_BYTES - len(self._head)
            self._head += view[:need]
            view = view[need:]
            if len(self._head) < NPY_HEADER_BYTES:
                return
            self._add(block_digest(self._head))
            self._block = self._left = data_block_bytes(bytes(self._head))
        while len(view):
            take = min(self._left, len(view))
            self._current.update(view[:take])
            view, self._left = view[take:], self._left - take
            if not self._left:
                self._add(self._current.digest())
                self._current.reset()
                self._left = self._block

    def hexdigest(self) -> str:
        blocks = self._blocks.copy()
        if not self._block:
            blocks.update(block_digest(self._head))
        elif self._left != self._block:  # the last block, shorter
            blocks.update(self._current.digest())
        return blocks.hexdigest()

    def digests(self) -> bytes:
        """The blocks' digests in file order, 16 bytes each (made with `keep`): their XXH3-128
        is the file's checksum."""
        out = bytes(self._kept)
        if not self._block:
            out += block_digest(self._head)
        elif self._left != self._block:
            out += self._current.digest()
        return out


def new_checksum():
    """A hasher (update / hexdigest) of a compressed archive file: plain XXH3-128 of its bytes."""
    return xxhash.xxh3_128()


def hasher(algo: str):
    """A new hasher (update / hexdigest) of a column file by `algo`, the algorithms of every
    readable version; None for one this reader does not know (a newer minor's)."""
    if algo == CHECKSUM:
        return FileChecksum()
    if algo == "xxh3_128":  # 2.x
        return xxhash.xxh3_128()
    if algo == "sha256":  # 1.x
        return hashlib.sha256()
    return None
