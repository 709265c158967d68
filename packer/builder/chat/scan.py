"""The scan of a RAW of conversations: JSONL, JSON lists and Parquet tables whose records hold
messages (`messages` / `conversations`) or preference pairs (`chosen`, `rejected`). Like text,
the records are the files (a shard's span is a range of lines, elements or rows, read by the
worker that packs it): a scan holds no conversation, whatever their number.

Where the records name images (`image`, `images`), the scan reads every record once to find
the images they name, so that an image file of RAW that none names is a skip with its reason,
as a manifest's are; the images themselves are decoded by the workers.
"""

from __future__ import annotations

import os
from pathlib import Path

from packer.builder.chat import read
from packer.builder.chat.conversation import field_of, image_paths, is_pair
from packer.builder.records import IMAGE_EXTS, Record, Scan
from packer.dataset.format import Skip
from packer.errors import SourceError

EXTS = (".jsonl", ".json", ".parquet")
PROBED_FILES = 4  # files looked into to tell conversations from text
PROBED_RECORDS = 8


def detect(files: list[tuple[str, str]], max_bytes: int) -> dict | None:
    """The chat fields of RAW's records ({"messages": field or None, "pairs": "chosen/rejected"
    or None, "image": None}), from the first records of its first conversation-like files;
    None when they are no conversations."""
    probed = 0
    for rel, path in files:
        if os.path.splitext(rel)[1].lower() not in EXTS or probed >= PROBED_FILES:
            continue
        probed += 1
        for record in _first(path, rel, max_bytes):
            if is_pair(record):
                return {"messages": None, "pairs": "chosen/rejected", "image": None}
            if field_of(record):
                return {"messages": field_of(record), "pairs": None, "image": None}
    return None


def _first(path: str, rel: str, max_bytes: int) -> list[dict]:
    out = []
    try:
        for item in read.records(Record(rel, path), None, max_bytes):
            if not isinstance(item, Skip) and isinstance(item[1], dict):
                out.append(item[1])
            if len(out) >= PROBED_RECORDS:
                break
    except (OSError, SourceError):
        return []
    return out


def scan(raw: Path, files: list[tuple[str, str]], skipped: list[Skip], fields: dict, max_bytes: int) -> Scan:
    """RAW's conversation files as the records of a chat build (see the module)."""
    mine = [(rel, path) for rel, path in files if os.path.splitext(rel)[1].lower() in EXTS]
    if not mine:
        raise SourceError(f"{raw}: no conversation file (JSONL, JSON or Parquet records of messages)")
    images = any(_names_images(path, rel, max_bytes) for rel, path in mine)
    named: set = set()
    if images:
        for rel, path in mine:
            _named(path, rel, max_bytes, named)
    for rel, path in files:
        ext = os.path.splitext(rel)[1].lower()
        if ext in EXTS:
            continue
        if ext in IMAGE_EXTS and images:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) not in named:
                skipped.append(Skip(rel, "scan", "an image no conversation names"))
        else:
            skipped.append(Skip(rel, "scan", f"not a conversation file ({ext or 'no extension'})"))
    fields = {**fields, "image": "image" if images else None}
    what = "preference pairs (chosen, rejected)" if fields["pairs"] else f"conversations ({fields['messages']})"
    why = f"{len(mine):,} file{'s' if len(mine) != 1 else ''} of {what}" + (" with images" if images else "")
    return Scan("chat", tuple(Record(rel, path) for rel, path in mine), tuple(sorted(skipped, key=lambda s: s.key)),
                None, why=why, form="chat", fields=fields, sources=tuple(p for _, p in mine))


def _names_images(path: str, rel: str, max_bytes: int) -> bool:
    """Whether a record of the file has an image field: a byte search of its JSON (no parse),
    or a Parquet column."""
    if rel.lower().endswith(".parquet"):
        return bool({"image", "images"} & set(read.parquet_columns(path)))
    with open(path, "rb") as f:
        carry = b""
        while chunk := f.read(1 << 20):
            block = carry + chunk
            if b'"image"' in block or b'"images"' in block:
                return True
            carry = block[-16:]
    return False


def _named(path: str, rel: str, max_bytes: int, named: set) -> None:
    """The (device, inode) of every image file a record of the file names (that exists)."""
    folder = os.path.dirname(path)
    for item in read.records(Record(rel, path), None, max_bytes):
        if isinstance(item, Skip) or not isinstance(item[1], dict):
            continue
        try:
            paths = image_paths(item[1])
        except SourceError:
            continue
        for name in paths:
            if not isinstance(name, str):  # bytes in the row: no file of RAW
                continue
            try:
                st = os.stat(os.path.join(folder, name))
            except (OSError, ValueError):
                continue
            named.add((st.st_dev, st.st_ino))
