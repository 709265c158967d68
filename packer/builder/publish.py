"""`packer commit` and the end of every local build: the staged shards, each whole, assembled
into the manifest, which is published last (`packer.dataset.outdir.publish`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections import Counter
from pathlib import Path

from packer.builder import inputs
from packer.builder.shard import read_sidecar
from packer.builder.staging import published, read_record
from packer.dataset import format as fmt
from packer.dataset import outdir
from packer.dataset.reader import check_file_sizes, load_manifest
from packer.dataset.writer import checksum_file
from packer.errors import ConfigError, IntegrityError, SourceError

log = logging.getLogger(__name__)


def commit(out: str | Path, *, max_skipped: float | None = None) -> fmt.Manifest:
    """Publish the build staged in OUT (by `--part` runs) once every planned shard is whole."""
    out = Path(out)
    with outdir.locked(out):
        return commit_staged(out, max_skipped=max_skipped)


def commit_staged(out: Path, *, seconds: float | None = None, workers: int | str | None = None,
            cores: int | None = None, max_skipped: float | None = None, disk_wait: float | None = None) -> fmt.Manifest:
    doc = read_record(out)
    if doc is None:
        raise ConfigError(f"{out}: nothing to commit (no build staged in {out / fmt.STAGING_DIR})")
    done = published(out, doc)
    if done is not None:  # a commit killed after its publish, while it removed the staging: finish that
        outdir.publish(out, done)
        return done
    staging = outdir.staging_dir(out)
    results, missing = [], []
    for index in doc["shards"]:
        result = read_sidecar(staging, index, doc["fingerprint"], doc["generation"])
        (missing.append(index) if result is None else results.append(result))
    if missing:
        raise ConfigError(f"{out}: {len(missing)} of {len(doc['shards'])} shards are not built yet "
                          f"(first: {fmt.shard_dir_name(missing[0])}); run the missing parts, then commit")
    new_shards = [r.shard for r in results if r.shard.num_samples]
    strays = [s.dir for s in new_shards if not s.dir.startswith(doc["generation"] + "/")]
    if strays:  # never publish a manifest whose own generation does not hold its new shards
        raise IntegrityError(f"{out}: shard {strays[0]} is not in this build's generation {doc['generation']}; "
                             "run the build again with --overwrite")
    check_file_sizes(out, new_shards)
    skipped = [fmt.Skip(**s) for s in doc["skipped"]] + [k for r in results for k in r.skipped]
    base = None
    if doc["base"] is not None:
        base = load_manifest(out)
        if hashlib.sha256(base.to_json().encode()).hexdigest() != doc["base"]:
            raise IntegrityError(f"{out}: the dataset changed while an append to it was staged; "
                                 "run the append again")
    packed = sum(s.num_samples for s in new_shards)
    if packed == 0 and base is None:
        first = f" (first: {skipped[0].key}: {skipped[0].reason})" if skipped else ""
        shutil.rmtree(staging, ignore_errors=True)
        raise SourceError(f"{doc['params']['raw']}: nothing packed, all {len(skipped)} records skipped{first}")
    counts = {"found": packed + len(skipped), "packed": packed, "skipped": len(skipped)}
    _check_skip_rate(doc, skipped, counts, max_skipped)
    flat, audio_clipped = sum(r.flattened for r in results), sum(r.audio_clipped for r in results)
    build_info = {**{k: v for k, v in doc["params"].items() if k != "tokenizer_sha256"},
                  **({"input": doc["input"]} if doc.get("input") else {}),
                  **({"flattened": flat} if flat else {}),
                  **({"audio_clipped": audio_clipped} if audio_clipped else {}),
                  "seconds": round(seconds, 3) if seconds is not None else None,
                  "workers": workers, "cores_used": cores, "disk_wait": round(disk_wait, 3) if disk_wait is not None else None,
                  "created_unix": round(time.time(), 3),
                  "mmpack_version": _version(), "layout": f"{doc['kind']}: {doc.get('layout', '')}"}
    if base is not None:  # the append's own counts in its entry, the dataset's in `counts`
        added = list(doc["classes"][len(base.classes):]) if base.classes is not None and doc["classes"] else []
        build_info["appended"] = [*base.build.get("appended", []),
                                  {**{k: build_info[k] for k in ("raw", "created_unix", "seconds")}, **counts,
                                   **({"new_classes": added} if added else {})}]
        build_info = {**base.build, "appended": build_info["appended"]}
        counts = {k: base.counts[k] + counts[k] for k in counts}
    build_info["fingerprint"] = doc["fingerprint"]  # what a run of the same command finds done
    manifest = fmt.Manifest(
        inputs=_commit_inputs(out, doc["generation"]),
        kind=doc["kind"],
        columns=tuple(fmt.Column(**c) for c in doc["columns"]),
        shards=(*(base.shards if base else ()), *new_shards),
        counts=counts,
        skipped=(*(base.skipped if base else ()), *skipped),
        classes=tuple(doc["classes"]) if doc["classes"] is not None else None,
        tokenizer=doc["tokenizer"] if base is None else base.tokenizer,
        build=build_info,
        generation=doc["generation"],
        audio=doc.get("audio") if base is None else base.audio,
    )
    kept = outdir.publish(out, manifest)
    if kept:
        log.warning("%s: kept %s, still open by a reader; the next build into it removes %s", out,
                    ", ".join(kept), "them" if len(kept) > 1 else "it")
    return manifest


def _commit_inputs(out: Path, generation: str) -> fmt.FileEntry | None:
    """The staged inputs table, moved into the generation (where a killed commit left it too)."""
    staged, final = outdir.staging_dir(out) / inputs.STAGED, out / generation / fmt.INPUTS_NAME
    if staged.is_file():
        os.replace(staged, final)
    if not final.is_file():
        return None
    return fmt.FileEntry(f"{generation}/{fmt.INPUTS_NAME}", final.stat().st_size,
                         checksum_file(final, "xxh3_128"), "xxh3_128")


def _check_skip_rate(doc: dict, skipped: list[fmt.Skip], counts: dict, max_skipped: float | None) -> None:
    """--max-skipped: a build that skips more than this share of what it found fails, its
    reasons counted (a wrong --kind or a broken decoder skips most of a dataset)."""
    if max_skipped is None or not counts["found"] or counts["skipped"] <= max_skipped * counts["found"]:
        return
    reasons = Counter(s.reason.split(" (")[0] for s in skipped).most_common(3)
    top = "; ".join(f"{n} x {reason}" for reason, n in reasons)
    raise SourceError(f"{doc['params']['raw']}: {counts['skipped']:,} of {counts['found']:,} records skipped "
                      f"({counts['skipped'] / counts['found']:.1%}, more than --max-skipped {max_skipped:g}): {top}; "
                      "nothing was published")


def _version() -> str:
    from packer import __version__

    return __version__
