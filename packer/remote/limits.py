"""Cache limits: a user's `cache_limit` read as bytes, and the one refusal when a limit is too
small for what a reader must hold at once (the dataset's largest shard, a reader's mapped
shards, one batch's shards), checked where each is known but always said the same way.

When a Loader, `ds.batched` or a StatefulDataLoader is made, its next pass is checked against
the room each process has (`budgets`: the limit less the index files, over the node's ranks and
the loader's worker processes, each of which maps its own batch's shards): a first batch that
does not fit reads by rows (`packer.remote.rows`) where it can, else is refused
(`check_room`); a random order whose shards the limit cannot hold, which would fetch them a
shard at a time many times an epoch, reads by rows where it can, else is refused with the limit
that would hold them (`check_random`); block order's window over the room is a warning
(`check_window`)."""

from __future__ import annotations

import re

from packer.errors import ConfigError
from packer.system import SIZE_UNITS, local_ranks


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


def check_limit(url: str, room: int, need: int, what: str, *, limit: int, advice: str = "",
                sharers: str = "the node's other ranks") -> None:
    """A ConfigError when `need` bytes (`what` a reader holds at once) exceed `room`, the share
    of the cache limit `limit` that is left for them (after the index files and `sharers`)."""
    if need > room:
        left = "" if room == limit else f", and leaves {room:,} to this process (after the index files and " \
            f"{sharers})"
        raise ConfigError(f"{url}: cache_limit {limit:,} bytes is too small: it must hold {need:,} bytes at once "
                          f"({what}){left}; raise cache_limit{advice}")


FIRST_BATCHES = 8  # batches whose shards a cache limit must hold one at a time, checked at the start
MOST_FETCHED = 1.5  # times its shards an epoch in random order may fetch, a shard at a time, before it is refused


def processes(held) -> int:
    """The processes of this node that map shards of a limited cache at once, each its own
    batch's: the node's ranks (LOCAL_WORLD_SIZE) times a loader's worker processes
    (`held.processes`, of a source's `packer.remote.residency.Residency`, which StatefulDataLoader
    sets: two workers whose batches each held half the limit waited 120 s on each other's pins,
    then failed)."""
    return local_ranks() * max(1, held.processes)


def sharers(held) -> str:
    workers = max(1, held.processes)
    return "the node's other ranks" + (f" and this loader's {workers} worker processes" if workers > 1 else "")


def budgets(held) -> dict:
    """Bytes of shards each limited cache may hold for this process: its limit less its index
    files, over the node's ranks and the loader's worker processes (`processes`)."""
    out = {}
    for r in held.readers:
        cache = r.cache
        if cache is not None and cache.limit is not None:
            out[id(cache)] = (cache.limit - cache.index_bytes) // processes(held)
    return out


def check_workers(source, epochs, workers: int) -> None:
    """`check_first_batches` again for a remote dataset's source read by `workers` loader
    processes, each mapping its own batch's shards: the cache limit must hold them all, refused
    when the loader is made (StatefulDataLoader) or by a plain DataLoader's first worker to find
    them (it never told the dataset), not 120 s into a wait for room."""
    held = source.residency if source is not None else None
    if held is not None and workers > held.processes:
        held.processes = workers
        check_first_batches(source, epochs)


def check_first_batches(source, epochs) -> None:
    """`check_room` for the next pass of `epochs` over a remote dataset's source (else nothing):
    what Loader and BatchedDataset check when they are made."""
    held = source.residency
    if held is not None:
        twin = epochs.twin()
        p = twin.upcoming()
        order = epochs.order
        check_room(held, lambda b: twin.batch_ids(p, b), twin.clip(p, FIRST_BATCHES), order, epochs.block_window)
        if order == "random" and not held.rows_pass:
            check_random(held, min(1.0, local_ranks() / max(1, epochs.world_size)))
        if order == "block" and not held.rows_pass:
            check_window(held, epochs)


