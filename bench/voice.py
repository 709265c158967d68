"""What a voice model computes once per clip before training (the voice-conversion recipes'
content features and pitch), with torch ops on real recordings: `features(path)` gives a clip's
log-mel frames float16 [T, 80], a pitch track float32 [T] (autocorrelation, 0 where unvoiced)
and its speaker (the recording's name). Shared by `scripts/voice_features.py`, `bench packer
--map` and the tests. Runs on the CPU, one thread (a map's workers are the parallelism)."""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import soundfile as sf
import soxr
import torch  # at the top, as a user's feature module has it: a map's forkserver imports it once for its workers

RATE = 16000
HOP, WINDOW, MELS = 160, 400, 80  # 10 ms frames of 25 ms, as speech front ends take them
F0_RANGE = (60.0, 500.0)


@lru_cache(maxsize=1)
def _mel_matrix():
    """A Slaney-style triangular mel filterbank [WINDOW // 2 + 1, MELS]."""
    def hz_to_mel(f):
        return 2595.0 * math.log10(1.0 + f / 700.0)

    edges = torch.linspace(hz_to_mel(0.0), hz_to_mel(RATE / 2), MELS + 2, dtype=torch.float64)
    hz = 700.0 * (10 ** (edges / 2595.0) - 1.0)
    bins = torch.linspace(0, RATE / 2, WINDOW // 2 + 1, dtype=torch.float64)
    lower, centre, upper = hz[:-2, None], hz[1:-1, None], hz[2:, None]
    up = (bins[None, :] - lower) / (centre - lower)
    down = (upper - bins[None, :]) / (upper - centre)
    return torch.clamp(torch.minimum(up, down), min=0).T.to(torch.float32)


def features(path) -> dict:
    """A clip's log-mel frames, pitch track and speaker (see the module)."""
    torch.set_num_threads(1)
    audio, rate = sf.read(str(path), dtype="float32", always_2d=True)
    audio = audio.mean(axis=1)
    if rate != RATE:
        audio = soxr.resample(audio, rate, RATE, quality="HQ")
    x = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
    spec = torch.stft(x, n_fft=WINDOW, hop_length=HOP, window=torch.hann_window(WINDOW), return_complex=True)
    mel = torch.log(torch.clamp(spec.abs().pow(2).T @ _mel_matrix(), min=1e-10))
    frames = x[: (len(x) - WINDOW) // HOP * HOP + WINDOW].unfold(0, WINDOW, HOP) if len(x) >= WINDOW else x[None, :]
    f0 = _pitch(frames)[: mel.shape[0]]
    f0 = torch.nn.functional.pad(f0, (0, mel.shape[0] - len(f0)))
    return {"mel": mel.to(torch.float16).numpy(), "f0": f0.numpy(), "speaker": Path(path).stem.split(".")[0]}


def _pitch(frames):
    """Each frame's fundamental from its autocorrelation peak in F0_RANGE; 0 where the peak is
    weak (unvoiced, silence)."""
    frames = frames - frames.mean(dim=1, keepdim=True)
    spectrum = torch.fft.rfft(frames, n=2 * frames.shape[1])
    corr = torch.fft.irfft(spectrum.abs().pow(2), n=2 * frames.shape[1])[:, : frames.shape[1]]
    lo, hi = int(RATE / F0_RANGE[1]), int(RATE / F0_RANGE[0])
    window = corr[:, lo - 1:hi + 1]
    inner = window[:, 1:-1]
    is_peak = (inner > window[:, :-2]) & (inner >= window[:, 2:])  # a local maximum, not the slope down from lag 0
    peak, lag = torch.where(is_peak, inner, torch.full_like(inner, -torch.inf)).max(dim=1)
    voiced = peak > 0.3 * corr[:, 0].clamp(min=1e-9)
    return torch.where(voiced, RATE / (lag + lo).to(torch.float32), torch.zeros_like(peak))
