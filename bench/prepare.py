"""The data the benches read, made once in a work dir and reused from it (--work): a raw input and
its mmpack build with the build's time (`prepare_dataset`), and the shared ones: the photo crops,
whole and cut in thirds, and the text."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from . import data


def prepare_dataset(work: Path, name: str, size, make_raw, options: dict) -> tuple[Path, Path, float]:
    """RAW made by `make_raw(raw)` and its mmpack build (`packer.build`'s `options`) with its
    time, reused from `work` when they were made there for this `size` and options and the
    dataset still opens (a work dir from an older mmpack, or for another --images, is made again)."""
    import packer
    from packer.errors import MmpackError
    from packer.dataset.reader import load_manifest

    raw, out = work / f"raw-{name}", work / f"out-{name}"
    stamp, made_for = work / f"build-{name}.json", {"size": size, "options": {k: str(v) for k, v in options.items()}}
    try:
        done = json.loads(stamp.read_text())
        load_manifest(out)
        if done["for"] == made_for:
            return raw, out, float(done["seconds"])
    except (OSError, ValueError, KeyError, TypeError, MmpackError):
        pass
    shutil.rmtree(raw, ignore_errors=True)
    make_raw(raw)
    start = time.perf_counter()
    m = packer.build(raw, out, overwrite=True, **options)
    seconds = time.perf_counter() - start
    print(f"found {m.counts['found']} = packed {m.counts['packed']} + skipped {m.counts['skipped']}; "
          f"{len(m.shards)} shards, {m.size_bytes / 2**20:,.1f} MiB in {seconds:.1f} s -> {out}", file=sys.stderr)
    stamp.write_text(json.dumps({"for": made_for, "seconds": seconds}))
    return raw, out, seconds


def prepare_images(work: Path, count: int) -> tuple[Path, Path, float]:
    """Raw photo crops and their mmpack build (reused from `work` when present)."""
    return prepare_dataset(work, "images", count, lambda raw: data.make_image_folders(raw, count, seed=0), {})


def prepare_image_thirds(work: Path, count: int) -> list[Path]:
    """The crops of `prepare_images` cut in three datasets, every class folder in each (so their
    labels mean the same classes): a mixture's sources of the same total."""
    raw, _, _ = prepare_images(work, count)

    def third(k: int):
        def make(out: Path) -> None:
            for folder in sorted(p for p in raw.iterdir() if p.is_dir()):
                (out / folder.name).mkdir(parents=True, exist_ok=True)
                for i, f in enumerate(sorted(folder.iterdir())):
                    if i % 3 == k:
                        shutil.copy(f, out / folder.name / f.name)
        return make

    return [prepare_dataset(work, f"images-third{k}", count, third(k), {})[1] for k in range(3)]


def prepare_text(work: Path, mb: float) -> tuple[Path, Path, float]:
    """`mb` MB of real text and its build with the MiniLM tokenizer (reused from `work` when present)."""
    return prepare_dataset(work, "text", mb, lambda raw: data.make_text(raw, int(mb * 1024**2)),
                           {"tokenizer": data.minilm_tokenizer(), "append_eos": "auto"})