def check_window(held, epochs) -> None:
    """A warning where the shards of block order's first window (the samples a rank reads
    shuffled among themselves) hold more bytes than the cache limit leaves this process: every
    batch draws from all of them, so evicting any is fetching it again within the window, many
    times an epoch. Said with the limit that would hold them and the largest window (halving it)
    whose shards fit (`fitting_window`)."""
    room = budgets(held)
    if not room:  # no limited cache: nothing to say, and no window's ids to compute at start-up
        return
    needs = _window_needs(held, epochs, room, epochs.block_window)
    over = [key for key, nbytes in needs.items() if nbytes > room[key]]
    if not over:
        return
    import warnings

    key = over[0]
    cache = _cache(held, key)
    warnings.warn(f"{cache.url}: block order's window of {epochs.block_window:,} samples reads shards of "
                  f"{needs[key] / 1e6:,.1f} MB over and over, more than the {max(room[key], 0) / 1e6:,.1f} MB of "
                  f"cache_limit this process has: each epoch would fetch them many times; raise cache_limit by "
                  f"{(needs[key] - room[key]) * local_ranks() / 1e6:,.1f} MB or more (the node's ranks share it), "
                  f"or pass block_window={fitting_window(held, epochs)}", stacklevel=4)


def fitting_window(held, epochs) -> int:
    """The largest of block order's window (`epochs.block_window`) and its halvings whose first
    window's shards fit what the cache limit leaves this process (`budgets`), at least 1: the
    window itself where no cache is limited. Under a limit, a window that fits fetches each
    shard whole about once an epoch, in requests of a shard's size, where one that does not
    reads by rows or fetches its shards again and again."""
    room = budgets(held)
    fits = epochs.block_window
    while room and fits > 1 and any(nbytes > room[key] for key, nbytes in
                                    _window_needs(held, epochs, room, fits).items()):
        fits //= 2
    return max(fits, 1)


