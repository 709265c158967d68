"""A two-rank DDP job on the CPU (gloo) for `bench doctor -- torchrun`: rank SLOW (argv[1])
takes 20 ms a sample of data, batches of 4; the other rank's data is free. Each step is a
forward, a backward (DDP's all-reduce, where the ranks meet) and 10 ms of work. It imports
nothing of mmpack."""

import os
import sys
import time

import torch
import torch.distributed as dist
from doctor_train import Slow  # a dataset that sleeps per sample

SLOW = int(sys.argv[1])


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = Slow(0.02 if rank == SLOW else 0.0)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=torch.utils.data.DistributedSampler(data))
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        time.sleep(0.01)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
