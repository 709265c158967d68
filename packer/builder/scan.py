"""Finds records in RAW, in a deterministic order, and detects its layout.

Three layouts: image class folders (`RAW/<class>/.../<file>`), image + caption pairs
(`<stem>.<image ext>` beside `<stem>.txt` / `<stem>.json`), and text (`*.jsonl`, `*.txt`,
`*.parquet`). Every file under RAW is either a record or a recorded skip, so found = packed +
skipped holds from the first step on. Documents inside JSONL and Parquet files are streamed
later by `packer.builder.text`. `prefetch` / `read_ahead` ask the kernel to read records' files before
the decoders reach them.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from packer.builder.records import (CAPTION_EXTS, IMAGE_EXTS, JSONL, MULTI_DOC_EXTS, PARQUET, TEXT_EXTS, TXT, Record,
                                    Scan, T)
from packer.builder import forms
from packer.builder.chat import scan as chat_scan
from packer.builder.audio_scan import is_audio, scan_audio
from packer.builder.forms.fields import FieldOptions
from packer.errors import ConfigError, SourceError
from packer.system import ChildDied, in_forked_child, single_threaded
from packer.dataset.format import Skip, printable

__all__ = ["CAPTION_EXTS", "IMAGE_EXTS", "JSONL", "MULTI_DOC_EXTS", "PARQUET", "TEXT_EXTS", "TXT", "Record", "Scan",
           "scan", "list_files", "find_classes", "read_ahead", "prefetch"]



def list_files(raw: Path) -> tuple[list[tuple[str, str]], list[Skip], dict[str, tuple[int, int]]]:
    """All files under RAW as sorted (relative posix path, path), the skips (hidden files,
    dangling links, FIFOs and other non-regular files, unreadable folders, names that are not
    UTF-8) and each file's (size, mtime_ns), from one stat per file. Symlinks are followed, to
    files and to folders, as torchvision's ImageFolder follows them; a folder that links back to
    one it is inside is a skip (a loop). Hidden folders are left out, as version-control and
    editor folders should be."""
    files, skipped, stats = [], [], {}
    root = os.fspath(raw)
    cut = len(os.path.join(root, ""))
    todo = [(root, frozenset())]  # a folder, and the (device, inode) of it and every folder above it
    while todo:
        folder, above = todo.pop()
        try:
            st = os.stat(folder)
            entries = list(os.scandir(folder))
        except OSError as exc:
            if folder == root:
                raise SourceError(f"{raw}: cannot read the folder ({exc.strerror or exc})") from None
            skipped.append(Skip(printable(folder[cut:]), "scan", f"unreadable folder ({exc.strerror or exc})"))
            continue
        above = above | {(st.st_dev, st.st_ino)}
        for entry in entries:
            rel = entry.path[cut:].replace(os.sep, "/")
            shown = printable(rel)  # what a skip can name: keys are UTF-8
            if _is_dir(entry):
                if entry.name.startswith("."):
                    continue
                try:
                    target = entry.stat()
                except OSError as exc:
                    skipped.append(Skip(shown, "scan", f"unreadable folder ({exc.strerror or exc})"))
                    continue
                if (target.st_dev, target.st_ino) in above:
                    skipped.append(Skip(shown, "scan", "symlink to a folder it is inside (a loop, not followed)"))
                else:
                    todo.append((entry.path, above))
            elif entry.name.startswith("."):
                skipped.append(Skip(shown, "scan", "hidden file"))
            else:
                try:
                    st = entry.stat()
                except OSError:
                    skipped.append(Skip(shown, "scan", "dangling symlink"))
                    continue
                if not stat.S_ISREG(st.st_mode):  # a FIFO would block the build that reads it
                    skipped.append(Skip(shown, "scan", "not a regular file"))
                elif shown != rel:
                    skipped.append(Skip(shown, "scan", "its path is not valid UTF-8; rename it"))
                else:
                    files.append((rel, entry.path))
                    stats[entry.path] = (st.st_size, st.st_mtime_ns)
    files.sort()
    skipped.sort(key=lambda s: s.key)
    return files, skipped, stats


def find_classes(raw: Path) -> list[str]:
    """torchvision ImageFolder's `find_classes`: every folder in RAW (hidden ones and links to
    folders included), sorted, so that labels are the ones ImageFolder gives the same tree."""
    with os.scandir(raw) as entries:
        return sorted(entry.name for entry in entries if _is_dir(entry))


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _ext(rel: str) -> str:
    return os.path.splitext(rel)[1].lower()


def _stem(rel: str) -> str:
    return os.path.splitext(rel)[0]


def detect_kind(files: list[tuple[str, str]]) -> tuple[str, str]:
    """(kind, why) of a RAW's files: the layout, and what in RAW made it so ("" when none)."""
    exts = [(rel, _ext(rel)) for rel, _ in files]
    stems_with_caption = {_stem(r) for r, ext in exts if ext in CAPTION_EXTS}
    images = [r for r, ext in exts if ext in IMAGE_EXTS]
    texts = sum(ext in TEXT_EXTS for _, ext in exts)
    captioned = sum(_stem(r) in stems_with_caption for r in images) if stems_with_caption else 0
    if captioned:
        return "pairs", f"{captioned:,} images have a caption beside them (<stem>.txt or <stem>.json)"
    folders = {r.split("/", 1)[0] for r in images if "/" in r}
    if folders:
        return "images", f"{len(images):,} images in {len(folders):,} class folders"
    if images and len(images) >= texts:
        return "images", f"{len(images):,} images in one flat folder (no classes, no labels)"
    if texts:
        return "text", f"{texts:,} .txt/.jsonl/.parquet files and {len(images):,} images"
    return "", ""


