"""A build's staging, `OUT/.staging/`: the record of the build that fills it (`plan.json`: its
fingerprint, flags, shards and generation), claimed by a build that starts, resumed by the same build run
again, refused to another one unless --overwrite, and dropped after a user error. What is whole
in it (the shards' sidecars) is `packer.builder.shard`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from packer.builder.config import BuildConfig
from packer.builder.scan import Scan
from packer.builder.shard import wait_for_writers
from packer.dataset import format as fmt
from packer.dataset import outdir
from packer.dataset.reader import load_manifest
from packer.errors import ConfigError, MmpackError

# The build record. Its name is older than the glossary (a plan is the shard plan); kept, so that
# a build killed under an earlier version resumes.
RECORD_FILE = "plan.json"


def fingerprint(params: dict, inputs_digest: str, plan_digest: str, base_sha: str | None) -> str:
    """The build's name: what its bytes depend on (flags, inputs, plan, the dataset appended to)."""
    return hashlib.sha256(json.dumps([params, inputs_digest, plan_digest, base_sha], sort_keys=True).encode()).hexdigest()


def inputs_digest(found: Scan) -> str:
    """Every record's key, size and mtime, the scan's skips, and the classes when some has no
    record (an empty class folder): a changed input, or a new empty folder, changes it, since
    either changes a label. Classes that are the records' own folders are named by the keys
    already, so the digest of such a build is what earlier versions wrote."""
    digest = hashlib.sha256()
    for r in found.records:
        for path in (r.path, r.caption):
            if path is not None:
                size, mtime = found.stats[path]
                digest.update(f"{r.key}\0{os.path.basename(path)}\0{size}\0{mtime}\n".encode())
        if found.form != "folder" or r.text is not None:  # its label, caption and place come from a file, not its key
            digest.update(f"{r.label}\0{r.text}\0{r.at}\0{r.text_at}\n".encode())
    for s in found.skipped:
        digest.update(f"skip\0{s.key}\0{s.reason}\n".encode())
    if found.classes is not None and set(found.classes) - {r.key.split("/", 1)[0] for r in found.records}:
        digest.update("classes\0{}\n".format("\0".join(found.classes)).encode())
    return digest.hexdigest()


def claim(config: BuildConfig, doc: dict) -> fmt.Manifest | None:
    """Start, resume or refuse: staging belongs to one build, named by its fingerprint. Returns
    the dataset when it is this very build already (published by a run that may have been
    killed before it cleaned up): running a build again is not an error."""
    out = config.out
    staging = outdir.staging_dir(out)
    record_file = staging / RECORD_FILE
    old = read_record(out)
    current = load_manifest(out) if (out / fmt.MANIFEST_NAME).is_file() else None
    if old is not None and old.get("fingerprint") == doc["fingerprint"] and old.get("generation"):
        doc["generation"] = old["generation"]
        if current is not None and current.generation == doc["generation"]:
            return current
    if current is not None and not (config.append or config.overwrite):
        if current.build.get("fingerprint") == doc["fingerprint"]:  # this build is the dataset already
            doc["generation"] = current.generation
            return current
        raise ConfigError(f"{out}: already exists and is not empty; pass --overwrite to rebuild it "
                          "or --append to add new records")
    if old is not None and (old.get("fingerprint") != doc["fingerprint"] or not old.get("generation")):
        if not config.overwrite:
            raise ConfigError(f"{out}: holds an unfinished build with {_difference(old, doc)}; run it again "
                              "with its own arguments to resume it, or pass --overwrite to start over")
        wait_for_writers(staging)
        shutil.rmtree(staging)
        old = None
    staging.mkdir(parents=True, exist_ok=True)
    if old is None:  # the same name for every part of this build, and another than the dataset's now
        seed = f"{doc['fingerprint']}:{current.generation if current else ''}"
        doc["generation"] = fmt.generation_name(hashlib.sha256(seed.encode()).hexdigest())
        outdir.write_atomic(record_file, json.dumps(doc, indent=1))  # parts racing here write the same
    outdir.prepare_generation(out, doc["generation"])
    return None


def published(out: Path, doc: dict) -> fmt.Manifest | None:
    """OUT's dataset when it is the build `doc` plans (published already), else None."""
    if not (out / fmt.MANIFEST_NAME).is_file():
        return None
    current = load_manifest(out)
    same = current.generation == doc.get("generation") and current.build.get("fingerprint") == doc.get("fingerprint")
    return current if same else None


def read_record(out: Path) -> dict | None:
    try:
        return json.loads((outdir.staging_dir(out) / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _difference(old: dict, new: dict) -> str:
    changed = [f"{k} {old['params'].get(k)!r} (now {new['params'].get(k)!r})"
               for k in sorted(set(old.get("params", {})) | set(new["params"]))
               if old.get("params", {}).get(k) != new["params"].get(k)]
    if changed:
        return "other arguments: " + ", ".join(changed)
    if old.get("inputs") != new["inputs"]:
        return (f"other inputs: RAW has changed since it began ({old.get('records')} records then, "
                f"{new['records']} now, or files modified)")
    return "another plan (another mmpack version or a changed dataset to append to)"


def discard(config: BuildConfig) -> None:
    """After a user error: drop the staging and the generation it was filling (they cannot be
    resumed into anything useful); `outdir.locked` removes an OUT it made and left empty."""
    out = config.out
    shutil.rmtree(outdir.staging_dir(out), ignore_errors=True)
    try:
        current = load_manifest(out)
    except MmpackError:
        current = None
    outdir.remove_unused(out, current)
