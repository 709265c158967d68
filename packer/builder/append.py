"""`packer build --append`: RAW's new records added to a dataset as new shards, after checking
that the files it was built from are unchanged and that the build would write the same columns.
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace

from packer.builder.config import UNLESS_DEFAULT, BuildConfig
from packer.builder.scan import MULTI_DOC_EXTS, Scan
from packer.dataset import format as fmt
from packer.builder import inputs
from packer.dataset.reader import DatasetReader
from packer.errors import ConfigError

log = logging.getLogger(__name__)


def record_key(key: str, kind: str) -> str:
    """The record (file) a sample or skip key belongs to: text keys carry ':line' / ':row'."""
    if kind == "text":
        head, _, tail = key.rpartition(":")
        if head and tail.isdigit() and head.lower().endswith(tuple(MULTI_DOC_EXTS)):
            return head
    return key


def check_unchanged(config: BuildConfig, reader: DatasetReader, found: Scan) -> None:
    """--append adds RAW's new records; files deleted or rewritten since the dataset was built
    would keep their old samples, so they are refused unless --allow-changed says to keep them."""
    base = reader.manifest
    if base.inputs is None:
        log.warning("%s: its build recorded no inputs table (an older mmpack): files of RAW deleted or changed "
                    "since cannot be found; only new files are added", config.out)
        return
    deleted, changed = inputs.changed_since(reader.root, base.inputs, found)
    if (deleted or changed) and not config.allow_changed:
        listed = [f"{k} (deleted)" for k in deleted[:3]] + [f"{k} (changed)" for k in changed[:3]]
        raise ConfigError(f"--append: {len(deleted)} file(s) of {config.raw} deleted and {len(changed)} changed since "
                          f"{config.out} was built ({', '.join(listed)}{', ...' if len(deleted) + len(changed) > 6 else ''}); "
                          "the dataset still holds their old samples. Rebuild with --overwrite, or pass "
                          "--allow-changed to keep those samples as they are and add only the new records")


def check_classes(config: BuildConfig, base: fmt.Manifest, found: Scan) -> None:
    """Class folders the dataset does not have get the labels after its classes, where
    torchvision's ImageFolder over RAW now would number every class in sorted order: refused
    unless --allow-new-classes says to number them so."""
    new = list((found.classes or ())[len(base.classes or ()):]) if base.classes is not None else []
    if new and not config.allow_new_classes:
        named = ", ".join(f"{name} = {len(base.classes) + i}" for i, name in enumerate(new[:4]))
        imagefolder = sorted({*base.classes, *new})
        raise ConfigError(f"--append: {config.raw} has {len(new)} class folder(s) the dataset in {config.out} does not "
                          f"({named}{', ...' if len(new) > 4 else ''}); they would be numbered after its "
                          f"{len(base.classes)} classes, where ImageFolder over RAW would number them in sorted order "
                          f"({new[0]} = {imagefolder.index(new[0])}); pass --allow-new-classes to add them so, or "
                          "rebuild with --overwrite")


def only_new(found: Scan, reader: DatasetReader) -> Scan:
    """The records of RAW that the dataset does not hold yet (packed or skipped before)."""
    base = reader.manifest
    if found.kind != base.kind:
        raise ConfigError(f"--append: RAW holds {found.kind}, the dataset in {reader.root} is {base.kind}")
    known = {record_key(s.key, base.kind) for s in base.skipped}
    known.update(record_key(key.decode("utf-8"), base.kind) for key in reader.key_bytes())
    return replace(found, records=tuple(r for r in found.records if r.key not in known),
                   skipped=tuple(s for s in found.skipped if s.key not in known))


def check_compatible(config: BuildConfig, base: fmt.Manifest, params: dict, columns, tokenizer) -> None:
    """The build appended would write the dataset's columns with its flags and tokenizer."""
    where = f"--append to {config.out}"
    old = base.build
    unless_default = {f.name: f.default for f in fields(BuildConfig) if f.metadata["bytes"] == UNLESS_DEFAULT}
    for name in config.append_checked():  # first: a flag names the fix better than the columns it changes
        new = params.get(name, unless_default.get(name))
        if name not in old and name not in unless_default:
            continue  # a dataset built before the flag was recorded
        was = old.get(name, unless_default.get(name))
        if was != new:
            fix = f"; pass --{name.replace('_', '-')} {was}" if isinstance(was, (int, str)) and not isinstance(was, bool) \
                else ""
            raise ConfigError(f"{where}: {name} is {new!r}, the dataset was built with {was!r}{fix}")
    if tuple(columns) != tuple(base.columns):
        raise ConfigError(f"{where}: columns differ ({fmt.columns_text(columns)} vs the dataset's {fmt.columns_text(base.columns)}); "
                          "use the dataset's --image-size")
    if base.tokenizer and tokenizer and base.tokenizer.get("sha256") != tokenizer.sha256:
        raise ConfigError(f"{where}: tokenizer {config.tokenizer} is not the one the dataset was built with "
                          f"(sha256 {tokenizer.sha256[:12]} vs {base.tokenizer['sha256'][:12]})")
