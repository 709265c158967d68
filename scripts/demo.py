"""The main job on built-in sample data: build, open, load, compare.

Builds an image dataset from crops of real photos (scikit-image / scikit-learn sample images) and
a text dataset from Python's own library sources with a real pretrained tokenizer (MiniLM's
tokenizer.json), through the real `packer` CLI; opens both; then times reading shuffled samples
from the packed images against decoding the same JPEG/PNG files with Pillow, in one run.

    python scripts/demo.py [--images 2000] [--text-mb 8] [--work DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import data
from loaders import MMapDataset
from packer.cli import main as packer
from packer.images import decode_image


def timed_rate(fn, items) -> float:
    start = time.perf_counter()
    for item in items:
        fn(item)
    return len(items) / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--text-mb", type=float, default=8)
    ap.add_argument("--work", type=Path, default=None, help="keep RAW and OUT here (default: a temp dir)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="mmpack-demo-"))
    raw_img, raw_txt = work / "raw-images", work / "raw-text"
    out_img, out_txt = work / "out-images", work / "out-text"
    for p in (raw_img, raw_txt, out_img, out_txt):
        shutil.rmtree(p, ignore_errors=True)

    print(f"== sample data: {args.images} crops of real photos, {args.text_mb} MB of Python sources")
    data.make_image_folders(raw_img, args.images)
    data.make_text(raw_txt, int(args.text_mb * 1024**2))
    tokenizer = data.minilm_tokenizer()

    print("== packer build (images, 224x224)")
    if packer(["build", str(raw_img), str(out_img), "-q"]):
        return 1
    print("== packer build (text, MiniLM tokenizer, EOS appended)")
    if packer(["build", str(raw_txt), str(out_txt), "--tokenizer", str(tokenizer), "--append-eos", "-q"]):
        return 1
    for out in (out_img, out_txt):
        print(f"== packer info {out.name}")
        packer(["info", str(out)])

    images = MMapDataset(out_img)
    text = MMapDataset(out_txt)
    tokens = sum(int(text.reader.column(k, "tokens").offsets[-1]) for k in range(len(text.manifest.shards)))
    print(f"== opened: {len(images)} images {tuple(images[0]['image'].shape)}, "
          f"{len(text)} documents / {tokens:,} tokens ({text.columns['tokens'].dtype})")

    order = np.random.default_rng(0).permutation(len(images))[:min(len(images), 1000)].tolist()
    for i in order:  # warm the page cache, as training epochs after the first do
        images[i]
    packed = timed_rate(lambda i: images[i]["image"].clone(), order)
    files = [out_img.parent / "raw-images" / images[i]["key"] for i in order]
    decoded = timed_rate(lambda p: decode_image(p, 224), files[:300])
    print(f"== loading speed, one process, shuffled, warm cache: packed {packed:,.0f} images/s vs "
          f"Pillow decode+resize {decoded:,.0f} images/s: {packed / decoded:.0f}x")
    print(f"   (full comparison: bench loaders --quick)  work dir: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
