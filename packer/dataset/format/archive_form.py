"""FORMAT.md section 9: the archive form, `archive.json` (the manifest and each compressed
file's size and checksum) beside one zstd frame per column file."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from packer.dataset.format.layout import check_version, written_version
from packer.dataset.format.manifest import Manifest, fields, as_list
from packer.errors import ManifestError

# -- 9. Archive form --------------------------------------------------------------------------
ARCHIVE_NAME = "archive.json"
ARCHIVE_FORMAT = "mmpack-archive"
ARCHIVE_SUFFIX = ".zst"


@dataclass(frozen=True)
class ArchiveFile:
    path: str  # the compressed file, relative to the archive dir: "<of>.zst"
    of: str  # the column file it restores, relative to the dataset dir
    size_bytes: int  # compressed
    xxh3_128: str  # XXH3-128 of the compressed bytes (new_checksum; the raw file's is the manifest's)


def archive_to_json(manifest: Manifest, files: list[ArchiveFile], level: int) -> str:
    doc = {"format": ARCHIVE_FORMAT, "version": written_version(manifest.kind, manifest.columns), "codec": "zstd", "level": level,
           "files": [asdict(f) for f in files], "manifest": json.loads(manifest.to_json())}
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def archive_from_json(text: str, *, where: str) -> tuple[Manifest, list[ArchiveFile]]:
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != ARCHIVE_FORMAT or doc.get("codec") != "zstd":
        raise ManifestError(f"{where}: not an {ARCHIVE_FORMAT} (zstd) description")
    if check_version(doc.get("version"), where=where) < 3:
        raise ManifestError(f"{where}: archives of format {doc.get('version')} are not read by this mmpack; "
                            "unpack it with the release that packed it")
    manifest = Manifest.from_doc(doc.get("manifest"), where=where)
    try:
        files = [ArchiveFile(**fields(f, ("path", "of", "size_bytes", "xxh3_128"), ())) for f in as_list(doc["files"])]
    except (KeyError, TypeError, ManifestError) as exc:
        raise ManifestError(f"{where}: malformed file list ({exc})") from None
    listed = {f.path for s in manifest.shards for f in s.files}
    if sorted(f.of for f in files) != sorted(listed) or any(
            f.path != f.of + ARCHIVE_SUFFIX or type(f.size_bytes) is not int or not isinstance(f.xxh3_128, str)
            for f in files):
        raise ManifestError(f"{where}: the file list does not match the manifest's files")
    return manifest, files
