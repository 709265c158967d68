"""Probes of the loader the script iterated most, after its loop: its rate alone (the ceiling
without the model) and, for a DataLoader, one sample's work and the collate."""

from __future__ import annotations

import time

from .report import Ceiling, Failure, SampleCost

CEILING_BATCHES = 20
CEILING_S = 30.0
PER_SAMPLE_S = 5.0  # an iterable dataset's items are timed for at most this long (a stream may be slow to start)
SAMPLES_TIMED = 64  # a dataset's first items timed one by one


def batch_len(batch) -> int:
    """The samples in a batch: the first dimension of its first tensor (1 where it has none)."""
    import torch

    first = batch
    while isinstance(first, (list, tuple, dict)) and first:
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    return len(first) if isinstance(first, torch.Tensor) and first.dim() else 1


def padding_of(loader, batch) -> tuple[str, int, int] | None:
    """(column, real elements, padded elements) of a batch just taken: an mmpack loader's own
    count (`loader.padding.batch`); else, for a dict on the host, a ragged column beside its
    `{name}_lengths`, or an `attention_mask`. None where it says neither (or lies on a GPU, whose
    sum would wait for its queue)."""
    counted = getattr(loader, "padding", None)
    if counted is not None and getattr(counted, "batch", None):
        return counted.column, counted.batch["real"], counted.batch["padded"]
    if not isinstance(batch, dict):
        return None
    for name, lengths in batch.items():
        values = batch.get(name[: -len("_lengths")]) if name.endswith("_lengths") else None
        if values is not None and _on_host(lengths) and getattr(values, "dim", lambda: 0)() >= 2:
            return name[: -len("_lengths")], int(lengths.sum()), int(values.shape[0] * values.shape[1])
    mask = batch.get("attention_mask")
    if mask is not None and _on_host(mask) and getattr(mask, "dim", lambda: 0)() == 2:
        return "attention_mask", int(mask.sum()), int(mask.numel())
    return None


def _on_host(tensor) -> bool:
    return getattr(getattr(tensor, "device", None), "type", None) == "cpu"


def ceiling(loader, batches: int = CEILING_BATCHES, limit_s: float = CEILING_S) -> Ceiling | Failure:
    """The loader alone: a fresh iterator, its first batch apart (workers starting), the next
    batches timed with nothing done between them, over as many epochs as it takes (each new
    epoch's start-up counted, as training meets it). At least `batches`, and three times what a
    DataLoader's workers make ahead: those are made while the first one is, and would arrive as
    if at no cost (16 workers on an epoch of 8 batches: every batch at once, a rate no loader
    keeps). Stopped past `limit_s` once `batches` are in."""
    ahead = (getattr(loader, "num_workers", 0) or 0) * (getattr(loader, "prefetch_factor", None) or 2)
    want = max(batches, 3 * ahead)
    try:
        it = iter(loader)
        first = time.perf_counter()
        next(it)
        started, samples, n = time.perf_counter(), 0, 0
        while n < want and not (n >= batches and time.perf_counter() - started > limit_s):
            batch = next(it, None)
            if batch is None:  # the epoch ended: the next one's start-up is part of the rate
                it = iter(loader)
                batch = next(it, None)
                if batch is None:
                    break
            samples += batch_len(batch)
            n += 1
        seconds = time.perf_counter() - started
        return Ceiling(batches=n, samples_per_s=samples / seconds if seconds > 0 and n else None,
                       first_batch_s=started - first)
    except Exception as exc:  # noqa: BLE001 - a loader that cannot be iterated again: said, not raised
        return Failure.of(exc)


def caches(loader) -> dict:
    """The cache entries (`packer.remote.ShardCache`) of the datasets in object storage that a
    loader reads, by URL: found through what the loaders and views hold (a Loader's source, a
    DataLoader's dataset, their readers)."""
    found, todo, seen = {}, [loader], set()
    while todo:
        obj = todo.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if type(obj).__name__ == "ShardCache":
            found[obj.url] = obj
            continue
        if isinstance(obj, (list, tuple)):
            todo += list(obj)[:64]
            continue
        todo += [getattr(obj, name, None) for name in ("source", "dataset", "batches", "datasets", "readers", "reader",
                                                   "cache")]
    return found


LINK_PROBE_BYTES = 256 * 2**20  # the link's rate from GETs of about this much of the dataset's data


def link_rate(loader) -> float | None:
    """Bytes/s of plain GETs of the first dataset in object storage that `loader` reads (its
    largest data files, up to LINK_PROBE_BYTES, as many at once as a cache fetches): what the
    link gives a reader here, beside what the loop took of it; None where it reads none."""
    found = caches(loader)
    if not found:
        return None
    from packer.remote import DOWNLOADS

    from ..measure import raw_get_rate

    cache = next(iter(found.values()))
    return raw_get_rate(cache.url, cache.manifest, DOWNLOADS, most_bytes=LINK_PROBE_BYTES)


def per_sample(loader) -> SampleCost | Failure | None:
    """For a DataLoader: one sample's work (a map-style dataset's __getitem__, an iterable one's
    next item, up to PER_SAMPLE_S of them) and the collate of a batch, in this process (what each
    worker pays per sample)."""
    import torch

    if not isinstance(loader, torch.utils.data.DataLoader):
        return None
    ds = loader.dataset
    iterable = isinstance(ds, torch.utils.data.IterableDataset)
    if not iterable and not hasattr(ds, "__getitem__"):
        return None
    try:
        started = time.perf_counter()
        items = _items(ds, iterable)
        item_s = (time.perf_counter() - started) / max(len(items), 1)
        size = min(loader.batch_size or 1, len(items))
        started = time.perf_counter()
        if loader.collate_fn is not None and size:
            loader.collate_fn(items[:size])
        collate_s = (time.perf_counter() - started) / max(size, 1)
        return SampleCost(getitem_ms=1e3 * item_s, collate_ms_per_sample=1e3 * collate_s, iterable=iterable,
                          num_workers=loader.num_workers, pin_memory=bool(loader.pin_memory),
                          batch_size=loader.batch_size, dataset=type(ds).__name__)
    except Exception as exc:  # noqa: BLE001
        return Failure.of(exc)


def _items(ds, iterable: bool) -> list:
    """The dataset's first items: an iterable one's whole stream, as one worker sees it without
    get_worker_info(), for at most PER_SAMPLE_S."""
    if not iterable:
        return [ds[i] for i in range(min(len(ds), SAMPLES_TIMED))]
    started, items = time.perf_counter(), []
    for item in ds:
        items.append(item)
        if len(items) >= SAMPLES_TIMED or time.perf_counter() - started > PER_SAMPLE_S:
            break
    return items

