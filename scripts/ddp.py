"""Data-parallel training with torchrun: each rank's `Loader` takes its share of every epoch from
torch.distributed (gloo on CPU, nccl on GPUs); the ranks see disjoint samples and the same
number of batches, so no rank waits for another at the end of an epoch.

    torchrun --standalone --nproc_per_node 2 scripts/ddp.py OUT [--epochs 1] [--batch-size 16]

Rank 0 prints, per epoch, how many samples each rank saw and how many the ranks shared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loaders import Loader, MMapDataset
from loaders.augment import normalize
from train_folder import small_cnn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="a dataset dir of images (packer build)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args(argv)
    # one GPU per process, as DDP wants; more processes than GPUs (a test, a laptop) train on the CPU
    cuda = torch.cuda.is_available() and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) <= torch.cuda.device_count()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    ds = MMapDataset(args.out)
    loader = Loader(ds, args.batch_size, seed=0, columns=["image", "label", "key"], device=device)
    model = torch.nn.parallel.DistributedDataParallel(small_cnn(len(ds.classes)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        keys = []
        for batch in loader:
            loss = F.cross_entropy(model(normalize(batch["image"])), batch["label"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            keys += batch["key"]
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, keys)
        if dist.get_rank() == 0:
            shared = set(seen[0]).intersection(*map(set, seen[1:])) if len(seen) > 1 else set()
            print(json.dumps({"epoch": epoch, "per_rank": [len(k) for k in seen], "shared": len(shared),
                              "distinct": len(set().union(*map(set, seen))), "dataset": len(ds)}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    rc = main()
    # Leave without the interpreter's teardown: with torch 2.13's gloo backend a rank aborts in
    # it ("terminate called without an active exception") in about a third of CPU runs, even
    # after destroy_process_group (the same happens with no mmpack at all: pytorch/pytorch#190489)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
