"""Trials: the fixes a waiting loop is offered, each measured alone before it is named. Worker
counts and prefetch_factor, persistent_workers, a Loader's gather threads and bucket_by, and a
sample of an image folder packed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from . import chat
from .probes import ceiling
from .report import ChatPackedRun, Failure, LoaderAlternatives, PackedRun, PersistentRun, SweepRun, ThreadsRun

BUCKET_PADDING = 0.3  # a keep-aspect Loader's canvas this much padding: grouping by aspect is measured
PACK_SAMPLE = 512  # files of an image folder packed to measure what packing gives
DEEPER_PREFETCH = 4


def workers_sweep(loader) -> list[SweepRun] | None:
    """A DataLoader over a map-style dataset: the same dataset alone with 1, 2, 4, ... workers up
    to the cores, then the best count with a deeper prefetch_factor, so the fixes suggested come
    with measured rates."""
    import torch

    cores = os.cpu_count() or 1
    if not isinstance(loader, torch.utils.data.DataLoader) or loader.num_workers >= cores \
            or loader.batch_size is None or isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return None

    def alone(workers: int, prefetch: int | None = None) -> SweepRun:
        return SweepRun(num_workers=workers, prefetch_factor=prefetch,
                        measured=ceiling(clone(loader, num_workers=workers, prefetch_factor=prefetch)))
    counts = sorted({min(2 ** k, cores) for k in range(cores.bit_length() + 1)} | {cores})
    runs = [alone(n) for n in counts if n > loader.num_workers]
    top = best(runs)
    if top is not None:
        runs.append(alone(top.num_workers, DEEPER_PREFETCH))
    return runs


def best(runs: list[SweepRun] | None) -> SweepRun | None:
    """The fastest of the sweep's runs at the default prefetch_factor."""
    rated = [r for r in runs or [] if r.samples_per_s and r.prefetch_factor is None]
    return max(rated, key=lambda r: r.samples_per_s, default=None)


def clone(loader, **changes):
    """The script's DataLoader again over its dataset, shuffled, with `changes` (the measured fixes):
    pinned as the script's is, so a fix is not credited with the pinning it leaves out."""
    import torch

    args = {"batch_size": loader.batch_size, "shuffle": True, "num_workers": loader.num_workers,
            "pin_memory": loader.pin_memory,
            "collate_fn": loader.collate_fn, "drop_last": loader.drop_last, "worker_init_fn": loader.worker_init_fn,
            "multiprocessing_context": loader.multiprocessing_context, "prefetch_factor": loader.prefetch_factor}
    return torch.utils.data.DataLoader(loader.dataset, **{**args, **changes})


def persistent(loader) -> PersistentRun | None:
    """A DataLoader whose workers start again every epoch (no `persistent_workers`): the same
    loader alone with persistent_workers=True, over as many epochs as `ceiling` takes (as the
    loader's own ceiling is), so that fix comes with a measured rate. On epochs long against
    the workers' start-up the two agree, and no fix is named."""
    import torch

    if not isinstance(loader, torch.utils.data.DataLoader) or not loader.num_workers or loader.persistent_workers \
            or loader.batch_size is None or isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return None
    steady = clone(loader, persistent_workers=True)
    try:
        return PersistentRun(num_workers=loader.num_workers, measured=ceiling(steady))
    finally:
        del steady  # its workers end with it


def loader_alternatives(loader) -> LoaderAlternatives | None:
    """A `loaders.Loader`, measured alone as it could be set: with a gather thread per core
    where it has fewer, and, where its batches are keep-aspect canvases mostly of padding,
    grouped by aspect (`bucket_by="aspect"`: a smaller canvas to gather and to copy)."""
    try:
        from loaders import Loader
        from packer.system import available_cores
    except ImportError:
        return None
    if not isinstance(loader, Loader):
        return None
    out = LoaderAlternatives(num_threads=loader.num_threads)
    cores = available_cores()
    if loader.num_threads < cores:
        before, loader.num_threads = loader.num_threads, cores
        try:
            out.more_threads = ThreadsRun(num_threads=cores, measured=ceiling(loader))
        finally:
            loader.num_threads = before
    out.padding = _padding(loader)
    if out.padding is not None and out.padding > BUCKET_PADDING and hasattr(loader.source, "shapes_of"):
        out.bucketed = _bucketed(loader)
    return out


def _padding(loader) -> float | None:
    """The share of a keep-aspect batch's canvas that is padding; None for other batches."""
    try:
        batch = next(iter(loader))
        sizes, canvas = batch["image_size"].cpu(), batch["image"].shape
    except Exception:  # noqa: BLE001 - not an image canvas (tokens, fixed-size images): nothing to group
        return None
    return 1 - float(sizes.prod(1).sum()) / (canvas[0] * canvas[1] * canvas[2])


def _bucketed(loader):
    from loaders import Loader

    try:
        with Loader(loader.source, loader.batch_size, seed=0, bucket_by="aspect", device=loader.device,
                    num_threads=loader.num_threads) as grouped:
            return ceiling(grouped)
    except Exception as exc:  # noqa: BLE001 - a fix it could not measure is said, not raised
        return Failure.of(exc)


def packed(loader) -> PackedRun | ChatPackedRun | Failure | None:
    """For a DataLoader over an image folder (ImageFolder's `root` and `samples`): up to
    PACK_SAMPLE of its files packed with `packer build` at the size its samples have, then
    `loaders.Loader` over them alone, so the "pack the data" fix comes with a measured rate.
    Over conversations rendered with a chat template: `chat.packed`."""
    import torch

    conversations = chat.packed(loader)
    if conversations is not None:
        return conversations
    samples = getattr(getattr(loader, "dataset", None), "samples", None)
    if not isinstance(loader, torch.utils.data.DataLoader) or not isinstance(samples, list) or not samples:
        return None
    try:
        first = loader.dataset[0]
        image = first.get("image") if isinstance(first, dict) else first[0]
        side = max(int(d) for d in image.shape if int(d) > 4)  # HWC or CHW: the larger spatial side
        with tempfile.TemporaryDirectory(prefix="mmpack-doctor-") as tmp:
            raw, out = Path(tmp) / "raw", Path(tmp) / "out"
            _link_sample(samples, raw)
            import packer
            from loaders import Loader, MMapDataset

            packer.build(raw, out, image_size=side)

            ds = MMapDataset(out)
            with Loader(ds, loader.batch_size or 64, seed=0, columns=["image", "label"]) as reader:
                root = getattr(loader.dataset, "root", None)
                return PackedRun(files=len(ds), image_size=side, root=str(root) if root else None,
                                 measured=ceiling(reader))
    except Exception as exc:  # noqa: BLE001 - a fix it could not measure is said, not raised
        return Failure.of(exc)


def _link_sample(samples: list, raw: Path) -> None:
    """Up to PACK_SAMPLE of the folder's files, evenly spread, linked into RAW/<class>/."""
    step = max(len(samples) // PACK_SAMPLE, 1)
    for i, (path, _) in enumerate(samples[::step][:PACK_SAMPLE]):
        link = raw / Path(path).parent.name / f"{i:06d}{Path(path).suffix}"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path(path).resolve())