def scan(raw: str | Path, kind: str | None = None, classes: tuple[str, ...] | None = None, *,
         options: FieldOptions | None = None, form: str | None = None) -> Scan:
    """Records of RAW in sorted relative-path order; `kind` forces the layout, `form` the input
    form (`packer.builder.forms`: detected from the files when None). `classes`: the class list
    of a dataset being appended to; new class names are added after it, sorted."""
    raw = Path(raw)
    options = options or FieldOptions()
    if not raw.is_dir():
        raise SourceError(f"{raw}: not a directory")
    files, skipped, stats = list_files(raw)
    if not files:
        raise SourceError(f"{raw}: no input files found (empty RAW)")
    if single_threaded() and any(_ext(rel) == PARQUET for rel, _ in files):
        # pyarrow starts threads as it is imported, after which this process could no longer
        # fork its build workers (they would start from a forkserver, a second or more of a
        # build): its Parquet files are read in a child of its own
        try:
            return in_forked_child(_scan_files, raw, files, skipped, stats, kind, classes, options, form)
        except ChildDied as exc:
            raise SourceError(f"{raw}: the scan of its Parquet files died ({exc}): one of them is damaged past what "
                              "pyarrow survives; build them a few at a time to find it") from None
    return _scan_files(raw, files, skipped, stats, kind, classes, options, form)


def _scan_files(raw: Path, files: list[tuple[str, str]], skipped: list[Skip], stats: dict, kind: str | None,
                classes: tuple[str, ...] | None, options: FieldOptions, form: str | None) -> Scan:
    if kind == "audio" and form not in (None, "folder"):
        raise ConfigError(f"--kind audio reads a folder of audio files, not {forms.NAMES[form]}; drop --input")
    if form in (None, "chat") and kind in (None, "chat"):
        chat_fields = chat_scan.detect(files, options.max_doc_bytes)
        if chat_fields is not None or kind == "chat":
            if chat_fields is None:
                raise SourceError(f"{raw}: --kind chat, but no record of its JSONL, JSON or Parquet files holds "
                                  "messages ('messages' or 'conversations': a list of {role, content}) or a "
                                  "preference pair ('chosen', 'rejected')")
            return replace(chat_scan.scan(raw, files, skipped, chat_fields, options.max_doc_bytes), stats=stats)
    form = form or (None if kind in ("text", "audio") else forms.detect(files, options)) or "folder"
    if form != "folder":
        if classes is not None:
            raise ConfigError(f"{raw}: --append adds a folder's new files; {forms.NAMES[form]} is built whole: "
                              "build it again with --overwrite")
        return forms.scan(form, raw, files, skipped, stats, options, kind)
    audio = sum(is_audio(rel) for rel, _ in files)
    if kind == "audio" or (kind is None and audio and audio >= sum(_ext(rel) in IMAGE_EXTS for rel, _ in files)):
        found = scan_audio(raw, files, skipped, classes, options.split, options.max_doc_bytes, options.no_text,
                           quoted_tsv=options.quoted_tsv, kept=options.fields)
        return replace(found, stats=stats, why=found.why if kind is None else f"forced with --kind ({found.why})")
    files = _without_audio(files, skipped, kind)
    if not files:
        raise SourceError(f"{raw}: nothing to pack as {kind}: its files are audio; pass --kind audio")
    detected, why = detect_kind(files)
    kind, why = (kind, "forced with --kind") if kind else (detected, why)
    if not kind:
        exts = sorted({_ext(r) or "(none)" for r, _ in files})[:8]
        raise SourceError(
            f"{raw}: no recognisable layout (found {len(files)} files with extensions "
            f"{', '.join(exts)}); expected <class>/<image>, <stem>.<image>+<stem>.txt, *.jsonl/*.txt/*.parquet text, "
            "Hugging Face Parquet, WebDataset tars or a manifest of image files; use --kind or --input to force one"
        )
    ignored: tuple[str, ...] = ()
    if kind == "pairs" and options.no_text:
        kind, ignored = "images", ("captions (--no-text)",)
        skipped += [Skip(rel, "scan", "a caption, left out (--no-text)") for rel, _ in files if _ext(rel) in CAPTION_EXTS]
        files = [(rel, path) for rel, path in files if _ext(rel) not in CAPTION_EXTS]
    if kind == "images":
        found = _scan_images(raw, files, skipped, classes)
    else:
        found = {"pairs": _scan_pairs, "text": _scan_text}[kind](files, skipped)
    return replace(found, stats=stats, why=why, ignored=ignored)


