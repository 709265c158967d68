"""`packer merge A B ... OUT`: one dataset from several with the same schema, without re-encoding.

The same input given twice is refused, and so are keys found in more than one input (two builds
of overlapping folders), unless `allow_duplicate_keys`: the merged dataset would hold those
samples twice. Shards are hard-linked (copied across file systems) into a new generation of OUT in input order
and renumbered; the manifest lists them all, and is published as a build's is (`packer.dataset.outdir`). Tokenizers must match by sha256. Classes are reconciled by name:
the first input's list, then each new name in order of appearance; a label file is rewritten
only when its input's class indexes differ from the merged ones (labels are 8 bytes a sample).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import xxhash

from packer.dataset import format as fmt
from packer.dataset import outdir, writer
from packer.errors import ConfigError
from packer.system import link_or_copy
from packer.dataset.reader import DatasetReader, map_npy


DUPLICATES_SHOWN = 3


def merge(inputs: list[str | Path], out: str | Path, *, overwrite: bool = False,
          allow_duplicate_keys: bool = False) -> fmt.Manifest:
    inputs, out = [Path(p) for p in inputs], Path(out)
    if len(inputs) < 2:
        raise ConfigError("merge: give at least two dataset dirs to merge")
    seen: dict[Path, Path] = {}
    for path in inputs:
        same = seen.setdefault(path.resolve(), path)
        if same is not path:
            raise ConfigError(f"{path} is given twice (as {same} too); each of its samples would be "
                              "in the merged dataset twice")
    readers = [DatasetReader(p) for p in inputs]  # open (their generations held) until the merge is done
    manifests = [r.manifest for r in readers]
    first = manifests[0]
    for path, m in zip(inputs[1:], manifests[1:]):
        if m.kind != first.kind:
            raise ConfigError(f"{path}: a {m.kind} dataset cannot merge with {inputs[0]} ({first.kind})")
        if m.columns != first.columns:
            raise ConfigError(f"{path}: columns differ from {inputs[0]}'s ({fmt.columns_text(m.columns)} vs {fmt.columns_text(first.columns)})")
        if m.audio != first.audio:
            raise ConfigError(f"{path}: its audio ({m.audio}) is not {inputs[0]}'s ({first.audio}); build them at one "
                              "rate, channels and dtype")
        sha = (m.tokenizer or {}).get("sha256"), (first.tokenizer or {}).get("sha256")
        if sha[0] != sha[1]:
            raise ConfigError(f"{path}: built with another tokenizer than {inputs[0]} (sha256 "
                              f"{str(sha[0])[:12]} vs {str(sha[1])[:12]})")
    if not allow_duplicate_keys:
        check_unique_keys(inputs, readers)
    classes = None
    if first.classes is not None:
        classes = list(first.classes)
        for m in manifests[1:]:
            classes += [c for c in m.classes or () if c not in classes]
    with outdir.locked(out):
        outdir.check_out(out, append=False, overwrite=overwrite)
        shutil.rmtree(outdir.staging_dir(out), ignore_errors=True)
        generation = outdir.new_generation()
        outdir.prepare_generation(out, generation)
        shards: list[fmt.Shard] = []
        for path, m in zip(inputs, manifests):
            relabel = None
            if classes is not None:
                mapping = np.asarray([classes.index(c) for c in m.classes], dtype=np.int64)
                relabel = None if np.array_equal(mapping, np.arange(len(mapping))) else mapping
            for shard in m.shards:
                shards.append(_place(path, shard, len(shards), out, generation, relabel))
        counts = {k: sum(m.counts[k] for m in manifests) for k in ("found", "packed", "skipped")}
        manifest = fmt.Manifest(
            kind=first.kind, columns=first.columns, shards=tuple(shards), counts=counts,
            skipped=tuple(s for m in manifests for s in m.skipped),
            classes=tuple(classes) if classes is not None else None, tokenizer=first.tokenizer, audio=first.audio,
            build={"merged_from": [fmt.printable(str(p.resolve())) for p in inputs], "created_unix": round(time.time(), 3)},
            generation=generation,
        )
        outdir.publish(out, manifest)
    return manifest


def _place(src_root: Path, shard: fmt.Shard, index: int, out: Path, generation: str, relabel) -> fmt.Shard:
    rel = fmt.shard_path(generation, index)
    (out / rel).mkdir(parents=True)
    files = []
    for entry in shard.files:
        src = src_root / entry.path
        base = entry.path.rsplit("/", 1)[-1]
        dst = out / rel / base
        if relabel is not None and base == "label.npy":
            labels = map_npy(src, "<i8", (shard.num_samples,))
            writer.write_npy(dst, relabel[np.asarray(labels)])
            files.append(fmt.FileEntry(f"{rel}/{base}", dst.stat().st_size, writer.checksum_file(dst)))
            continue
        link_or_copy(src, dst)
        files.append(fmt.FileEntry(f"{rel}/{base}", entry.size_bytes, entry.checksum, entry.algo))
    return fmt.Shard(index, shard.num_samples, tuple(files))


def _key_hashes(reader: DatasetReader) -> np.ndarray:
    """A 64-bit hash of every sample's key, in sample order: 8 bytes a sample, not a set of strings."""
    return np.fromiter(map(xxhash.xxh3_64_intdigest, reader.key_bytes()), np.uint64, len(reader))


def check_unique_keys(inputs: list[Path], readers: list[DatasetReader]) -> None:
    """ConfigError naming how many keys more than one input holds, and the first few, with the
    inputs that hold them. Keys are compared by a 64-bit hash first, then as strings."""
    hashes = [_key_hashes(r) for r in readers]
    owner = np.repeat(np.arange(len(readers)), [len(h) for h in hashes])
    flat = np.concatenate(hashes)
    order = np.argsort(flat, kind="stable")
    same = flat[order][1:] == flat[order][:-1]
    candidates = np.unique(np.concatenate([order[1:][same], order[:-1][same]]))
    holders: dict[str, set[int]] = {}
    starts = np.cumsum([0, *map(len, hashes)])
    for i in candidates.tolist():
        k = int(owner[i])
        key = readers[k].sample(i - int(starts[k]), "key").tobytes().decode("utf-8", "backslashreplace")
        holders.setdefault(key, set()).add(k)
    shared = {key: sorted(ks) for key, ks in holders.items() if len(ks) > 1}
    if shared:
        shown = "; ".join(f"{key} (in {', '.join(str(inputs[k]) for k in ks)})"
                          for key, ks in list(shared.items())[:DUPLICATES_SHOWN])
        raise ConfigError(f"{len(shared):,} keys are in more than one input ({shown}"
                          f"{'; ...' if len(shared) > DUPLICATES_SHOWN else ''}): the merged dataset would hold "
                          "those samples twice. Merge datasets of disjoint inputs, or pass --allow-duplicate-keys "
                          "to keep every copy")
