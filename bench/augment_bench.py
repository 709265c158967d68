"""`bench augment`: what training-faithful augmentation costs, measured in one run on one device.

- `Loader` images/s over the same real photo crops stored two ways: S x S centre crops
  (`--image-size 224`) and keep-aspect (`--image-size 256 --keep-aspect`, a canvas per batch);
- milliseconds per batch of `train_transform` and `eval_transform` (and `normalize` alone, the
  floor) on that device, against one forward + backward + SGD step of an image model there: a
  small CNN on a CPU; ResNet-18 and ResNet-50 (bf16, channels_last) on CUDA, where the target is
  a training transform under 3% of a ResNet-50 step and under 5% of a ResNet-18 step.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import data
from .loaders_bench import machine
from .prepare import prepare_dataset
from .measure import measure


def _timed(fn, reps: int, cuda: bool) -> float:
    """Median milliseconds of fn() over `reps` calls after two warm-up calls."""
    times = []
    for i in range(reps + 2):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def _padding_pct(loader) -> float:
    """The share of a pass's batch bytes that are padding (0 for fixed-size images)."""
    image = canvas = 0
    for batch in loader:
        if "image_size" not in batch:
            return 0.0
        sizes = batch["image_size"].cpu()
        image += int((sizes[:, 0] * sizes[:, 1]).sum())
        canvas += len(sizes) * batch["image"].shape[1] * batch["image"].shape[2]
    return 100 * (1 - image / canvas) if canvas else 0.0


def device_ops(fn) -> list[str]:
    """The ops one call of `fn` runs that would each be a kernel launch on a card: torch's
    dispatched ops less views and bare allocations (no kernel runs for either). Not among them:
    numpy's work on the host, and the copies between host and device a card adds (on CPU
    tensors there are none to make)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    no_kernel = {"empty", "empty_strided", "empty_like", "_unsafe_view"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket.__name__ not in no_kernel:
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    fn()  # warmed: lazy set-up (a cache, a plan) is not the call's
    with Count() as count:
        fn()
    return count.ops


def launches(fn, cuda: bool) -> dict:
    """What one call of `fn` dispatches. "ops": the aten ops called from Python, from torch's
    profiler (nested ones not counted); on CUDA "kernels", the kernels it ran; on a CPU
    "gpu_path_ops", the kernels the batched path a GPU runs (`loaders.augment`'s matrix
    products, forced here) would launch (`device_ops`)."""
    from torch.profiler import ProfilerActivity, profile

    from loaders import augment

    fn()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::") and (e.cpu_parent is None or
                                                                   not e.cpu_parent.name.startswith("aten::")))
    if cuda:
        return {"ops": ops, "kernels": sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)}
    dense, augment._dense_path = augment._dense_path, lambda x: True
    try:
        return {"ops": ops, "gpu_path_ops": len(device_ops(fn))}
    finally:
        augment._dense_path = dense


def bench_augment(args) -> dict:
    from loaders import Loader, MMapDataset
    from loaders.augment import eval_transform, normalize, train_transform

    from .models import resnet18, resnet50, small_cnn, trainer

    work = Path(args.work or tempfile.mkdtemp(prefix="mmpack-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    count, bs, size, store = args.images, args.batch_size, args.size, args.store_size
    make = lambda raw: data.make_image_folders(raw, count, seed=0)  # noqa: E731  crops up to 640 px, any aspect
    _, fixed, _ = prepare_dataset(work, "aug-fixed", count, make, {"image_size": size})
    _, aspect, _ = prepare_dataset(work, "aug-aspect", count, make, {"image_size": store, "keep_aspect": True})
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    reps = args.reps or (20 if cuda else 5)

    def loader_row(name: str, out: Path, flags: str, bucket_by: str | None = None) -> tuple[dict, dict]:
        loader = Loader(MMapDataset(out, columns=["image", "label"]), bs, shuffle=True, seed=0, device=device,
                        bucket_by=bucket_by)
        m = measure(lambda: loader, lambda b: len(b["label"]), passes=args.passes)
        batch = {k: v.clone() for k, v in next(iter(loader)).items()}  # not the loader's buffers
        return {"dataset": name, "flags": flags, "images_per_s": m["samples_per_s"], "canvas": list(batch["image"].shape),
                "mb_per_batch": batch["image"].numel() / 1e6, "cpu_s_per_1000": m["cpu_s_per_1000"],
                "padding_pct": _padding_pct(loader)}, batch

    fixed_row, f = loader_row("fixed", fixed, f"--image-size {size}")
    aspect_row, a = loader_row("keep-aspect", aspect, f"--image-size {store} --keep-aspect")
    bucketed_row, _ = loader_row("keep-aspect", aspect, f"--image-size {store} --keep-aspect; bucket_by='aspect'",
                                 bucket_by="aspect")
    g = torch.Generator(device=device).manual_seed(0)
    transforms = [
        ("train_transform, keep-aspect canvas", lambda: train_transform(a["image"], a["image_size"], size, generator=g)),
        ("eval_transform, keep-aspect canvas", lambda: eval_transform(a["image"], a["image_size"], size, resize=store)),
        (f"train_transform, fixed {size} batch", lambda: train_transform(f["image"], None, size, generator=g)),
        (f"normalize only, fixed {size} batch (no crop: the floor)", lambda: normalize(f["image"])),
    ]
    rows = [{"transform": name, "ms": _timed(fn, reps, cuda), **launches(fn, cuda)} for name, fn in transforms]
    x = train_transform(a["image"], a["image_size"], size, generator=g, channels_last=True)
    labels = a["label"].to(device) % 1000

    def step_ms(build) -> float:
        model = build().to(device, memory_format=torch.channels_last)
        train = trainer(model, device)
        return _timed(lambda: train(lambda: torch.nn.functional.cross_entropy(model(x), labels)), max(3, reps // 2), cuda)

    models = {name: step_ms(build)
              for name, build in ((("ResNet-18", resnet18), ("ResNet-50", resnet50)) if cuda else (("small CNN", small_cnn),))}
    for r in rows:
        r["pct_of_step"] = {m: 100 * r["ms"] / ms for m, ms in models.items()}
    return {"command": "bench augment", "machine": machine(), "device": str(device), "batch_size": bs,
            "size": size, "store_size": store, "num_images": count, "threads": torch.get_num_threads(),
            "loaders": [fixed_row, aspect_row, bucketed_row], "transforms": rows, "model_step_ms": models}
