"""A training script for `bench doctor` whose DataLoader workers start by spawn (as they do with
CUDA, and by forkserver, Python 3.14's default): the workers, and the doctor's own runs of the
loader alone, pickle its dataset by its name in __main__. It prints how it was run.

    python [-W ignore::UserWarning] [-m tests.tools.doctor_spawn | tests/tools/doctor_spawn.py] [START_METHOD]
"""

import sys
import time

import torch


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        return torch.full((4,), float(i * i))


if __name__ == "__main__":
    print(f"ran as {__name__} from {sys.argv[0]}, warnings: {sys.warnoptions}", flush=True)
    method = sys.argv[1] if len(sys.argv) > 1 else "spawn"
    dl = torch.utils.data.DataLoader(Squares(), batch_size=8, num_workers=1, multiprocessing_context=method)
    for x in dl:
        time.sleep(0.02)  # a step far longer than a batch takes: compute-bound, measured alone once
