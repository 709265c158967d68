"""The input forms whose records live inside files: Hugging Face Parquet (`parquet`), WebDataset
tars (`tar`) and manifests naming image files (`manifest`), beside the folder layouts of
`packer.builder.scan`. Each is a reader of records plugged in at the scan: detected from RAW's
files (or named with --input), it yields one record per sample and a skip for everything else
it found, and every later step (plan, pool, crash isolation, skips, byte-identical output) is
the folders' own. Workers read a record's bytes through `forms.read`.
"""

from __future__ import annotations

import os
from pathlib import Path

from packer.builder.audio import EXTS as AUDIO_EXTS
from packer.builder.forms import coco, extra, labels, manifest, parquet, splits, tar
from packer.builder.forms.fields import FieldOptions, describe
from packer.builder.records import IMAGE_EXTS, Record, Scan
from packer.dataset.format import Skip
from packer.errors import ConfigError, SourceError

FORMS = ("folder", "parquet", "tar", "manifest", "coco")
NAMES = {"parquet": "Hugging Face Parquet", "tar": "WebDataset tars", "manifest": "a manifest of image files",
         "coco": "COCO detection annotations"}
PROBED = 4  # JSON / CSV / JSONL files looked into to tell a manifest from text
INPUT_EXTS = IMAGE_EXTS | AUDIO_EXTS | {".txt", ".jsonl", ".json", ".csv", ".tsv", ".tar"}  # inputs besides Parquet


def detect(files: list[tuple[str, str]], options: FieldOptions) -> str | None:
    """The form RAW's files are in, when it is one of these (else None: a folder layout)."""
    if any(tar.is_tar(rel) for rel, _ in files):
        return "tar"
    if coco.annotation_files(files):
        return "coco"
    probed = 0
    unreadable = []
    for rel, path in files:
        ext = os.path.splitext(rel)[1].lower()
        if ext == ".parquet":
            pfile = parquet.open_file(path)
            if isinstance(pfile, str):
                unreadable.append(f"{rel}: {pfile}")
            else:
                if parquet.image_column(pfile, options) is not None:
                    return "parquet"
                if parquet.path_column(pfile, options) is not None:
                    return "manifest"
        elif ext in manifest.EXTS and probed < PROBED:
            probed += 1
            if manifest.fields_of(path, rel, options) is not None:
                return "manifest"
    if unreadable and not any(os.path.splitext(rel)[1].lower() in INPUT_EXTS for rel, _ in files):
        # nothing else to pack: the layouts would take it for text, and say so, not what it is
        raise SourceError(f"{unreadable[0]}; it is the only input of RAW: copy it again whole (a cut or damaged file)")
    return None