def _without_audio(files: list[tuple[str, str]], skipped: list[Skip], kind: str | None) -> list[tuple[str, str]]:
    """RAW's files less its audio files and their transcripts (`<stem>.txt` / `.json` beside
    one), which are skips of an image or text build: audio files with transcripts are not a
    text dataset."""
    audio = {_stem(rel): rel for rel, _ in files if is_audio(rel)}
    if not audio:
        return files
    why = "forced with --kind" if kind else "more images than audio files"
    kept = []
    for rel, path in files:
        if is_audio(rel):
            skipped.append(Skip(rel, "scan", f"audio, in a build of {kind or 'images'} ({why}); build it apart "
                                             "with --kind audio"))
        elif _ext(rel) in CAPTION_EXTS and _stem(rel) in audio:
            skipped.append(Skip(rel, "scan", f"the transcript of {audio[_stem(rel)]}, whose audio is not packed here"))
        else:
            kept.append((rel, path))
    return kept


def _scan_images(raw: Path, files, skipped, known: tuple[str, ...] | None) -> Scan:
    """Class folders, or, when no image is in a folder, one flat folder of unlabeled images
    (classes None). Labels index ImageFolder's classes (`find_classes`: every folder of RAW,
    sorted, those with no image included), after `known` ones (an append)."""
    flat = known is None and not any("/" in rel for rel, _ in files if _ext(rel) in IMAGE_EXTS)
    images = []  # (rel, path, class name)
    for rel, path in files:
        ext = _ext(rel)
        if ext not in IMAGE_EXTS:
            skipped.append(Skip(rel, "scan", f"not an image extension ({ext or 'none'})"))
        elif "/" not in rel and not flat:
            skipped.append(Skip(rel, "scan", "image outside a class folder"))
        else:
            images.append((rel, path, None if flat else rel.split("/", 1)[0]))
    if flat:
        return Scan("images", tuple(Record(rel, path) for rel, path, _ in images), tuple(skipped), None)
    known = known or ()
    names = [name for name in find_classes(raw) if printable(name) not in known]
    index = {name: len(known) + i for i, name in enumerate(names)}
    index.update((name, i) for i, name in enumerate(known))
    records = [Record(rel, path, label=index[name]) for rel, path, name in images]
    return Scan("images", tuple(records), tuple(skipped), (*known, *map(printable, names)))


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


# -- reading ahead ---------------------------------------------------------------------------
PREFETCH_BYTES = 4 * 1024**2  # of each file: all of an image, caption or text file
READ_AHEAD = 128  # records


def prefetch(records: Iterable[Record]) -> None:
    """Ask the kernel to start reading these records' files into the page cache (WILLNEED) and
    return at once, so that a decoder reaching them later finds them there instead of waiting on
    the disk for one small file after another. When the first and the last of them are cached
    already (a warm page cache: the usual second build), nothing more is asked: an open and an
    fadvise a file would cost CPU for nothing. JSONL and Parquet
    files are left to the kernel's own readahead: they are big, read in order, and a shard's
    range of one may start far into it. A file that cannot be opened is left to the reader,
    which reports it."""
    if not hasattr(os, "posix_fadvise"):
        return
    paths = [path for record in records if record.at is None for path in (record.path, record.caption)
             if path is not None and _ext(path) not in MULTI_DOC_EXTS]  # a tar's or Parquet's: the kernel's readahead
    if not paths or (_cached(paths[0]) and _cached(paths[-1])):
        return
    for path in paths:
        fd = _open_nonblocking(path)
        if fd is None:
            continue
        try:
            os.posix_fadvise(fd, 0, PREFETCH_BYTES, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def _open_nonblocking(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block
    except OSError:
        return None


def _cached(path: str) -> bool:
    """Whether the first page of `path` is in the page cache: a one-byte read that may not
    wait for the disk (Linux RWF_NOWAIT). False where that cannot be told. A miss may start the
    kernel's readahead of the file, which is what a prefetch wants anyway."""
    if not hasattr(os, "RWF_NOWAIT"):
        return False
    fd = _open_nonblocking(path)
    if fd is None:
        return False
    try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        return True
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP, ESPIPE, EISDIR: cannot tell
        return False
    finally:
        os.close(fd)


def read_ahead(items: Iterable[T], record: Callable[[T], Record], ahead: int = READ_AHEAD) -> Iterator[T]:
    """`items` in order, the file of each one's `record(item)` prefetched `ahead` items before
    the item is reached."""
    window: deque = deque()
    for item in items:
        prefetch((record(item),))
        window.append(item)
        if len(window) > ahead:
            yield window.popleft()
    yield from window
