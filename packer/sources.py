"""Finds records in RAW, in a deterministic order, and detects its layout.

Three layouts: image class folders (`RAW/<class>/.../<file>`), image + caption pairs
(`<stem>.<image ext>` beside `<stem>.txt` / `<stem>.json`), and text (`*.jsonl`, `*.txt`,
`*.parquet`). Every file under RAW is either a record or a recorded skip, so found = packed +
skipped holds from the first step on. Documents inside JSONL and Parquet files are streamed
later by `packer.text`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import SourceError
from .format import Skip

IMAGE_EXTS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
CAPTION_EXTS = (".txt", ".json")  # preference order when both exist
TEXT_EXTS = frozenset({".jsonl", ".txt", ".parquet"})


@dataclass(frozen=True)
class Record:
    """One raw input: an image (with its label or caption) or a text file of documents."""

    key: str  # relative path, "/"-separated
    path: Path
    label: int | None = None
    caption: Path | None = None


@dataclass(frozen=True)
class Scan:
    kind: str
    records: tuple[Record, ...]
    skipped: tuple[Skip, ...]
    classes: tuple[str, ...] | None = None


def list_files(raw: Path) -> tuple[list[tuple[str, Path]], list[Skip]]:
    """All files under RAW as sorted (relative posix path, path); dangling links are skips.
    Symlinked files are followed; symlinked folders are not (no cycles)."""
    files, skipped = [], []
    for dirpath, dirnames, filenames in os.walk(raw):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(raw).as_posix()
            if name.startswith("."):
                skipped.append(Skip(rel, "scan", "hidden file"))
            elif not path.exists():
                skipped.append(Skip(rel, "scan", "dangling symlink"))
            else:
                files.append((rel, path))
    files.sort()
    skipped.sort(key=lambda s: s.key)
    return files, skipped


def _ext(rel: str) -> str:
    return os.path.splitext(rel)[1].lower()


def _stem(rel: str) -> str:
    return os.path.splitext(rel)[0]


def detect_kind(files: list[tuple[str, Path]]) -> str:
    rels = [rel for rel, _ in files]
    stems_with_caption = {_stem(r) for r in rels if _ext(r) in CAPTION_EXTS}
    images = [r for r in rels if _ext(r) in IMAGE_EXTS]
    if any(_stem(r) in stems_with_caption for r in images):
        return "pairs"
    if any("/" in r for r in images):
        return "images"
    if any(_ext(r) in TEXT_EXTS for r in rels):
        return "text"
    return ""


def scan(raw: str | Path, kind: str | None = None, classes: tuple[str, ...] | None = None) -> Scan:
    """Records of RAW in sorted relative-path order; `kind` forces the layout. `classes`: the
    class list of a dataset being appended to; new class names are added after it, sorted."""
    raw = Path(raw)
    if not raw.is_dir():
        raise SourceError(f"{raw}: not a directory")
    files, skipped = list_files(raw)
    if not files:
        raise SourceError(f"{raw}: no input files found (empty RAW)")
    kind = kind or detect_kind(files)
    if not kind:
        exts = sorted({_ext(r) or "(none)" for r, _ in files})[:8]
        raise SourceError(
            f"{raw}: no recognisable layout (found {len(files)} files with extensions "
            f"{', '.join(exts)}); expected <class>/<image>, <stem>.<image>+<stem>.txt, or "
            "*.jsonl/*.txt/*.parquet; use --kind to force one"
        )
    if kind == "images":
        return _scan_images(files, skipped, classes or ())
    return {"pairs": _scan_pairs, "text": _scan_text}[kind](files, skipped)


def _scan_images(files, skipped, known: tuple[str, ...]) -> Scan:
    found = {rel.split("/", 1)[0] for rel, _ in files if "/" in rel and _ext(rel) in IMAGE_EXTS}
    classes = [*known, *sorted(found - set(known))]
    index = {name: i for i, name in enumerate(classes)}
    records = []
    for rel, path in files:
        if _ext(rel) not in IMAGE_EXTS:
            skipped.append(Skip(rel, "scan", f"not an image extension ({_ext(rel) or 'none'})"))
        elif "/" not in rel:
            skipped.append(Skip(rel, "scan", "image outside a class folder"))
        else:
            records.append(Record(rel, path, label=index[rel.split("/", 1)[0]]))
    return Scan("images", tuple(records), tuple(skipped), tuple(classes))


def _scan_pairs(files, skipped) -> Scan:
    captions = {}
    for rel, path in files:
        if _ext(rel) in CAPTION_EXTS:
            captions.setdefault(_stem(rel), []).append((rel, path))
    records, used, used_stems = [], set(), set()
    for rel, path in files:
        ext = _ext(rel)
        if ext in IMAGE_EXTS:
            options = sorted(captions.get(_stem(rel), []), key=lambda c: CAPTION_EXTS.index(_ext(c[0])))
            if not options:
                skipped.append(Skip(rel, "scan", "image without a caption (.txt or .json)"))
                continue
            records.append(Record(rel, path, caption=options[0][1]))
            used.add(options[0][0])
            used_stems.add(_stem(rel))
        elif ext not in CAPTION_EXTS:
            skipped.append(Skip(rel, "scan", f"neither an image nor a caption ({ext or 'no extension'})"))
    for rel, _ in files:
        if _ext(rel) in CAPTION_EXTS and rel not in used:
            paired = _stem(rel) in used_stems
            reason = "second caption for an image (the .txt one is used)" if paired else "caption without an image"
            skipped.append(Skip(rel, "scan", reason))
    return Scan("pairs", tuple(records), tuple(skipped))


def _scan_text(files, skipped) -> Scan:
    records = []
    for rel, path in files:
        if _ext(rel) in TEXT_EXTS:
            records.append(Record(rel, path))
        else:
            skipped.append(Skip(rel, "scan", f"not a text file ({_ext(rel) or 'no extension'})"))
    return Scan("text", tuple(records), tuple(skipped))