def scan(form: str, raw: Path, files: list[tuple[str, str]], skipped: list[Skip], stats: dict,
         options: FieldOptions, kind: str | None) -> Scan:
    """The records of RAW in `form`: its samples in file order (sorted relative paths), then
    row, member or line order; `kind` "images" leaves captions out, "pairs" needs them."""
    if kind == "text":
        raise ConfigError(f"--kind text: {raw} is {NAMES[form]}, whose samples are images; drop --kind, or pass "
                          "--input folder to read its files as text")
    if kind == "images":
        options = FieldOptions(**{**options.__dict__, "no_text": True})
    if form == "coco":
        return _scan_coco(raw, files, skipped, stats, options)
    probed: dict = {}  # a manifest's fields, by its path: probed once
    chosen = manifest_named(raw, files, options.manifest) if form == "manifest" else None
    mine = []
    for rel, path in files:
        if chosen is not None and rel != chosen and os.path.splitext(rel)[1].lower() in manifest.EXTS:
            skipped.append(Skip(rel, "scan", f"not --manifest {chosen}"))
        elif _is(form, rel, path, options, probed):
            mine.append((rel, path))
        elif not (form == "manifest" and os.path.splitext(rel)[1].lower() in IMAGE_EXTS):  # those: _unnamed
            skipped.append(Skip(rel, "scan", _not_mine(form, rel)))
    if not mine:
        raise SourceError(_none_found(raw, form, files, options))
    mine, other = splits.pick(mine, options.split, raw)
    skipped += other
    named: dict = {}  # (device, inode) of every image a manifest's record names -> that manifest
    fields, ignored, items, met = _read(form, mine, options, stats, named, probed, manifest.Inside(raw))
    names = fields.pop("class_names", None)  # a Hugging Face ClassLabel's
    if options.classes is not None:
        names = options.classes
    elif names is not None:
        labels.check_distinct(names, f"{mine[0][0]}: its ClassLabel ({fields['label']})")
    if fields["label"] is not None:
        where = mine[0][0] if len(mine) == 1 else f"{mine[0][0]} ... ({len(mine)} files)"
        items, classes = labels.assign(items, met, names, f"{where}: the labels ({fields['label']})")
    else:
        classes = None
    items, extras = extra.typed(items, options.fields)
    records = _unique([r for r in items if isinstance(r, Record)], skipped)
    skipped += [s for s in items if isinstance(s, Skip)]
    if form == "manifest":
        skipped += _unnamed(files, named)
    if kind == "pairs" and fields["text"] is None:
        raise ConfigError(f"--kind pairs: {raw}'s samples have no caption field ({describe(fields)})")
    why = f"{NAMES[form]} ({describe(fields)})"
    return Scan("pairs" if fields["text"] else "images", tuple(records), tuple(sorted(skipped, key=lambda s: s.key)),
                classes, stats, why, form=form, fields=fields, sources=tuple(p for _, p in mine),
                ignored=tuple(i for i in ignored if i not in {f.name for f in options.fields}), extras=extras)


def _scan_coco(raw: Path, files: list[tuple[str, str]], skipped: list[Skip], stats: dict,
               options: FieldOptions) -> Scan:
    """A COCO layout's images with their boxes (`coco`); the other files of RAW skips."""
    if options.whole_images is None:
        raise ConfigError(f"{raw}: COCO detection data is built as whole images, its boxes scaled with them: pass "
                          "--keep-aspect (with --image-size S), or --image-size keep; a centre crop would cut boxes")
    counts: dict = {}
    items, names, used, sources = coco.scan(raw, files, options.split, *options.whole_images, counts)
    listed = {r.path for r in items if isinstance(r, Record)}
    for rel, path in files:
        if rel in sources or path in listed:
            continue
        ext = os.path.splitext(rel)[1].lower()
        skipped.append(Skip(rel, "scan", "an image the annotation does not list" if ext in IMAGE_EXTS else
                            "neither an image the annotation lists nor the annotation"))
    records = _unique([r for r in items if isinstance(r, Record)], skipped)
    skipped += [s for s in items if isinstance(s, Skip)]
    why = f"{NAMES['coco']} ({used}: {len(records):,} images, {len(names)} categories)"
    return Scan("images", tuple(records), tuple(sorted(skipped, key=lambda s: s.key)), names, stats, why,
                form="coco", fields={"image": "file_name", "label": "box_labels"}, sources=(str(raw / used),),
                extras=coco.COLUMNS, notes={k: v for k, v in sorted(counts.items()) if v})


def manifest_named(raw: Path, files: list[tuple[str, str]], given: str | None) -> str | None:
    """The relative path of the manifest --manifest names (as a path, or relative to RAW)."""
    if given is None:
        return None
    root = os.path.realpath(raw)
    for candidate in (given, os.path.join(raw, given)):
        real = os.path.realpath(candidate)
        if os.path.isfile(real) and real.startswith(os.path.join(root, "")):
            rel = os.path.relpath(real, root).replace(os.sep, "/")
            if rel in dict(files):
                return rel
    raise ConfigError(f"--manifest {given}: no such manifest file in {raw}; name one of its JSONL, JSON, CSV, TSV or "
                      "Parquet files (a path, or relative to RAW)")


