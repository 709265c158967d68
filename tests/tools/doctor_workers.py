"""A training script for `bench doctor` whose DataLoader workers are CPU-bound: each sample
spins 4 ms of CPU in one of 2 worker processes; the step is 1 ms. It imports nothing of mmpack."""

import time

import torch


class Busy(torch.utils.data.Dataset):
    def __len__(self):
        return 4000

    def __getitem__(self, i):
        end = time.process_time() + 0.004
        while time.process_time() < end:
            pass
        return torch.zeros(8), 0


for x, y in torch.utils.data.DataLoader(Busy(), batch_size=8, num_workers=2):
    time.sleep(0.001)
