"""Dataset dirs compared as trees of bytes, samples compared by key, and the build command
the builder tests run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from loaders import MMapDataset
from packer.cli import main
from packer.dataset import format as fmt


def _in_shard(path: str) -> str:
    """A file's path from its shard dir on (`shard-k/name`), whatever generation holds it."""
    return "/".join(path.split("/")[-2:])


def tree(out: Path) -> dict[str, str]:
    """Every shard file of a dataset dir -> sha256, and the manifest without its build timings
    and generation name (what two builds of the same bytes share)."""
    doc = json.loads((out / fmt.MANIFEST_NAME).read_text())
    paths = [f["path"] for s in doc["shards"] for f in s["files"]]
    assert paths and all((out / p).is_file() for p in paths)
    files = {_in_shard(p): hashlib.sha256((out / p).read_bytes()).hexdigest() for p in paths}
    doc.pop("build")
    doc.pop("generation")
    inputs = doc.pop("inputs")  # RAW's file table: its bytes, not where it lies (an archive has none)
    if inputs:
        files[fmt.INPUTS_NAME] = hashlib.sha256((out / inputs["path"]).read_bytes()).hexdigest()
    for shard in doc["shards"]:
        for f in shard["files"]:
            f["path"] = _in_shard(f["path"])
    return {"files": files, "manifest": doc}


def by_key(out: Path) -> dict[str, tuple]:
    """Samples keyed by their record key, labels as class names: comparable across datasets."""
    ds = MMapDataset(out)
    classes = ds.classes
    rows = {}
    for i in range(len(ds)):
        s = ds[i]
        label = classes[int(s["label"])] if "label" in s else None
        rows[s["key"]] = (label, *(s[c].numpy().tobytes() for c in ("image", "tokens") if c in s))
    assert len(rows) == len(ds)
    return rows


def build(raw, out, *extra) -> None:
    assert main(["build", str(raw), str(out), "-q", *map(str, extra)]) == 0


IMG = ("--image-size", "32", "--shard-size", "8")


def one_line_error(capsys, argv) -> str:
    """`packer ARGV`'s error: exit 2, one line on stderr, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err
