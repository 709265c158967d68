"""The fuzz loop of tests/test_fuzz.py, run in a process of its own with its address space capped:
`python -m tests.fuzz_driver SEED COUNT|FIRST:END WORK DATASET...` prints one JSON line per failure.
Case n draws from its own generator, seeded by (SEED, n): a range of cases is the same in any
process, so several processes can share one run.

Each round copies one of the datasets, damages it (a manifest field changed to another type or
value, a field removed, bytes of the manifest or of a column file flipped, a file cut or grown,
or, in a dataset of whole images, samples rewritten with hostile but self-consistent shapes: a
side of 2**31 - 1 and the other 0, the largest sides of different samples whose product passes
2**63, the manifest's sizes and checksums made to match so that verify passes), then does what
users do: open it, read every sample, run a Loader epoch (and the token views of a
text dataset), `packer verify`. Every step must succeed or raise the project's own error
(MmpackError); and reads that succeed on damaged column bytes must be caught by verify.
"""

from __future__ import annotations

import json
import random
import resource
import shutil
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

from loaders import AudioClips, Loader, MMapDataset, PackedDocuments, TokenWindows
from packer.dataset import format as fmt
from packer.errors import MmpackError
from packer.dataset.reader import load_manifest, map_column
from packer.dataset.verify import verify
from packer.dataset.writer import checksum_file, write_npy

BIG = (1 << 31) - 1
HOSTILE_SHAPES = [(BIG, 0, 3), (0, BIG, 3), (0, 0, 3), (1 << 30, 0, 3)]

ODD_VALUES = [None, -1, 0, 10**18, -(10**18), 1.5, "x", "", "../../etc/passwd", [], {}, True, [1, 2], {"a": 1},
              "\udcff", "g-" + "0" * 16, "<u2", "|O", 2**63]


