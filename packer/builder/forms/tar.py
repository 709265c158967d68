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

from packer.builder.forms.fields import FieldOptions, choose
from packer.builder.records import Record
from packer.dataset.format import Skip
from packer.errors import ConfigError

IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "gif")
TEXT_MEMBERS = ("txt", "caption", "text")
LABEL_BYTES = 64  # a .cls member longer than this is not a label
JSON_BYTES = 1 << 20  # a .json member read to see which field holds the caption
_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset's: the key up to the first dot of the name
COMPRESSED = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")


def is_tar(rel: str) -> bool:
    return rel.lower().endswith(".tar")


def samples(path: str, rel: str) -> Iterator[tuple[str, dict[str, tarfile.TarInfo]] | Skip]:
    """(key, {extension: member}) of each sample of one tar, members grouped while consecutive
    with one key (as WebDataset groups them), or a Skip for what cannot be one."""
    try:
        tar = tarfile.open(path, mode="r:")
    except (tarfile.TarError, OSError) as exc:
        yield Skip(rel, "scan", f"not a readable tar ({str(exc).splitlines()[0][:200]})")
        return
    size = os.fstat(tar.fileobj.fileno()).st_size
    key, group = None, {}
    with tar:
        while True:
            try:
                member = tar.next()
            except (tarfile.TarError, OSError) as exc:
                yield Skip(f"{rel}:{key or ''}", "scan", f"unreadable from here on ({str(exc).splitlines()[0][:200]})")
                break
            if member is None:
                break
            tar.members.clear()  # a header's memory at a time, not the tar's
            name = f"{rel}:{member.name}"
            if member.isdir():
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


_TYPES = {tarfile.SYMTYPE: "symlink", tarfile.LNKTYPE: "hard link", tarfile.CHRTYPE: "character device",
          tarfile.BLKTYPE: "block device", tarfile.FIFOTYPE: "FIFO"}


def fields_of(path: str, rel: str, options: FieldOptions) -> tuple[dict, list[str]]:
    """The member extension of each role, from the first sample that has an image (the json
    field of a caption as `json:FIELD`), and the extensions the build leaves out."""
    for sample in samples(path, rel):
        if isinstance(sample, Skip):
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
    raise ConfigError(f"{rel}: no sample with an image member ({', '.join('.' + e for e in IMAGE_MEMBERS)}); "
                      "pass --image-key EXT if its images have another extension")


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


def records(path: str, rel: str, fields: dict, labels: dict, image_key: str | None = None) -> Iterator[Record | Skip]:
    """A record per sample of one tar, the label read from its member (`labels`: label text ->
    the class it names, filled as labels are met), or a Skip saying why it is none. Its image
    is the member `image_key` names, else its first of IMAGE_MEMBERS (a shard may mix them)."""
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
            yield Record(**item)


def _label_text(f, member: tarfile.TarInfo | None) -> str | None:
    if member is None or member.size > LABEL_BYTES:
        return None
    f.seek(member.offset_data)
    try:
        text = f.read(member.size).decode("utf-8").strip()
    except UnicodeDecodeError:
        return None
    return text or None
