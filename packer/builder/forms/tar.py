"""WebDataset tar shards (what img2dataset and most image-text corpora ship): samples grouped by
key, `key.jpg` with `key.cls` (an integer label) and `key.txt` or `key.json` (a caption).

The scan reads each tar's headers in order (seeking past the data: a tar of any size costs a
header's memory at a time) and the small `.cls` members; every sample is a record pointing at
its image member's bytes, read by the workers in place (`read.MemberView`), never extracted.
Members that are not regular files (links, devices, FIFOs), a member that runs past the end of
a truncated tar, and a sample without an image are skips with their reason. Plain tars only: a
compressed one cannot be read in place.
"""

from __future__ import annotations

import os
import re
import tarfile
from collections.abc import Iterator
from typing import NamedTuple

from packer.builder.forms import extra
from packer.builder.forms.fields import FieldOptions, choose
from packer.builder.records import Record
from packer.dataset.format import Skip, printable
from packer.errors import ConfigError

IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif")
TEXT_MEMBERS = ("txt", "caption", "text")
LABEL_BYTES = 64  # a .cls member longer than this is not a label
JSON_BYTES = 1 << 20  # a .json member read to see which field holds the caption
_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset's: the key up to the first dot of the name
COMPRESSED = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")


def is_tar(rel: str) -> bool:
    return rel.lower().endswith(".tar")