def _none_found(raw: Path, form: str, files: list[tuple[str, str]], options: FieldOptions) -> str:
    """The error of a RAW that holds none of the form it was taken for, with why its candidates
    are not (a manifest's first records name no image file, say)."""
    what = {"manifest": "manifest of image files"}.get(form, NAMES[form])
    if form == "manifest":
        tables = [(rel, path) for rel, path in files if os.path.splitext(rel)[1].lower() in manifest.EXTS]
        if tables:
            return f"{raw}: holds no {what} ({manifest.why_not(tables[0][1], tables[0][0], options)})"
    return f"{raw}: holds no {what}"


def _is(form: str, rel: str, path: str, options: FieldOptions, probed: dict) -> bool:
    ext = os.path.splitext(rel)[1].lower()
    if form == "tar":
        return tar.is_tar(rel)
    if form == "parquet":
        return ext == ".parquet"
    if ext not in manifest.EXTS:
        return False
    probed[path] = manifest.fields_of(path, rel, options)
    return probed[path] is not None


def _not_mine(form: str, rel: str) -> str:
    if form == "tar" and rel.lower().endswith(tar.COMPRESSED):
        return "a compressed tar: its members cannot be read in place; decompress it to a plain .tar"
    return {"tar": "not a tar shard (the samples are in the .tar files)",
            "parquet": "not a Parquet file (the samples are in the .parquet files)",
            "manifest": "neither a manifest nor an image it names"}[form]


def _read(form: str, mine: list[tuple[str, str]], options: FieldOptions, stats: dict, named: dict, probed: dict,
          inside: manifest.Inside):
    """(fields, the input's fields left out, records and skips, the label values met): the
    first file's fields serve them all (a manifest's, as `probed` found them)."""
    items: list = []
    met: dict = {}
    if form == "tar":
        fields, ignored = tar.fields_of(mine, options)
        for rel, path in mine:
            items.extend(tar.records(path, rel, fields, met, options.image, options.fields))
        return fields, ignored, items, met
    if form == "parquet":
        fields = ignored = None
        for rel, path in mine:
            pfile = parquet.open_file(path)
            if isinstance(pfile, str):
                items.append(Skip(rel, "scan", pfile))
                continue
            if fields is None:
                fields, ignored = parquet.fields_of(pfile, rel, options)
                names, first = parquet.class_names(pfile, fields["label"]), rel
            elif parquet.class_names(pfile, fields["label"]) != names:  # a label would name another class
                raise ConfigError(f"{rel}: its ClassLabel names are not {first}'s: its labels would name other "
                                  "classes; build the two apart")
            items.extend(parquet.records(pfile, path, rel, fields, met, options.fields))
        if fields is None:
            raise SourceError(f"{mine[0][0]}: no readable Parquet file ({items[0].reason})")
        return {**fields, "class_names": names}, ignored, items, met
    fields, ignored = probed[mine[0][1]]
    for rel, path in mine:
        items.extend(manifest.records(path, rel, fields, options, met, stats, named, inside))
    return fields, ignored, items, met


def _unique(records: list[Record], skipped: list[Skip]) -> list[Record]:
    """The records whose key no record before them has (an id given twice is a skip)."""
    seen: set[str] = set()
    out = []
    for r in records:
        if r.key in seen:
            skipped.append(Skip(r.key, "scan", "its key (id) is given by another record before it"))
        else:
            seen.add(r.key)
            out.append(r)
    return out


def _unnamed(files: list[tuple[str, str]], named: dict) -> list[Skip]:
    """The image files under RAW that no record names (by device and inode: one file however
    its path is written): found, so said."""
    out = []
    for rel, path in files:
        if os.path.splitext(rel)[1].lower() in IMAGE_EXTS:
            st = os.stat(path)
            if (st.st_dev, st.st_ino) not in named:
                out.append(Skip(rel, "scan", "an image no manifest record names"))
    return out