def _window_needs(held, epochs, room: dict, window: int) -> dict:
    """The bytes of the shards of block order's first window of `window` samples, per limited cache."""
    twin = epochs.twin()
    twin.block_window = window
    p = twin.upcoming()
    shards = set()
    for b in range(twin.clip(p, -(-window // twin.batch_size))):
        shards.update(held.shards_of(twin.batch_ids(p, b)).tolist())
    return _bytes_by_cache(held, shards, room)


def check_room(held, batch_ids, num_batches: int, order: str | None = None, window: int | None = None) -> None:
    """Where one of the first batches reads more shard bytes than the cache limit leaves this
    process, the pass reads by rows (`held.rows_pass`, `packer.remote.rows`) where every
    limited cache can; else a ConfigError: its batches could never be gathered."""
    held.rows_pass = False
    room = budgets(held)
    for b in range(min(num_batches, FIRST_BATCHES)):
        shards = held.shards_of(batch_ids(b))
        need = _bytes_by_cache(held, shards.tolist(), room)
        over = [key for key, nbytes in need.items() if nbytes > room[key]]
        if over and all(held.rows_of(r).usable() for r in held.readers if r.cache is not None and id(r.cache) in room):
            held.rows_pass = True
            return
        for key, nbytes in need.items():
            cache = _cache(held, key)
            check_limit(cache.url, room[key], nbytes, f"one batch of this order ({len(shards)} shards)",
                        limit=cache.limit, sharers=sharers(held),
                        advice=", or use a smaller batch" + (" or fewer workers" if processes(held) > local_ranks()
                                                             else "") + (
                            ", or order='block' (its batches read a few shards once the dataset is many times its "
                            "window of 8,192 samples)" if order != "block" else
                            " (block order's batches read a few shards only on a dataset many times its window of "
                            f"{window or 8192:,} samples a rank)"))


def held_whole(room: int, held: int, shards: list[tuple[int, int]]) -> list[bool]:
    """Which of a batch's shards mapped or present in a limited cache it holds whole, the others'
    rows read by range: `shards` is each one's (bytes whole, bytes of the batch's rows in it), the
    first preferred; each is held whole while it, the rows of those after it and `held` (what the
    batch holds besides: the rows of its shards not in the cache) fit `room` (`budgets`). A shard
    read whole from the cache costs no request; a batch that held every one it found there left
    its rows no room (they evicted the very shards it then fetched again whole, and it waited on
    itself)."""
    rest = sum(rows for _, rows in shards)
    out = []
    for whole, rows in shards:
        rest -= rows
        out.append(held + whole + rest <= room)
        held += whole if out[-1] else rows
    return out


def random_fetches(shard_bytes: int, samples: int, shards: int, room: int, share: float = 1.0) -> float:
    """About how many times its shards (`shard_bytes` in all, `samples` over `shards`) an epoch
    in random order fetches through `room` bytes of a cache, the node reading `share` of each
    epoch: a shard is read once for each of its samples the node draws, at random times through
    the epoch, and is there with about the chance that the room holds it (the share of the
    shards it can hold); each miss fetches it whole. (Eviction by next use does a little better;
    64 px images in shards of 10 at 30% fetched 5.1x, this says 7.3x.)"""
    if not shards or shard_bytes <= 0:
        return 1.0
    held = min(1.0, max(room, 0) / shard_bytes)
    return 1.0 + max(samples * share / shards - 1.0, 0.0) * (1.0 - held)


def room_for_random(shard_bytes: int, samples: int, shards: int, share: float = 1.0) -> int:
    """The room a cache needs for an epoch in random order to fetch at most MOST_FETCHED times its
    shards (`random_fetches`)."""
    reads = samples * share / max(shards, 1)
    if reads <= 1.0:
        return 0
    return int(shard_bytes * max(0.0, 1.0 - (MOST_FETCHED - 1.0) / (reads - 1.0))) + 1


def check_random(held, share: float = 1.0) -> None:
    """A random order reads every shard all epoch long: where a limited cache cannot hold enough
    of them (`random_fetches` over MOST_FETCHED: 64 px images at a batch of 4 through a limit of
    30% fetched 13.6x the dataset an epoch, in silence), the pass reads by rows (about the
    dataset once) where every limited cache can; else a ConfigError before the first batch,
    naming the limit that would hold. The room is the node's, not a process's: its processes all
    read the same shards. `share`: the part of each epoch the node's ranks read."""
    limited = [r for r in held.readers if r.cache is not None and r.cache.limit is not None]
    over = []
    for r in limited:
        cache = r.cache
        shard_bytes, samples = sum(cache.sizes), int(r.shard_ends[-1]) if len(r.shard_ends) else 0
        times = random_fetches(shard_bytes, samples, len(cache.sizes), cache.limit - cache.index_bytes, share)
        if times > MOST_FETCHED:
            over.append((r, times, shard_bytes, cache.index_bytes + room_for_random(shard_bytes, samples,
                                                                                     len(cache.sizes), share)))
    if not over:
        return
    if all(held.rows_of(r).usable() for r in limited):
        held.rows_pass = True
        return
    r, times, shard_bytes, need = over[0]
    why = held.rows_of(r).why_not() or "its files cannot be read by rows"
    raise ConfigError(f"{r.cache.url}: a random order reads every shard all epoch long, and cache_limit "
                      f"{r.cache.limit:,} bytes holds {min(1.0, (r.cache.limit - r.cache.index_bytes) / shard_bytes):.0%} "
                      f"of its {shard_bytes:,} bytes of shards: each epoch would fetch about {times:.1f}x them, a shard "
                      f"at a time ({why}); raise cache_limit to {need:,} bytes, or use order='block' (batches of "
                      "nearby samples, shuffled within a window), or shuffle=False")


def _bytes_by_cache(held, shards, room: dict) -> dict:
    """The bytes of `shards` (each once) per limited cache of `room`, keyed as `budgets` keys it."""
    out: dict = {}
    for g in shards:
        cache = held.cache_of(g)
        if cache is not None and id(cache) in room:
            out[id(cache)] = out.get(id(cache), 0) + held.shard_bytes(g)
    return out


def _cache(held, key: int):
    """The cache `budgets` keyed as `key`."""
    return next(r.cache for r in held.readers if id(r.cache) == key)
