"""A language model trained on a mixture: code and prose, 70/30, through one Loader.

Builds two text datasets with the real `packer` command and a real pretrained tokenizer
(MiniLM's tokenizer.json): code (Python's own library sources) and prose (the English lines of
their docstrings and comments, as JSONL). Mixes them 70/30 as token windows, trains a tiny
next-token model for a few steps, and prints the tokens it saw from each source, checked against
the weights: every prefix of the stream holds each source by its share.

    python scripts/mix_lm.py [--steps 40] [--seq-len 128] [--batch-size 16] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from bench import data
from loaders import Loader, Mixture, TokenWindows
import packer

WEIGHTS = {"code": 0.7, "prose": 0.3}


def build(work: Path, tokenizer: Path) -> dict[str, Path]:
    code_raw = data.make_text(work / "raw-code", 2_000_000)
    prose_raw = work / "raw-prose"
    prose_raw.mkdir(parents=True, exist_ok=True)
    with open(prose_raw / "lines.jsonl", "w", encoding="utf-8") as f:
        for line in data.caption_lines(20_000, seed=3):
            f.write(json.dumps({"text": line}) + "\n")
    outs = {"code": work / "code", "prose": work / "prose"}
    for name, raw in (("code", code_raw), ("prose", prose_raw)):
        packer.build(raw, outs[name], tokenizer=tokenizer, append_eos="auto")
    return outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--work", type=Path, default=None, help="keep RAW and the datasets here (default: removed)")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="mmpack-mix-"))
    try:
        tokenizer = data.minilm_tokenizer()
        outs = build(work, tokenizer)
        names = list(WEIGHTS)
        mixture = Mixture([TokenWindows(outs[n], args.seq_len) for n in names], [WEIGHTS[n] for n in names])
        print(f"== {mixture}: " + ", ".join(f"{n} {len(s):,} windows" for n, s in zip(names, mixture.sources)))
        vocab = json.loads(Path(tokenizer).read_text(encoding="utf-8"))["model"]["vocab"]
        model = torch.nn.Sequential(torch.nn.Embedding(len(vocab), 64), torch.nn.Linear(64, len(vocab)))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        tokens = torch.zeros(len(names), dtype=torch.int64)
        loader = Loader(mixture, args.batch_size, seed=0)
        step, worst = 0, 0.0
        while step < args.steps:
            for x, y, source in loader:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
                tokens += torch.bincount(source, minlength=len(names)) * args.seq_len
                share = tokens.double() / tokens.sum()
                worst = max(worst, max(abs(float(tokens[k]) - WEIGHTS[n] * float(tokens.sum())) / args.seq_len
                                       for k, n in enumerate(names)))
                step += 1
                if step % 10 == 0 or step == args.steps:
                    print(f"   step {step:3d}  loss {loss.item():.3f}  " + "  ".join(
                        f"{n} {int(tokens[k]):,} tokens ({share[k]:.1%})" for k, n in enumerate(names)))
                if step == args.steps:
                    break
        ok = worst < 1
        print(f"== every prefix within {worst:.2f} windows of 70/30: {'ok' if ok else 'NOT OK'}")
        return 0 if ok else 1
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
