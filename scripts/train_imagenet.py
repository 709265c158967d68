"""The PyTorch ImageNet example's training loop (pytorch/examples, imagenet/main.py) on mmpack:
the dataset and transform lines changed, the augmentation semantics kept (RandomResizedCrop(224)
+ RandomHorizontalFlip + Normalize for training, Resize(256) + CenterCrop(224) for evaluation),
run on the GPU batch by batch instead of in DataLoader workers image by image.

    packer build DATA/train DATA/train.mmpack --image-size 256 --keep-aspect   # once; this script
    packer build DATA/val DATA/val.mmpack --image-size 256 --keep-aspect       # does it when missing
    python scripts/train_imagenet.py DATA [--arch resnet18|small] [--epochs 90] [-b 256] [--lr 0.1]
    python scripts/train_imagenet.py DATA --on-the-fly -j 16   # the example's own pipeline, to compare

DATA holds train/ and val/ class folders, as for torchvision's ImageFolder. `--sample N` makes
DATA from N crops of the real photos mmpack's tests use, so that this runs anywhere (on a CPU,
`--arch small` trains a four-layer CNN in seconds).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from loaders import Loader, MMapDataset
from loaders.augment import eval_transform, train_transform
import packer


def packed(folder: Path) -> Path:
    """folder/ packed once beside it as folder.mmpack (keep-aspect, shorter side 256)."""
    out = folder.with_name(folder.name + ".mmpack")
    if not (out / "manifest.json").exists():
        try:
            m = packer.build(folder, out, image_size=256, keep_aspect=True)
        except packer.MmpackError as exc:
            raise SystemExit(f"packer build: error: {exc}") from None
        print(f"packed {folder} -> {out}: found {m.counts['found']} = packed {m.counts['packed']} + skipped "
              f"{m.counts['skipped']}", file=sys.stderr)
    return out


def model_for(arch: str, classes: int) -> torch.nn.Module:
    from bench.models import resnet18, small_cnn  # torchvision.models, without torchvision

    return (resnet18 if arch == "resnet18" else small_cnn)(classes)


def optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr, momentum=0.9, weight_decay=1e-4)


def train_step(model, opt, images: torch.Tensor, target: torch.Tensor) -> float:
    """One SGD step; the batch's summed loss."""
    loss = F.cross_entropy(model(images), target)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item() * len(target)


def on_the_fly(args, device: torch.device) -> int:
    """The example's own input pipeline, for comparison: every image decoded, cropped, flipped and
    normalised by a DataLoader worker every epoch; the same model, optimizer and step."""
    try:
        from torchvision import datasets, transforms
    except ImportError:
        raise SystemExit("--on-the-fly needs torchvision: pip install torchvision") from None
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_set = datasets.ImageFolder(args.data / "train", transforms.Compose([
        transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))
    train_loader = torch.utils.data.DataLoader(train_set, args.batch_size, shuffle=True, num_workers=args.workers,
                                               pin_memory=device.type == "cuda")
    model = model_for(args.arch, len(train_set.classes)).to(device, memory_format=torch.channels_last)
    opt = optimizer(model, args.lr)
    for epoch in range(args.epochs):
        started, seen, total = time.perf_counter(), 0, 0.0
        for images, target in train_loader:
            images = images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
            seen, total = seen + len(target), total + train_step(model, opt, images, target.to(device, non_blocking=True))
        print(f"epoch {epoch}: {seen} train images, loss {total / max(seen, 1):.3f}, "
              f"{seen / (time.perf_counter() - started):,.0f} images/s (on the fly, {args.workers} workers)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", type=Path, help="folder with train/ and val/ class folders")
    ap.add_argument("--arch", choices=("resnet18", "small"), default="resnet18")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("-b", "--batch-size", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample", type=int, default=None, metavar="N", help="make DATA from N real photo crops first")
    ap.add_argument("--on-the-fly", action="store_true", help="the example unchanged: torchvision's ImageFolder, "
                    "each image decoded and cropped in DataLoader workers every epoch (needs torchvision; trains only)")
    ap.add_argument("-j", "--workers", type=int, default=4, help="DataLoader workers with --on-the-fly")
    args = ap.parse_args(argv)
    if args.sample and not (args.data / "train").exists():
        from bench import data

        data.make_image_folders(args.data / "train", args.sample, seed=1)
        data.make_image_folders(args.data / "val", max(args.sample // 5, 1), seed=2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.on_the_fly:
        return on_the_fly(args, device)

    # torchvision: train_dataset = datasets.ImageFolder(traindir, transforms.Compose([
    #     transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]))
    # train_loader = DataLoader(train_dataset, batch_size, shuffle=True, num_workers=workers, pin_memory=True)
    train_set = MMapDataset(packed(args.data / "train"), columns=["image", "label"])
    train_loader = Loader(train_set, args.batch_size, shuffle=True, seed=args.seed, device=device)
    # torchvision: val_loader = DataLoader(datasets.ImageFolder(valdir, transforms.Compose([
    #     transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(), normalize])), batch_size)
    val_set = MMapDataset(packed(args.data / "val"), columns=["image", "label"])
    val_loader = Loader(val_set, args.batch_size, shuffle=False, device=device)
    if not set(val_set.classes) <= set(train_set.classes):
        raise SystemExit(f"{args.data}: val/ has classes that train/ lacks")
    # val's labels index its own class list: as train's indices (ImageFolder assumes the lists equal)
    val_to_train = torch.tensor([train_set.classes.index(c) for c in val_set.classes], device=device)
    crops = torch.Generator(device=device).manual_seed(args.seed)  # the augmentation's draws, reproducible

    model = model_for(args.arch, len(train_set.classes)).to(device, memory_format=torch.channels_last)
    opt = optimizer(model, args.lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.1)
    for epoch in range(args.epochs):
        model.train()
        started, seen, total = time.perf_counter(), 0, 0.0
        for batch in train_loader:
            # torchvision: for images, target in train_loader: images = images.to(device) ...
            images = train_transform(batch["image"], batch["image_size"], 224, generator=crops, channels_last=True)
            seen, total = seen + len(batch["label"]), total + train_step(model, opt, images, batch["label"])
        sched.step()
        model.eval()
        correct = count = 0
        with torch.no_grad():
            for batch in val_loader:
                images = eval_transform(batch["image"], batch["image_size"], 224, resize=256, channels_last=True)
                correct += int((model(images).argmax(1) == val_to_train[batch["label"]]).sum())
                count += len(batch["label"])
        print(f"epoch {epoch}: {seen} train images, loss {total / max(seen, 1):.3f}, "
              f"{seen / (time.perf_counter() - started):,.0f} images/s; val acc@1 {100 * correct / max(count, 1):.1f}% "
              f"of {count}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
