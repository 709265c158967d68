"""A training script whose DataLoader hangs on one item: item HANG (argv[1]) sleeps for an hour
in a worker. Each worker writes its pid to PIDS (argv[2]), so a test can see that none is left.
It imports nothing of mmpack."""

import os
import sys
import time

import torch

HANG, PIDS = int(sys.argv[1]), sys.argv[2]


class Stuck(torch.utils.data.Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        if i == HANG:
            time.sleep(3600)
        return torch.zeros(8), 0


def note_pid(worker_id):
    with open(PIDS, "a") as f:
        f.write(f"{os.getpid()}\n")


if __name__ == "__main__":
    loader = torch.utils.data.DataLoader(Stuck(), batch_size=4, num_workers=2, worker_init_fn=note_pid)
    for epoch in range(3):
        for x, y in loader:
            time.sleep(0.01)
