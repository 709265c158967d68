"""Dataset splits by their files' names, as the Hugging Face Hub and WebDataset name them:
`train-00000-of-00004.parquet` (with a hash after it, as older uploads have), `data/train/...`,
`train-000000.tar`, `train.jsonl`. A build
takes one split: the one `--split` names, or the only one there is; a RAW with several and no
`--split` is refused, naming them, rather than packed as one dataset."""

from __future__ import annotations

import os
import re

from packer.dataset.format import Skip
from packer.errors import ConfigError

SPLIT_NAMES = ("train", "test", "validation", "valid", "val", "dev", "eval")
# `train-00000-of-00004.parquet`; older `push_to_hub` added a hash (`...-of-00004-5f3a2c1e9b3a5c8d.parquet`)
_SHARD = re.compile(r"([A-Za-z][A-Za-z0-9_]*)-\d+(?:-of-\d+)?(?:-[0-9a-f]{6,64})?\.")


def split_of(rel: str, given: str | None = None) -> str | None:
    """The split a file belongs to by its name or a folder above it; None when its name says none."""
    known = (*SPLIT_NAMES, given) if given else SPLIT_NAMES
    name = os.path.basename(rel)
    m = _SHARD.match(name)
    if m and m.group(1) in known:
        return m.group(1)
    stem = name.split(".", 1)[0]
    if stem in known:
        return stem
    return next((part for part in reversed(rel.split("/")[:-1]) if part in known), None)


def pick(files: list[tuple[str, str]], split: str | None, raw) -> tuple[list[tuple[str, str]], list[Skip]]:
    """The files of the split to build, and the others as skips."""
    found = sorted({s for rel, _ in files if (s := split_of(rel, split)) is not None})
    if split is None:
        if len(found) > 1:
            raise ConfigError(f"{raw}: holds the splits {', '.join(found)}; pass --split NAME to build one of them")
        return files, []
    if split not in found:
        raise ConfigError(f"--split {split!r}: {raw} has no such split (its files name "
                          f"{', '.join(found) or 'none'}; a split's files are named {split}-00000-of-00004.parquet, "
                          f"{split}-000000.tar, {split}.jsonl, or lie under {split}/)")
    chosen = [(rel, path) for rel, path in files if split_of(rel, split) == split]
    other = [Skip(rel, "scan", f"split {split_of(rel, split) or '(none)'}, not --split {split}")
             for rel, path in files if split_of(rel, split) != split]
    return chosen, other