def _paths(doc, prefix=()):
    """Every (container, key) pair of a JSON document."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield doc, key
        yield from _paths(value, (*prefix, key))


def hostile_shapes(root: Path, rng: random.Random) -> str:
    """Samples of the ragged image column rewritten as empty ones of hostile shapes (every
    sample, or some), values, offsets and manifest kept consistent: a valid dataset."""
    manifest_path = root / fmt.MANIFEST_NAME
    doc = json.loads(manifest_path.read_text())
    m = load_manifest(root)
    column = m.column("image")
    every = rng.random() < 0.5
    shape = rng.choice(HOSTILE_SHAPES)
    entries = {f["path"]: f for s in doc["shards"] for f in s["files"]}
    for shard in m.shards:
        arrays = map_column(root / shard.dir, column, shard.num_samples)
        hit = [every or rng.random() < 0.3 for _ in range(shard.num_samples)]
        shapes = np.array([shape if h else arrays.shapes[i] for i, h in enumerate(hit)], np.int64)
        sizes = np.prod(np.minimum(shapes, 1 << 20), axis=1) * (shapes.min(axis=1) > 0)
        values = np.concatenate([np.zeros(0, np.uint8)] + [arrays.sample(i).reshape(-1) for i in range(shard.num_samples)
                                                            if not hit[i]])
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        del arrays
        names = fmt.column_file_names(column)
        for part, array in (("values", values), ("offsets", offsets), ("shapes", shapes)):
            path = root / shard.dir / names[part]
            path.unlink()  # a new file: the reference dataset's is hard-linked nowhere, but be sure
            write_npy(path, array)
            entry = entries[f"{shard.dir}/{names[part]}"]
            entry["size_bytes"] = path.stat().st_size
            entry["checksum"]["hex"] = checksum_file(path, entry["checksum"]["algo"])
    manifest_path.write_text(json.dumps(doc))
    return f"shapes {shape} in {'every' if every else 'some'} sample(s)"


def damage(root: Path, rng: random.Random) -> str:
    """Damage the dataset dir in place; returns what was done."""
    manifest = root / fmt.MANIFEST_NAME
    if "aspect" in root.name and rng.random() < 0.5:
        return hostile_shapes(root, rng)
    kind = rng.choice(["field", "field", "field", "drop", "manifest-bytes", "file-bytes", "file-bytes", "file-size"])
    if kind in ("field", "drop"):
        doc = json.loads(manifest.read_text())
        container, key = rng.choice(list(_paths(doc)))
        if kind == "drop" and isinstance(container, dict):
            del container[key]
        else:
            container[key] = rng.choice(ODD_VALUES)
        manifest.write_text(json.dumps(doc))
        return f"{kind} {key!r} of a {type(container).__name__}"
    if kind == "manifest-bytes":
        raw = bytearray(manifest.read_bytes())
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        manifest.write_bytes(bytes(raw))
        return "manifest bytes"
    files = sorted(p for p in root.rglob("*.npy"))
    victim = rng.choice(files)
    raw = bytearray(victim.read_bytes())
    if kind == "file-bytes":
        header = rng.random() < 0.5
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(min(len(raw), fmt.NPY_HEADER_BYTES) if header else len(raw))
            raw[at] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(raw))
        return f"bytes of {victim.name} ({'header' if header else 'anywhere'})"
    cut = rng.choice([0, 10, fmt.NPY_HEADER_BYTES, len(raw) // 2, len(raw) - 1, len(raw) + 8])
    victim.write_bytes(bytes(raw[:cut]) + b"\0" * max(0, cut - len(raw)))
    return f"size of {victim.name} to {cut}"


def use(root: Path, text: bool) -> dict:
    """Everything a user does with a dataset; the values read, for comparison."""
    ds = MMapDataset(root)
    values = {}
    for i in range(len(ds)):
        sample = ds[i]
        values[i] = {k: (v if isinstance(v, str) else v.numpy().tobytes()) for k, v in sample.items()}
    for batch in Loader(ds, 5, seed=1, num_threads=2):  # ragged images too: the canvas gather
        pass
    if root.name.endswith("audio"):  # whole clips above; crops too
        for batch in Loader(AudioClips(root, 0.25), 4, num_threads=1):
            pass
    if text:
        for batch in Loader(TokenWindows(root, 32), 4, num_threads=1):
            pass
        for batch in Loader(PackedDocuments(root, 64), 4, num_threads=1):
            pass
    return values


def main() -> None:
    seed, work = int(sys.argv[1]), Path(sys.argv[3])
    first, _, end = sys.argv[2].rpartition(":")
    cases = range(int(first or 0), int(end))
    datasets = [Path(p) for p in sys.argv[4:]]
    reference = {p: use(p, "text" in p.name) for p in datasets}
    # allocations past this process's size plus 1.5 GB fail: a damaged size may not ask for more
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 29), resource.RLIM_INFINITY))
    outcomes = {"ok": 0, "refused": 0}
    for n in cases:
        rng = random.Random(f"{seed}:{n}")
        source = rng.choice(datasets)
        root = work / f"case-{n}-{source.name}"
        shutil.copytree(source, root)
        what = damage(root, rng)
        step = "use"
        try:
            values = use(root, "text" in source.name)
            step = "verify"
            verified = True
            try:
                verify(root)
            except MmpackError:
                verified = False
            legit = what.startswith(("field", "drop", "shapes"))  # a valid dataset of other values
            if verified and values != reference[source] and not legit:
                print(json.dumps({"case": n, "damage": what, "failure": "read wrong values and verify passed"}))
            outcomes["ok"] += 1
        except MmpackError:
            outcomes["refused"] += 1
        except BaseException as exc:  # noqa: BLE001 - what the test is looking for
            where = traceback.extract_tb(exc.__traceback__)[-1]
            print(json.dumps({"case": n, "damage": what, "step": step,
                              "failure": f"{type(exc).__name__}: {str(exc)[:200]}",
                              "at": f"{Path(where.filename).name}:{where.lineno}"}))
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"done": outcomes}))


if __name__ == "__main__":
    np.seterr(all="ignore")
    torch.set_num_threads(1)
    main()
