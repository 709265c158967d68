"""Real training steps for `bench loaders --model`: a ResNet-18 for image batches and a small
GPT-style transformer for token batches (no torchvision needed), forward + backward + an
optimizer step on the batch as each loader hands it over, on CUDA when there is one (bf16,
channels_last), else on the CPU, so that the same code path runs in CI."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from loaders.augment import normalize


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + self.skip(x))


def resnet18(classes: int = 1000) -> nn.Module:
    """ResNet-18 (He et al.): the layout torchvision's resnet18 has, 11.7M parameters."""
    layers, cin = [], 64
    for cout, stride in ((64, 1), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1)):
        layers.append(_Block(cin, cout, stride))
        cin = cout
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))


class TinyGPT(nn.Module):
    """A small causal transformer: 4 layers, width 256, context up to `context` tokens."""

    def __init__(self, vocab: int, context: int, width: int = 256, layers: int = 4, heads: int = 4):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)  # pre-norm: no nested tensors
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=tokens.device), 1)
        h = self.tok(tokens) + self.pos(torch.arange(n, device=tokens.device))
        return self.head(self.body(h, mask=mask, is_causal=True))


def _as_tokens(batch, context: int) -> torch.Tensor:
    """[B, L] token ids of any token batch a bench row hands over: TokenWindows' (x, y),
    PackedDocuments' dict, or the on-the-fly baseline's flat tensor (cut into rows)."""
    if isinstance(batch, (tuple, list)):
        return batch[0]
    if isinstance(batch, dict):
        return batch["tokens"]
    flat = batch.reshape(-1)
    rows = max(1, flat.numel() // context)
    return flat[:rows * context].reshape(rows, -1) if flat.numel() >= context else flat.reshape(1, -1)


def model_steps(vocab: int, context: int):
    """(device, image step, token step): each takes a batch and trains one step, synchronised.
    On the CPU (CI) token rows are cut to 128 tokens, so that the code path runs in seconds."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    context = context if cuda else min(context, 128)
    vision = resnet18().to(device, memory_format=torch.channels_last)
    lm = TinyGPT(vocab, context).to(device)
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (vision, lm)}

    def train(model, loss_of):
        opt = opts[id(model)]
        with (torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)):
            loss = loss_of()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()

    def image_step(batch) -> None:
        images = (batch["image"] if isinstance(batch, dict) else batch[0]).to(device, non_blocking=True)
        labels = (batch["label"] if isinstance(batch, dict) else batch[1]).to(device, non_blocking=True)
        x = normalize(images).contiguous(memory_format=torch.channels_last)
        train(vision, lambda: F.cross_entropy(vision(x), labels.long() % 1000))

    def token_step(batch) -> None:
        tokens = _as_tokens(batch, context).to(device, non_blocking=True)[:, :context].long() % vocab
        train(lm, lambda: F.cross_entropy(lm(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()))

    return device, image_step, token_step
