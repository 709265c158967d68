"""COCO detection data (`annotations/instances_<split>.json` beside the image folder, as COCO
and most detection sets ship): a record per image the annotation lists, with its boxes.

The build stores whole images (`--image-size S --keep-aspect`, or `keep`) and each image's
`boxes` float32 [N, 4] as (x1, y1, x2, y2) in the stored image's pixels (the annotation's
(x, y, w, h) scaled by the stored size over the size the annotation gives), `box_labels` int64
[N] (the categories as contiguous ids, in the order of their ids; their names are the
dataset's classes), `iscrowd` int64 [N] and `image_id` int64. An image with no annotation is
kept, with N = 0. The annotation is read once, whole (COCO's train annotation is 450 MB of
JSON; its images, not its boxes, are the bulk).

What the annotation gets wrong is counted or skipped, never a crash: a box partly outside its
image is clipped, one of no area (negative or zero size, or wholly outside) dropped, one of an
unknown image or category dropped, each counted in the build's `detection` summary; an image
listed without a file, or whose file is not the size the annotation says (its boxes would not
fit it), is a skip with its reason.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from packer.builder.records import Record
from packer.dataset import format as fmt
from packer.dataset.format import Skip
from packer.dataset.geometry import keep_aspect_size
from packer.errors import ConfigError, SourceError

ANNOTATIONS = "annotations"
COLUMNS = (fmt.Column("boxes", "<f4", (None, 4)), fmt.Column("box_labels", "<i8", (None,)),
           fmt.Column("iscrowd", "<i8", (None,)), fmt.Column("image_id", "<i8", ()))


def annotation_files(files: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """RAW's COCO instance annotations: `annotations/instances_*.json`."""
    return [(rel, path) for rel, path in files
            if rel.startswith(ANNOTATIONS + "/") and os.path.basename(rel).startswith("instances_")
            and rel.endswith(".json")]


def split_of(rel: str) -> str:
    """`instances_train2017.json` -> `train2017`."""
    return os.path.basename(rel)[len("instances_"):-len(".json")]


def scan(raw: Path, files: list[tuple[str, str]], split: str | None, size: int | None, max_side: int | None,
         counts: dict) -> tuple[list[Record | Skip], tuple[str, ...], str, list[str]]:
    """(records and skips, class names, the annotation file's rel path, the files of RAW it
    uses); `counts` gets what was clipped and dropped."""
    found = annotation_files(files)
    chosen = [(rel, path) for rel, path in found if split is None or split_of(rel).startswith(split)]
    if not chosen:
        raise ConfigError(f"--split {split!r}: {raw} has no annotations/instances_{split}*.json (it has "
                          f"{', '.join(r for r, _ in found)})")
    if len(chosen) > 1:
        raise ConfigError(f"{raw}: holds {', '.join(r for r, _ in chosen)}; pass --split NAME to build one "
                          "(train picks instances_train*.json)")
    rel, path = chosen[0]
    doc = _load(path, rel)
    categories = sorted((c for c in doc.get("categories", []) if isinstance(c, dict) and isinstance(c.get("id"), int)),
                        key=lambda c: c["id"])
    contiguous = {c["id"]: k for k, c in enumerate(categories)}
    names = tuple(str(c.get("name", c["id"])) for c in categories)
    folder = _image_folder(raw, rel, doc)
    boxes = _boxes_by_image(doc, contiguous, counts)
    records = []
    for image in doc.get("images", []):
        records.append(_record(raw, folder, image, boxes, size, max_side, counts))
    return records, names, rel, [rel]


def _load(path: str, rel: str) -> dict:
    try:
        with open(path, "rb") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise SourceError(f"{rel}: not a readable COCO annotation ({str(exc)[:200]})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
        raise SourceError(f"{rel}: not a COCO annotation (no 'images' list)")
    return doc


def _image_folder(raw: Path, rel: str, doc: dict) -> Path:
    """Where its file_names are: RAW/<split>/ (COCO's train2017/), RAW/images/<split>/, RAW/images/
    or RAW/, the first that holds its first image."""
    split = split_of(rel)
    first = next((i.get("file_name") for i in doc["images"] if isinstance(i, dict)), None)
    for folder in (raw / split, raw / "images" / split, raw / "images", raw):
        if isinstance(first, str) and (folder / first).is_file():
            return folder
    return raw / split


def _boxes_by_image(doc: dict, contiguous: dict, counts: dict) -> dict[int, list]:
    """Each image's (bbox, category, iscrowd) rows; annotations of unknown images or categories
    and malformed ones dropped, and counted."""
    ids = {i.get("id") for i in doc["images"] if isinstance(i, dict)}
    out: dict[int, list] = {}
    for a in doc.get("annotations", []):
        bbox = a.get("bbox") if isinstance(a, dict) else None
        if not (isinstance(bbox, list) and len(bbox) == 4 and all(isinstance(v, (int, float)) for v in bbox)):
            counts["dropped_malformed"] = counts.get("dropped_malformed", 0) + 1
        elif a.get("image_id") not in ids:
            counts["dropped_unknown_image"] = counts.get("dropped_unknown_image", 0) + 1
        elif a.get("category_id") not in contiguous:
            counts["dropped_unknown_category"] = counts.get("dropped_unknown_category", 0) + 1
        else:
            out.setdefault(a["image_id"], []).append((bbox, contiguous[a["category_id"]], int(bool(a.get("iscrowd")))))
    return out


def _record(raw: Path, folder: Path, image, boxes: dict, size: int | None, max_side: int | None,
            counts: dict) -> Record | Skip:
    if not isinstance(image, dict) or not isinstance(image.get("file_name"), str) or not isinstance(
            image.get("id"), int):
        return Skip(f"{ANNOTATIONS}:image {str(image)[:60]}", "scan", "an image entry without a file_name and an id")
    name, w, h = image["file_name"], image.get("width"), image.get("height")
    key = os.path.relpath(folder / name, raw).replace(os.sep, "/")
    if not (isinstance(w, int) and isinstance(h, int) and w > 0 and h > 0):
        return Skip(key, "scan", "its annotation gives no width and height")
    path = folder / name
    if not path.is_file():
        return Skip(key, "scan", f"listed in the annotation, no such file ({name})")
    new_w, new_h = keep_aspect_size(w, h, size, max_side) if size is not None else (w, h)
    rows = boxes.get(image["id"], [])
    xywh = np.asarray([b for b, _, _ in rows], np.float64).reshape(-1, 4)
    xyxy = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], axis=1)
    clipped = np.clip(xyxy, 0, [w, h, w, h])
    counts["clipped"] = counts.get("clipped", 0) + int((clipped != xyxy).any(axis=1).sum())
    kept = (clipped[:, 2] > clipped[:, 0]) & (clipped[:, 3] > clipped[:, 1])  # of some area, in the image
    counts["dropped_no_area"] = counts.get("dropped_no_area", 0) + int((~kept).sum())
    scaled = (clipped[kept] * [new_w / w, new_h / h, new_w / w, new_h / h]).astype(np.float32)
    extra = (("boxes", scaled.reshape(-1, 4)),
             ("box_labels", np.asarray([c for (_, c, _), k in zip(rows, kept) if k], np.int64)),
             ("iscrowd", np.asarray([z for (_, _, z), k in zip(rows, kept) if k], np.int64)),
             ("image_id", np.int64(image["id"])))
    return Record(key, str(path), extra=extra, size=(w, h))
