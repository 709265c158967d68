"""A training script with known answers for `bench doctor`: a dataset that sleeps SAMPLE_S per
sample, a step that sleeps STEP_S, batches of 4 (data-bound when 4 x SAMPLE_S outweighs STEP_S);
it raises at step CRASH_AT when given. A negative STEP_S spins for that long instead of the model
and the sleep: a step whose cost neither a VM's coarse timer (a sleep of 50 ms can take 60) nor
torch's threads on a busy machine stretch. It imports nothing of mmpack.

    python tests/tools/doctor_train.py SAMPLE_S STEP_S [CRASH_AT]
"""

import sys
import time

import torch

class Slow(torch.utils.data.Dataset):
    def __init__(self, sleep_s):
        self.sleep_s = sleep_s

    def __len__(self):
        return 400

    def __getitem__(self, i):
        time.sleep(self.sleep_s)
        return torch.zeros(8), i % 3


if __name__ == "__main__":  # doctor_ranks.py imports Slow
    sample_s, step_s = float(sys.argv[1]), float(sys.argv[2])
    crash_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    dl = torch.utils.data.DataLoader(Slow(sample_s), batch_size=4, shuffle=True, num_workers=0)
    model = torch.nn.Linear(8, 3)
    for step, (x, y) in enumerate(dl):
        if step_s >= 0:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            time.sleep(step_s)
        else:
            end = time.perf_counter() - step_s
            while time.perf_counter() < end:
                pass
        if crash_at is not None and step == crash_at:
            raise RuntimeError("the script's own failure")
    print("trained")