def samples(path: str, rel: str) -> Iterator[tuple[str, dict] | Skip]:
    """(key, {extension: member}) of each sample of one tar, members grouped while consecutive
    with one key (as WebDataset groups them), or a Skip for what cannot be one."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        yield Skip(rel, "scan", f"not a readable tar ({exc.strerror or exc})")
        return
    size = os.fstat(f.fileno()).st_size
    key, group = None, {}
    with f:
        for member in _members(f, rel, size):
            if isinstance(member, Skip):
                yield member
                continue
            name = f"{rel}:{printable(member.name)}"
            if member.isdir():
                continue
            if printable(member.name) != member.name:  # a key is UTF-8 text
                yield Skip(name, "scan", "a member whose name is not UTF-8; rename it (tar --transform)")
                continue
            if not member.isreg():
                yield Skip(name, "scan", f"a {_TYPES.get(member.type, 'special')} member, not a regular file")
                continue
            if member.offset_data + member.size > size:
                yield Skip(name, "scan", "truncated: the member ends past the end of the tar")
                continue
            m = _KEY.match(member.name)
            if m is None:
                yield Skip(name, "scan", "a member without an extension (not part of a WebDataset sample)")
                continue
            if m.group(1) != key and group:
                yield key, group
                group = {}
            key = m.group(1)
            group.setdefault(m.group(2).lower(), member)
    if group:
        yield key, group


class _Member(NamedTuple):
    """What the scan needs of a header, as tarfile.TarInfo names it."""
    name: str
    type: bytes
    offset_data: int
    size: int

    def isreg(self) -> bool:
        return self.type in tarfile.REGULAR_TYPES

    def isdir(self) -> bool:
        return self.type == tarfile.DIRTYPE


BLOCK = 512
RECORD = 20 * BLOCK  # tar pads an archive to records of 20 blocks
_ZERO = bytes(BLOCK)
_TARFILE_READS = frozenset((tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME,
                            tarfile.GNUTYPE_LONGLINK, tarfile.GNUTYPE_SPARSE))


def _members(f, rel: str, size: int) -> Iterator[_Member | tarfile.TarInfo | Skip]:
    """Each header of one tar, read as tarfile reads a ustar header (its name, prefix, type and
    size; a directory's trailing slash dropped) and a pax header's path and size before one (the
    webdataset writer puts a pax header before every member), at a few microseconds a member
    where tarfile takes tens: a million samples' scan is seconds, not a minute before any worker
    starts. From a header only tarfile reads (a global pax header, GNU long names, sparse files,
    a base-256 size, a pax header out of the ordinary) on, tarfile reads the rest. Where tarfile
    would end quietly, this says why, as a skip: a damaged or cut header, a tar without its end
    blocks, bytes after them (tars joined end to end)."""
    fd, pos = f.fileno(), 0
    pax, pax_at = None, 0  # the pax header before this one: its records, and where it starts
    magic = os.pread(fd, 6, 0)
    packed = next((name for name, head in _COMPRESSED_MAGIC if magic.startswith(head)), None)
    if packed:
        yield Skip(rel, "scan", f"a {packed}-compressed tar named .tar: its members cannot be read in place; "
                                "decompress it to a plain .tar")
        return
    while True:
        if pos > size:  # the member before claims to run past the end (a pax size of 2**70): said by samples()
            return
        buf = os.pread(fd, BLOCK, pos)
        if len(buf) < BLOCK:
            if pos == 0:
                yield Skip(rel, "scan", "not a readable tar (empty file)" if not buf else "not a readable tar (shorter "
                                        "than a header)")
            elif pos < size:
                yield Skip(f"{rel}:@{pos}", "scan", f"truncated: a header cut short at byte {pos:,}")
            elif pos == size:  # (past it: the member before ran past the end, and said so)
                yield Skip(f"{rel}:@{pos}", "scan", f"the tar ends at byte {pos:,} without its end blocks: it may "
                                                    "have been cut short there")
            return
        if buf == _ZERO:
            if size - pos > RECORD + BLOCK and os.pread(fd, BLOCK, _next_record(pos + 2 * BLOCK)).strip(b"\0"):
                yield Skip(f"{rel}:@{pos}", "scan", f"{size - pos:,} bytes after the tar's end (byte {pos:,}): tars "
                                                    "joined end to end? Only the first is read; keep them apart")
            return
        header = _header(buf)
        if header is None:
            yield Skip(rel if pos == 0 else f"{rel}:@{pos}", "scan",
                       "not a readable tar (bad header checksum)" if pos == 0 else
                       f"a damaged header at byte {pos:,}: the {size - pos:,} bytes from there on are unreadable")
            return
        if header[2] is None or header[1] in _TARFILE_READS and (pax is not None or header[1] not in _PAX):
            yield from _tarfile_members(f, rel, pax_at if pax is not None else pos)
            return
        name, kind, length = header
        if kind in _PAX:  # its records are the next member's path and size
            pax, pax_at = _pax(os.pread(fd, length, pos + BLOCK)) if length <= PAX_BYTES else None, pos
            if pax is None:
                yield from _tarfile_members(f, rel, pos)
                return
            pos += BLOCK + _padded(length)
            continue
        if pax is not None:
            name, length = pax["path"].rstrip("/") if "path" in pax else name, pax.get("size", length)
            pax = None
        yield _Member(name, kind, pos + BLOCK, length)
        pos += BLOCK
        if kind in tarfile.REGULAR_TYPES or kind not in tarfile.SUPPORTED_TYPES:  # the data tarfile skips too
            pos += _padded(length)


_PAX = (tarfile.XHDTYPE, tarfile.SOLARIS_XHDTYPE)
_COMPRESSED_MAGIC = (("gzip", b"\x1f\x8b"), ("bzip2", b"BZh"), ("xz", b"\xfd7zXZ\x00"), ("zstd", b"\x28\xb5\x2f\xfd"))


PAX_BYTES = 1 << 16  # a pax header longer than this is tarfile's to read


def _header(buf: bytes) -> tuple[str, bytes, int | None] | None:
    """(name, type, size) of a 512-byte ustar header, the size None when it is base-256 (a
    member over 8 GiB, which tarfile reads); None when its checksum or size is damaged."""
    chksum = _octal(buf[148:156])
    if chksum is None or chksum not in _checksums(buf):
        return None
    length = None if buf[124] & 0x80 else _octal(buf[124:136])
    if length is None and not buf[124] & 0x80:
        return None
    name, kind = _text(buf[0:100]), buf[156:157]
    if kind == tarfile.AREGTYPE and name.endswith("/"):
        kind = tarfile.DIRTYPE
    if kind == tarfile.DIRTYPE:
        name = name.rstrip("/")
    prefix = _text(buf[345:500])
    return (f"{prefix}/{name}" if prefix else name), kind, length


def _pax(data: bytes) -> dict | None:
    """A pax header's records ("LENGTH KEY=VALUE\\n" each), its size as an int; None for anything
    tarfile should judge (a record out of form, text that is not UTF-8, a charset, sparse files)."""
    out, pos = {}, 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos, pos + 21)
        if space < 0 or not data[pos:space].isdigit():
            return None
        end = pos + int(data[pos:space])
        if end <= space + 2 or end > len(data) or data[end - 1] != 0x0A:
            return None
        key, eq, value = data[space + 1:end - 1].partition(b"=")
        try:
            key, value = key.decode("utf-8"), value.decode("utf-8")
        except UnicodeDecodeError:
            return None
        if not key or not eq or key == "hdrcharset" or key.startswith("GNU.sparse"):
            return None
        out[key] = value
        pos = end
    if "size" in out:
        if not out["size"].isdigit():
            return None
        out["size"] = int(out["size"])
    return out


def _padded(length: int) -> int:
    return -(-length // BLOCK) * BLOCK


def _next_record(pos: int) -> int:
    return -(-pos // RECORD) * RECORD


def _octal(field: bytes) -> int | None:
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        return None


def _checksums(buf: bytes) -> tuple[int, int]:
    unsigned = 256 + sum(buf) - sum(buf[148:156])
    return (unsigned,) if unsigned == _octal(buf[148:156]) else tarfile.calc_chksums(buf)


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _tarfile_members(f, rel: str, pos: int) -> Iterator[tarfile.TarInfo | Skip]:
    """tarfile's reading of the headers from byte `pos` on (a header at a time in memory)."""
    f.seek(pos)
    try:
        tar = tarfile.open(fileobj=f, mode="r:")
    except (tarfile.TarError, OSError) as exc:
        yield Skip(f"{rel}:@{pos}", "scan", f"unreadable from byte {pos:,} on ({str(exc).splitlines()[0][:200]})")
        return
    while True:
        try:
            member = tar.next()
        except (tarfile.TarError, OSError) as exc:
            yield Skip(f"{rel}:@{tar.offset}", "scan", f"unreadable from here on ({str(exc).splitlines()[0][:200]})")
            return
        if member is None:
            return
        tar.members.clear()  # a header's memory at a time, not the tar's
        yield member


_TYPES = {tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hard link", tarfile.CHRTYPE: "character device",
          tarfile.BLKTYPE: "block device", tarfile.FIFOTYPE: "FIFO"}


def fields_of(tars: list[tuple[str, str]], options: FieldOptions) -> tuple[dict, list[str]]:
    """The member extension of each role, from the first sample that has an image, in the
    first tar that has one (an empty or unreadable tar before it says nothing of the rest; the
    json field of a caption as `json:FIELD`), and the extensions the build leaves out."""
    first_skip = None
    for rel, path in tars:
        found = _fields_of(path, rel, options)
        if isinstance(found, tuple):
            return found
        first_skip = first_skip or found
    if first_skip is not None:
        raise ConfigError(f"{first_skip.key}: {first_skip.reason}; no tar of RAW has a sample with an image")
    raise ConfigError(f"{tars[0][0]}{' ...' if len(tars) > 1 else ''}: no sample with an image member "
                      f"({', '.join('.' + e for e in IMAGE_MEMBERS)}); pass --image-key EXT if its images have "
                      "another extension")


def _fields_of(path: str, rel: str, options: FieldOptions) -> tuple[dict, list[str]] | Skip | None:
    """`fields_of` of one tar; else its first skip, or None."""
    first_skip = None
    for sample in samples(path, rel):
        if isinstance(sample, Skip):
            first_skip = first_skip or sample
            continue
        exts = list(sample[1])
        spellings = {"image": IMAGE_MEMBERS, "text": TEXT_MEMBERS, "label": ("cls", "label", "labels"), "id": ()}
        chosen = choose(exts, options, f"the samples of {rel} (member extensions)", spellings=spellings,
                        roles=("image", "text", "label"))
        if chosen["image"] is None:
            continue
        if chosen["text"] is None and not options.no_text and "json" in sample[1]:
            chosen["text"] = _json_caption(path, sample[1]["json"], options)
        chosen["id"] = None
        used = {chosen[r].split(":")[0] for r in ("image", "text", "label") if chosen[r]}
        if options.image is None:  # each sample's own image member, whichever it is
            chosen["image"], used = "/".join(IMAGE_MEMBERS[:3]) + "/...", used | set(IMAGE_MEMBERS)
        return chosen, sorted(set(exts) - used)
    return first_skip


def _json_caption(path: str, member: tarfile.TarInfo, options: FieldOptions) -> str | None:
    import json

    if member.size > JSON_BYTES:
        return None
    with open(path, "rb") as f:
        f.seek(member.offset_data)
        try:
            doc = json.loads(f.read(member.size))
        except ValueError:
            return None
    if not isinstance(doc, dict):
        return None
    key = next((k for k in ("caption", "text", "txt") if isinstance(doc.get(k), str)), None)
    return f"json:{key}" if key else None


def records(path: str, rel: str, fields: dict, labels: dict, image_key: str | None = None,
            kept: tuple = ()) -> Iterator[Record | Skip]:
    """A record per sample of one tar, the label read from its member (`labels`: label text ->
    the class it names, filled as labels are met), or a Skip saying why it is none. Its image
    is the member `image_key` names, else its first of IMAGE_MEMBERS (a shard may mix them);
    `kept`: --fields, read from its `.json` member."""
    text, label = fields["text"], fields["label"]
    text_ext = text.split(":")[0] if text else None
    with open(path, "rb") as f:
        for sample in samples(path, rel):
            if isinstance(sample, Skip):
                yield sample
                continue
            key, members = sample
            name = f"{rel}:{key}"
            image = image_key or next((e for e in IMAGE_MEMBERS if e in members), None)
            if image not in members:
                wanted = f".{image_key}" if image_key else "image"
                yield Skip(name, "scan", f"no {wanted} member ({', '.join('.' + e for e in members)}): not a sample "
                                         "with an image")
                continue
            item = {"key": name, "path": path, "at": (members[image].offset_data, members[image].size)}
            if text_ext is not None:
                if text_ext not in members:
                    yield Skip(name, "scan", f"no .{text_ext} member: a sample without its caption")
                    continue
                m = members[text_ext]
                item["text_at"] = (m.offset_data, m.size, text_ext)
            if label is not None:
                value = _label_text(f, members.get(label))
                if value is None:
                    yield Skip(name, "scan", f"no .{label} member that holds a label (a short line of text)")
                    continue
                item["label"] = labels.setdefault(value, len(labels))
            if kept:
                values = extra.values(_json_member(f, members.get("json")), kept)
                if isinstance(values, str):
                    yield Skip(name, "scan", values)
                    continue
                item["extra"] = values
            yield Record(**item)


def _json_member(f, member) -> dict:
    """A sample's `.json` member as a dict ({} when it has none, or one that is not a JSON object)."""
    import json

    if member is None or member.size > JSON_BYTES:
        return {}
    try:
        doc = json.loads(os.pread(f.fileno(), member.size, member.offset_data))
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _label_text(f, member: tarfile.TarInfo | None) -> str | None:
    if member is None or member.size > LABEL_BYTES:
        return None
    try:
        text = os.pread(f.fileno(), member.size, member.offset_data).decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    return text or None
