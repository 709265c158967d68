"""Train on your own image folder: pack it once with `packer build` (RAW/<class>/<image>), then
train a small CNN from `Loader`, saving the model and the loader's state, so that a run that is
stopped goes on with the next batch when started again. Runs on a GPU when there is one.

    python scripts/train_folder.py RAW [--out DIR] [--epochs 2] [--image-size 64] [--batch-size 32]

`--on-the-fly` trains the same model the way most scripts do instead: a DataLoader whose workers
decode and resize every image of every epoch (an ImageFolder-like dataset, no packing, no
resume). `bench doctor -- python scripts/train_folder.py RAW --on-the-fly` says why that waits.
`--sample N` makes RAW from N crops of the real photos mmpack's tests use, so that this runs
anywhere.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from loaders import Loader, MMapDataset
from loaders.augment import normalize, random_flip
import packer
from packer.errors import MmpackError


def small_cnn(num_classes: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, num_classes))


class Folder(torch.utils.data.Dataset):
    """RAW/<class>/<image> decoded and resized per sample, as torchvision's ImageFolder with a
    Resize: `root`, `classes` and `samples` (path, class index) as it names them."""

    def __init__(self, root: Path, image_size: int):
        self.root, self.image_size = str(root), image_size
        self.classes = sorted(d.name for d in Path(root).iterdir() if d.is_dir())
        self.samples = [(str(f), k) for k, c in enumerate(self.classes) for f in sorted((Path(root) / c).iterdir())
                        if f.is_file()]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        from PIL import Image

        path, label = self.samples[i]
        with Image.open(path) as img:
            img = img.convert("RGB").resize((self.image_size, self.image_size))
        return {"image": torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(
            self.image_size, self.image_size, 3), "label": label}


def on_the_fly(args) -> int:
    ds = Folder(args.raw, args.image_size)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where the packed run trains too
    loader = torch.utils.data.DataLoader(ds, args.batch_size, shuffle=True, num_workers=args.workers,
                                         pin_memory=device.type == "cuda")
    model = small_cnn(len(ds.classes)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps = 0
    for epoch in range(args.epochs):
        total, count = 0.0, 0
        for batch in loader:
            images, labels = batch["image"].to(device, non_blocking=True), batch["label"].to(device, non_blocking=True)
            loss = F.cross_entropy(model(random_flip(normalize(images))), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            total, count = total + loss.item(), count + 1
            if steps == args.stop_after:
                return 0
        print(f"epoch {epoch}: {count} steps, mean loss {total / max(count, 1):.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path, help="image folder: RAW/<class>/<image>")
    ap.add_argument("--out", type=Path, default=None, help="the dataset dir (default: RAW.mmpack beside RAW)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (as if preempted)")
    ap.add_argument("--on-the-fly", action="store_true", help="decode every image every epoch in DataLoader "
                    "workers instead of packing once (what bench doctor should find waiting)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers with --on-the-fly")
    ap.add_argument("--sample", type=int, default=None, metavar="N", help="make RAW from N real photo crops first")
    args = ap.parse_args(argv)
    if args.sample and not args.raw.exists():
        from bench import data

        data.make_image_folders(args.raw, args.sample, seed=0, min_side=300)  # photos, not thumbnails
    if args.on_the_fly:
        return on_the_fly(args)
    out = args.out or args.raw.with_name(args.raw.name + ".mmpack")
    if not (out / "manifest.json").exists():
        try:
            m = packer.build(args.raw, out, image_size=args.image_size)
        except MmpackError as exc:
            print(f"packer build: error: {exc}", file=sys.stderr)
            return 2
        print(f"packed {args.raw} -> {out}: found {m.counts['found']} = packed {m.counts['packed']} + skipped "
              f"{m.counts['skipped']}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ds = MMapDataset(out)
    loader = Loader(ds, args.batch_size, seed=0, columns=["image", "label"], device=device)
    model = small_cnn(len(ds.classes)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checkpoint = out / "train.ckpt"
    start, steps = 0, 0
    if checkpoint.exists():
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        loader.load_state_dict(state["loader"])
        start, steps = loader.epoch, state["steps"]
        print(f"resumed at epoch {start}, step {steps}")
    for epoch in range(start, args.epochs):
        loader.set_epoch(epoch)
        total, count = 0.0, 0
        for batch in loader:
            x = random_flip(normalize(batch["image"]))
            loss = F.cross_entropy(model(x), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            total, count = total + loss.item(), count + 1
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "loader": loader.state_dict(),
                        "steps": steps}, checkpoint)
            if steps == args.stop_after:
                print(f"stopped after step {steps} (run again to go on)")
                return 0
        print(f"epoch {epoch}: {count} steps, mean loss {total / max(count, 1):.3f}")
    print(f"done: {steps} steps over {args.epochs} epochs of {len(ds)} images")
    return 0


if __name__ == "__main__":
    sys.exit(main())
