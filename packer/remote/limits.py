"""Cache limits: a user's `cache_limit` read as bytes, and the one refusal when a limit is too
small for what a reader must hold at once (the dataset's largest shard, a reader's mapped
shards, one batch's shards), checked where each is known but always said the same way."""

from __future__ import annotations

import re

from packer.errors import ConfigError
from packer.system import SIZE_UNITS


def parse_limit(limit) -> int | None:
    """A cache limit as bytes: None, a positive int, or a string of a number and a unit
    ("20GB", "512MiB", "1.5 TB"; binary: "GB" is GiB, as --shard-size reads it,
    `packer.system.SIZE_UNITS`)."""
    if limit is None:
        return None
    if isinstance(limit, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", limit)
        unit = match and match.group(2).lower()
        if not match or unit not in SIZE_UNITS:
            raise ConfigError(f"cache_limit {limit!r}: expected bytes, or a number and a unit (20GB, 512MiB)")
        limit = int(float(match.group(1)) * SIZE_UNITS[unit])
    if type(limit) is not int or limit <= 0:
        raise ConfigError(f"cache_limit must be a positive number of bytes, not {limit!r}")
    return limit


def check_limit(url: str, room: int, need: int, what: str, *, limit: int, advice: str = "") -> None:
    """A ConfigError when `need` bytes (`what` a reader holds at once) exceed `room`, the share
    of the cache limit `limit` that is left for them."""
    if need > room:
        left = "" if room == limit else f", and leaves {room:,} to this process (after the index files and the " \
            "node's other ranks)"
        raise ConfigError(f"{url}: cache_limit {limit:,} bytes is too small: it must hold {need:,} bytes at once "
                          f"({what}){left}; raise cache_limit{advice}")
