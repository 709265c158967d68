"""A voice model's features computed once with packer.map, then a model trained on them by length.

Every clip of a folder goes through a feature function (log-mel frames float16 [T, 80] and a
pitch track float32 [T], `bench.voice.features`, torch ops) with `packer.map`, then a small pitch predictor trained from `Loader` in batches of about
--max-tokens frames (clips of one length together, `max_tokens`), saving the model and the
loader's state every step, so that a run that is stopped goes on with the next batch.

    python scripts/voice_features.py CLIPS [--out DIR] [--workers 2] [--epochs 2] [--max-tokens 3000]

CLIPS is any folder of audio files (WAV, FLAC, Ogg, MP3), searched recursively. `--sample N`
makes it from N real recordings of mmpack's test audio first, so that this runs anywhere. The
map runs once (again after a kill it goes on where it stopped; done, it is skipped); each step
prints its batch: the clips, the frames padded and real, and a digest of the clips' keys.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import packer
from bench.voice import F0_RANGE, MELS, features
from loaders import Loader, MMapDataset
from packer.errors import MmpackError

AUDIO = {".wav", ".flac", ".ogg", ".oga", ".mp3"}


def pitch_model() -> torch.nn.Module:
    """Frames [B, MELS, T] -> a voiced frame's log-pitch [B, 1, T]."""
    return torch.nn.Sequential(torch.nn.Conv1d(MELS, 64, 5, padding=2), torch.nn.GELU(),
                               torch.nn.Conv1d(64, 1, 5, padding=2))


def step_loss(model, batch) -> tuple[torch.Tensor, int]:
    """The masked loss of a batch (real, voiced frames only: padding trains nothing), and its
    real frames."""
    mel, f0, lengths = batch["mel"].float(), batch["f0"], batch["mel_lengths"]
    real = torch.arange(mel.shape[1])[None, :] < lengths[:, None]
    voiced = real & (f0 > 0)
    target = torch.log(f0.clamp(min=F0_RANGE[0]))
    pred = model(mel.transpose(1, 2))[:, 0]
    loss = F.mse_loss(pred[voiced], target[voiced]) if voiced.any() else pred.sum() * 0
    return loss, int(lengths.sum())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("clips", type=Path, help="a folder of audio clips")
    ap.add_argument("--out", type=Path, default=None, help="the features' dataset (default: CLIPS.features beside it)")
    ap.add_argument("--workers", type=int, default=2, help="processes of the map (its output is the same for any)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=3000, help="padded frames a batch holds at most")
    ap.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (as if preempted)")
    ap.add_argument("--sample", type=int, default=None, metavar="N", help="make CLIPS from N real recordings first")
    args = ap.parse_args(argv)
    if args.sample and not args.clips.exists():
        from bench import sounds

        sounds.make_audio_folders(args.clips, args.sample, seed=0)
    out = args.out or args.clips.with_name(args.clips.name + ".features")
    clips = sorted(p for p in args.clips.rglob("*") if p.suffix.lower() in AUDIO and p.is_file())
    try:
        m = packer.map(features, clips, out, workers=args.workers, shard_size="16MB")
    except MmpackError as exc:
        print(f"packer.map: error: {exc}", file=sys.stderr)
        return 2
    print(f"features of {args.clips} -> {out}: found {m.counts['found']} = packed {m.counts['packed']} + skipped "
          f"{m.counts['skipped']}")

    ds = MMapDataset(out, columns=["mel", "f0", "key"])
    loader = Loader(ds, max_tokens=args.max_tokens, bucket_by="length:mel", seed=0)
    torch.manual_seed(0)
    model = pitch_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    checkpoint = out / "train.ckpt"
    start, steps = 0, 0
    if checkpoint.exists():
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        loader.load_state_dict(state["loader"])
        start, steps = loader.epoch, state["steps"]
        print(f"resumed at epoch {start}, step {steps}")
    for epoch in range(start, args.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            loss, frames = step_loss(model, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "loader": loader.state_dict(),
                        "steps": steps}, checkpoint)
            keys = hashlib.blake2b("\n".join(batch["key"]).encode(), digest_size=6).hexdigest()
            print(f"step {steps} epoch {epoch}: {len(batch['key'])} clip(s), keys {keys}, "
                  f"{batch['mel'].shape[0] * batch['mel'].shape[1]} frames padded, {frames} real, loss {loss.item():.3f}")
            if steps == args.stop_after:
                print(f"stopped after step {steps}")
                return 0
    last = loader.padding.epoch  # the figures of the epoch this process ran last (None: it ran none)
    print(f"done: {steps} steps over {args.epochs} epochs of {len(ds)} clips"
          + (f"; padding {last['share']:.1%} of the last epoch's frames" if last else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
