"""A COCO detection set from the sample photos, offline: `train2017/` of real photo crops, each
with one to three solid rectangles drawn on it (the objects: a colour a category), and
`annotations/instances_train2017.json` in COCO's own layout (images, annotations with bbox =
x, y, w, h in pixels, categories with sparse ids), as pycocotools reads it."""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench import data

CATEGORIES = [(3, "red box", (220, 30, 30)), (7, "green box", (30, 200, 40)), (18, "blue box", (30, 40, 220))]


def make_coco(raw: Path, count: int, *, seed: int = 0, split: str = "train2017") -> Path:
    """RAW/{split}/N.jpg (PNG for every third, so that the colours stay exact) and
    RAW/annotations/instances_{split}.json."""
    from PIL import ImageDraw

    rng = random.Random(seed)
    images, annotations = [], []
    (raw / split).mkdir(parents=True, exist_ok=True)
    for i, (_, img, _) in enumerate(data.crops(count, seed=seed, min_side=60, max_side=240)):
        img = img.convert("RGB")
        draw = ImageDraw.Draw(img)
        for _ in range(rng.randint(0 if i % 5 == 4 else 1, 3)):  # some images have no object
            cat, _, colour = rng.choice(CATEGORIES)
            w, h = rng.randint(8, img.width // 2), rng.randint(8, img.height // 2)
            x, y = rng.randint(0, img.width - w), rng.randint(0, img.height - h)
            draw.rectangle([x, y, x + w - 1, y + h - 1], fill=colour)
            annotations.append({"id": len(annotations) + 1, "image_id": 1000 + i, "category_id": cat,
                                "bbox": [x, y, w, h], "area": w * h, "iscrowd": 0, "segmentation": []})
        name = f"{i:012d}.{'png' if i % 3 == 0 else 'jpg'}"
        img.save(raw / split / name, **({} if name.endswith("png") else {"quality": 95}))
        images.append({"id": 1000 + i, "file_name": name, "width": img.width, "height": img.height})
    doc = {"info": {"description": "mmpack test set"}, "licenses": [], "images": images, "annotations": annotations,
           "categories": [{"id": c, "name": n, "supercategory": "shape"} for c, n, _ in CATEGORIES]}
    (raw / "annotations").mkdir(parents=True, exist_ok=True)
    (raw / "annotations" / f"instances_{split}.json").write_text(json.dumps(doc))
    return raw
