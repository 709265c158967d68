"""The main job on built-in sample data: build, open, load, and compare with decoding on the fly.

Builds an image dataset from crops of real photos (scikit-image / scikit-learn sample images)
and a text dataset from Python's own library sources with a real pretrained tokenizer (MiniLM's
tokenizer.json), through `packer.build` (what the `packer` command runs); opens both; then times the product path,
`Loader` (whole shuffled batches, warm page cache), against what training does without mmpack,
decoding and resizing the same files with Pillow, each in this one process, in the same run.
Everything it writes goes into a temporary dir that it removes at the end (unless --work).

    python scripts/demo.py [--images 2000] [--text-mb 8] [--work DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import data
from loaders import Loader, MMapDataset, TokenWindows
import packer
from packer.builder.images import decode_image


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--text-mb", type=float, default=8)
    ap.add_argument("--work", type=Path, default=None, help="keep RAW and the datasets here (default: removed)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="mmpack-demo-"))
    try:
        return run(work, args)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
        print(f"   work dir {'kept: ' + str(work) if args.work else 'removed'}; the sample packages stay cached "
              f"in {data.cache_dir()}")


def run(work: Path, args) -> int:
    raw_img, raw_txt, out_img, out_txt = work / "raw-images", work / "raw-text", work / "images", work / "text"
    for p in (raw_img, raw_txt, out_img, out_txt):
        shutil.rmtree(p, ignore_errors=True)
    print(f"== sample data: {args.images} crops of real photos, {args.text_mb} MB of Python sources")
    data.make_image_folders(raw_img, args.images)
    data.make_text(raw_txt, int(args.text_mb * 1024**2))
    print("== packer build (images, 224x224)")
    packer.build(raw_img, out_img)
    print("== packer build (text, MiniLM tokenizer, EOS appended)")
    packer.build(raw_txt, out_txt, tokenizer=data.minilm_tokenizer(), append_eos="auto")
    for out in (out_img, out_txt):
        d = packer.info(out)
        c = d["counts"]
        print(f"== packer info {out.name}: {d['kind']}, {d['num_samples']:,} samples in {d['num_shards']} shards "
              f"(found {c['found']:,} = packed {c['packed']:,} + skipped {c['skipped']:,}); columns "
              + ", ".join(f"{n} {col['dtype']} {tuple(col['shape'])}" for n, col in d["columns"].items()))

    images = MMapDataset(out_img, columns=["image", "label"])
    loader = Loader(images, 256, seed=0)
    for _ in loader:  # a first epoch warms the page cache, as every later training epoch finds it
        pass
    start, count = time.perf_counter(), 0
    for _ in range(3):
        for batch in loader:
            count += len(batch["label"])
    loaded = count / (time.perf_counter() - start)
    files = sorted(p for p in raw_img.rglob("*") if p.is_file())[:300]
    start = time.perf_counter()
    for path in files:
        decode_image(path, 224)
    decoded = len(files) / (time.perf_counter() - start)
    print(f"== loading 224x224 images, shuffled, in this one process: Loader {loaded:,.0f} images/s "
          f"({loader.num_threads} threads), Pillow decode + resize {decoded:,.0f} images/s: {loaded / decoded:,.0f}x")

    windows = TokenWindows(out_txt, 1024)
    x, y = next(iter(Loader(windows, 8)))
    print(f"== text: {windows.num_tokens:,} tokens, {len(windows):,} windows of 1024; a batch: x {tuple(x.shape)} "
          f"{x.dtype}, y = x shifted by one")
    print("   every figure against peers and the machine's memcpy: bench loaders --quick")
    return 0


if __name__ == "__main__":
    sys.exit(main())
