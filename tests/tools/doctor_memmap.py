"""A nanoGPT-style training loop for bench doctor's tests: no DataLoader and nothing of mmpack;
get_batch() slices random windows of an np.memmap of token ids, as nanoGPT's train.py does,
then a small language model takes its step. argv: DATA_MS, the Python work get_batch does on top
(as a tokenizer or a decoder in the loop would), and STEPS."""

import os
import sys
import tempfile
import time

import numpy as np
import torch

data_ms, steps = float(sys.argv[1]), int(sys.argv[2])
path = os.path.join(tempfile.mkdtemp(prefix="doctor-memmap-"), "train.bin")
(np.arange(400_000) % 1024).astype(np.uint16).tofile(path)
data = np.memmap(path, dtype=np.uint16, mode="r")
block, batch = 32, 8
torch.manual_seed(0)


def get_batch():
    ix = torch.randint(len(data) - block - 1, (batch,))
    x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
    end = time.perf_counter() + data_ms / 1e3
    while time.perf_counter() < end:  # work in Python, holding the training thread
        pass
    return x, y


model = torch.nn.Sequential(torch.nn.Embedding(1024, 256), torch.nn.Linear(256, 512), torch.nn.GELU(),
                            torch.nn.Linear(512, 1024))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for it in range(steps):
    x, y = get_batch()
    loss = torch.nn.functional.cross_entropy(model(x).view(-1, 1024), y.view(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
