"""COCO detection data built from the user's side: annotations in COCO's own layout over real
photo crops with objects drawn on them; every box of a built sample is its annotation scaled by
the stored image's factor, on the object's pixels; hostile annotations are clipped or dropped
and counted, or skips, never a crash."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from .coco import CATEGORIES, make_coco
from loaders import MMapDataset
from packer.cli import main

from ..trees import one_line_error

ARGS = ["--image-size", "48", "--keep-aspect", "-q"]


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    raw = make_coco(tmp_path_factory.mktemp("coco") / "raw", 20, seed=3)
    out = tmp_path_factory.mktemp("coco-out") / "out"
    assert main(["build", str(raw), str(out), *ARGS]) == 0
    return raw, out


def test_every_box_is_its_annotation_scaled_onto_its_object(coco):
    raw, out = coco
    doc = json.loads((raw / "annotations" / "instances_train2017.json").read_text())
    ds = MMapDataset(out)
    assert ds.classes == [n for _, n, _ in CATEGORIES] and len(ds) == len(doc["images"])
    contiguous = {c: k for k, (c, _, _) in enumerate(CATEGORIES)}
    by_id = {i["id"]: i for i in doc["images"]}
    empty = 0
    for k in range(len(ds)):
        s = ds[k]
        image = by_id[int(s["image_id"])]
        rows = [a for a in doc["annotations"] if a["image_id"] == image["id"]]
        h, w = s["image"].shape[:2]
        fx, fy = w / image["width"], h / image["height"]
        want = np.array([[x * fx, y * fy, (x + bw) * fx, (y + bh) * fy] for x, y, bw, bh in (a["bbox"] for a in rows)],
                        np.float64).reshape(-1, 4)
        assert np.abs(s["boxes"].numpy() - want).max(initial=0) < 1e-4
        assert s["box_labels"].tolist() == [contiguous[a["category_id"]] for a in rows]
        assert s["iscrowd"].tolist() == [0] * len(rows) and s["key"] == f"train2017/{image['file_name']}"
        empty += not rows
        if rows:  # the last object drawn lies on top: its box's middle is its colour
            x1, y1, x2, y2 = s["boxes"][-1].tolist()
            middle = s["image"][int((y1 + y2) / 2), int((x1 + x2) / 2)].numpy().astype(int)
            colour = next(c for cid, _, c in CATEGORIES if cid == rows[-1]["category_id"])
            assert np.abs(middle - colour).max() < 40, (middle, colour)
    assert empty  # images with no annotation are kept, with no box


def test_hostile_annotations_are_clipped_dropped_or_skipped_and_counted(coco, tmp_path, capsys):
    raw = tmp_path / "raw"
    shutil.copytree(coco[0], raw)
    path = raw / "annotations" / "instances_train2017.json"
    doc = json.loads(path.read_text())
    first = doc["images"][0]
    second = next(i for i in doc["images"] if not any(a["image_id"] == i["id"] for a in doc["annotations"]))
    doc["annotations"] += [
        {"id": 900, "image_id": first["id"], "category_id": 3, "bbox": [-10, -10, 30, 30]},  # partly out: clipped
        {"id": 901, "image_id": first["id"], "category_id": 3, "bbox": [5, 5, -4, 10]},  # negative size: dropped
        {"id": 902, "image_id": 1, "category_id": 3, "bbox": [1, 1, 2, 2]},  # an image not listed
        {"id": 903, "image_id": first["id"], "category_id": 99, "bbox": [1, 1, 2, 2]},  # a category not listed
        {"id": 904, "image_id": first["id"], "category_id": 3, "bbox": "1,1,2,2"},  # not a bbox
        {"id": 905, "image_id": first["id"], "category_id": 3, "bbox": [10_000, 10_000, 5, 5]}]  # wholly outside
    doc["images"] += [{"id": 77, "file_name": "missing.jpg", "width": 10, "height": 10}, {"no": "id"}]
    second["width"], second["height"] = second["height"] + 1, second["width"]  # not the file's size
    path.write_text(json.dumps(doc))
    (raw / "train2017" / "unlisted.png").write_bytes((raw / "train2017" / first["file_name"]).read_bytes())
    assert main(["build", str(raw), str(tmp_path / "out"), *ARGS]) == 0
    m = MMapDataset(tmp_path / "out").manifest
    reasons = {s.key: s.reason for s in m.skipped}
    assert "no such file" in reasons["train2017/missing.jpg"] and "without a file_name" in " ".join(reasons.values())
    assert "its annotation says" in reasons[f"train2017/{second['file_name']}"]
    assert reasons["train2017/unlisted.png"] == "an image the annotation does not list"
    assert m.build["input"]["notes"] == {"clipped": 2, "dropped_malformed": 1, "dropped_no_area": 2,
                                         "dropped_unknown_category": 1, "dropped_unknown_image": 1}
    assert m.counts["found"] == m.counts["packed"] + m.counts["skipped"]
    capsys.readouterr()
    assert main(["info", str(tmp_path / "out")]) == 0 and "2 clipped to their image" in capsys.readouterr().out


def test_a_centre_crop_of_detection_data_is_refused(coco, tmp_path, capsys):
    err = one_line_error(capsys, ["build", str(coco[0]), str(tmp_path / "out"), "--image-size", "48"])
    assert "--keep-aspect" in err and "cut boxes" in err
