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


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int):
        super().__init__()
        cout = 4 * mid
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return F.relu(self.body(x) + self.skip(x))


def resnet50(classes: int = 1000) -> nn.Module:
    """ResNet-50 (v1.5, stride in the 3x3 conv, as torchvision's): 25.6M parameters."""
    layers, cin = [], 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(_Bottleneck(cin, mid, stride if b == 0 else 1))
            cin = 4 * mid
    return nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, classes))


def small_cnn(classes: int = 1000) -> nn.Module:
    """Four strided 3x3 convolutions (32..256 channels) and a linear head: a CPU-sized image model
    (the scripts' and `bench augment`'s stand-in for a ResNet where there is no GPU)."""
    layers, cin = [], 3
    for cout in (32, 64, 128, 256):
        layers += [nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def trainer(model: nn.Module, device: torch.device):
    """train(loss_of): one step of `model` (on `device`) on the loss `loss_of()` computes, bf16
    autocast on CUDA, backward, an SGD step, synchronised."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    cuda = device.type == "cuda"

    def train(loss_of) -> None:
        with (torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)):
            loss = loss_of()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()

    return train


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


ARCHS = {"resnet18": "ResNet-18", "resnet50": "ResNet-50"}


def model_steps(vocab: int, context: int, arch: str = "resnet18"):
    """(device, image step, token step): each takes a batch and trains one step, synchronised;
    the images' network is `arch` (ARCHS). On the CPU (CI) token rows are cut to 32 tokens, so
    that the code path runs in seconds (the language model's output layer over the 30,522 ids is
    most of its step)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    context = context if cuda else min(context, 32)
    vision = {"resnet18": resnet18, "resnet50": resnet50}[arch]().to(device, memory_format=torch.channels_last)
    lm = TinyGPT(vocab, context).to(device)
    train_vision, train_lm = trainer(vision, device), trainer(lm, device)

    def image_step(batch) -> None:
        images = (batch["image"] if isinstance(batch, dict) else batch[0]).to(device, non_blocking=True)
        labels = (batch["label"] if isinstance(batch, dict) else batch[1]).to(device, non_blocking=True)
        x = normalize(images).contiguous(memory_format=torch.channels_last)
        train_vision(lambda: F.cross_entropy(vision(x), labels.long() % 1000))

    def token_step(batch) -> None:
        tokens = _as_tokens(batch, context).to(device, non_blocking=True)[:, :context].long() % vocab
        train_lm(lambda: F.cross_entropy(lm(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()))

    return device, image_step, token_step
