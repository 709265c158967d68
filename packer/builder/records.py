"""What a scan finds: records (one per sample, with where its bytes are) and the scan of RAW
that holds them, with the file extensions that make each layout. Shared by the scan, the input
forms (`packer.builder.forms`), the plan and the workers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from packer.dataset.format import Skip

IMAGE_EXTS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
TXT, JSONL, PARQUET = ".txt", ".jsonl", ".parquet"  # the text formats, by extension
CAPTION_EXTS = (TXT, ".json")  # preference order when both exist
TEXT_EXTS = frozenset({TXT, JSONL, PARQUET})
MULTI_DOC_EXTS = frozenset({JSONL, PARQUET})  # a document per line / row: sample keys carry ":line" / ":row"
T = TypeVar("T")


@dataclass(frozen=True)
class Record:
    """One raw input: an image (with its label or caption) or a text file of documents. An
    image inside another file (a tar member, a Parquet row) is `path` that file and `at` where
    in it (`packer.builder.forms.read` reads it); a caption is a file beside the image
    (`caption`), the manifest's text (`text`) or a tar member (`text_at`)."""

    key: str  # relative path, "/"-separated (`:N` or `:id` for a sample inside a file)
    path: str  # as the scan found it; a str, not a Path: a Path is slower to make for every file of
    # RAW and to unpickle in pool workers
    label: int | None = None
    caption: str | None = None
    at: tuple[int, int] | None = None  # a tar member's (data offset, size); a Parquet row's (row group, row in it)
    text: str | None = None
    text_at: tuple[int, int, str] | None = None  # a tar member's (data offset, size, extension)
    extra: tuple = ()  # (name, value) of each other column it has (--fields', a COCO image's boxes), as stored
    size: tuple[int, int] | None = None  # (width, height) its annotation gives (COCO): its file must be so


@dataclass(frozen=True)
class Scan:
    kind: str
    records: tuple[Record, ...]
    skipped: tuple[Skip, ...]
    classes: tuple[str, ...] | None = None
    stats: Mapping[str, tuple[int, int]] = field(default_factory=dict, repr=False, compare=False)
    """(size, mtime_ns) of each file listed, by its path: taken once, by the scan's stat."""
    why: str = ""  # what in RAW made the layout this one (for messages)
    form: str = "folder"  # the input form (`packer.builder.forms.FORMS`)
    fields: Mapping[str, str | None] | None = None  # a form's field of each role (image, text, label, id)
    sources: tuple[str, ...] = ()  # the files a form's records come from (manifests, tars, Parquet files)
    ignored: tuple[str, ...] = ()  # fields the input has that the build does not pack (said in its summary)
    extras: tuple = ()  # the records' other columns (--fields', `packer.builder.forms.extra`; COCO's boxes)
    notes: Mapping[str, int] = field(default_factory=dict)  # what the input got wrong, counted (COCO's boxes)
