"""Audio clips as an audio build packs them (FORMAT.md section 4, "Audio samples"): decoded once
by libsndfile (`soundfile`) in blocks, mixed to the channels asked, resampled by soxr (its HQ
mode) where the file's rate differs, and stored as int16 PCM or float32; and the scan of a
folder of audio files, with class folders, sidecar transcripts (`<stem>.txt`) or a transcript
table (LJSpeech's `metadata.csv`, Common Voice's TSV: `packer.builder.transcripts`).

A file is read in blocks of BLOCK_FRAMES and given up once it passes --max-seconds: a header
that claims 2**31 frames costs what the file holds, never what it claims. `soundfile` and `soxr`
come with the `audio` extra; reading a packed audio dataset needs neither.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from packer.errors import ConfigError, SourceError

EXTS = frozenset({".wav", ".flac", ".ogg", ".oga", ".mp3", ".opus", ".aiff", ".aif"})
# frames read at a time: a multiple of every MPEG audio frame (384, 576, 1152 samples), because
# libsndfile's MP3 decode of a read that ends inside one differs from a whole-file read in the
# last bits of the floats around it
BLOCK_FRAMES = 1152 * 64
DEFAULT_MAX_SECONDS = 600.0  # 10 min: 230 MB of float32 stereo at 48 kHz while it is decoded
DTYPES = {"int16": "<i2", "float32": "<f4"}
INT16_SCALE = 32768.0  # libsndfile's: float = int16 / 32768
INSTALL = 'pip install "mmpack[audio]" (soundfile and soxr)'


def require() -> None:
    """ConfigError naming the install command when the audio extra is missing."""
    try:
        import soundfile  # noqa: F401
        import soxr  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"an audio build needs {exc.name}: {INSTALL}") from None


@dataclass(frozen=True)
class AudioSpec:
    """What every clip of a build becomes: its rate, channels and stored dtype (FORMAT.md's
    `audio` object), and the longest clip kept."""

    sample_rate: int
    channels: int = 1
    dtype: str = "<i2"
    max_seconds: float = DEFAULT_MAX_SECONDS

    def manifest(self) -> dict:
        return {"sample_rate": self.sample_rate, "channels": self.channels, "dtype": self.dtype}


def decode_audio(source, spec: AudioSpec) -> np.ndarray:
    """A file's clip as the spec stores it: [T] for mono, [T, C] otherwise; SourceError (a skip)
    for a file libsndfile cannot read, a truncated one, no audio, a clip over max_seconds, or
    channels that cannot be mixed to the ones asked."""
    import soundfile as sf

    try:
        with quiet(), sf.SoundFile(source) as f:
            rate, channels, claimed, subtype = f.samplerate, f.channels, f.frames, f.subtype
            _check_whole(f, source)
            _check_channels(channels, spec.channels)
            data = _read_blocks(f, rate, spec.max_seconds)
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError, OSError) as exc:
        raise SourceError(f"unreadable audio ({_why(exc)})") from None
    if len(data) == 0:
        raise SourceError("no audio (0 frames)")
    if subtype not in ("MPEG_LAYER_I", "MPEG_LAYER_II", "MPEG_LAYER_III") and 0 < claimed and len(data) < claimed:
        raise SourceError(f"truncated: its header says {claimed:,} frames, the file holds {len(data):,}")
    clip = convert(data, rate, spec)
    if len(clip) == 0:
        raise SourceError(f"no audio at {spec.sample_rate:,} Hz: its {len(data)} frame(s) at {rate:,} Hz resample to none")
    return clip


def convert(data: np.ndarray, rate: int, spec: AudioSpec) -> np.ndarray:
    """Decoded float32 frames [T, C] at `rate` as the spec stores them: the mean of the channels
    for mono (a mono file copied to both for stereo), resampled by soxr HQ, then int16 as
    clip(round(x * 32768)) or float32 as they are."""
    if data.shape[1] != spec.channels:
        data = data.mean(axis=1, keepdims=True, dtype=np.float32) if spec.channels == 1 else np.repeat(data, 2, axis=1)
    if rate != spec.sample_rate:
        import soxr

        data = soxr.resample(np.ascontiguousarray(data), rate, spec.sample_rate, quality="HQ")
    if spec.dtype == "<i2":
        data = np.clip(np.rint(data * INT16_SCALE), -32768, 32767).astype("<i2")
    data = data.astype(spec.dtype, copy=False)
    return np.ascontiguousarray(data[:, 0] if spec.channels == 1 else data)


_SHOULD_BE = re.compile(r"^\s*(\w+)\s*:\s*(\d+)\s*\(should be (\d+)\)", re.M)
OGG_PAGE = b"OggS"


def _check_whole(f, source) -> None:
    """SourceError for a file that holds less than its header says: libsndfile reads a WAV or
    AIFF cut short as a shorter clip, noting in its log what the chunk "should be"; an Ogg
    stream (Vorbis, Opus, FLAC in Ogg) takes its length from its last page, so a cut one reads
    as a shorter clip unless its last page is checked for the end-of-stream flag. (An MP3 holds
    no length to check: one cut short is packed as what it decodes to.)"""
    said = sorted(_SHOULD_BE.findall(f.extra_info), key=lambda m: m[0] not in ("data", "SSND"))  # the audio's own
    if said:
        chunk, claims, holds = said[0][0], int(said[0][1]), int(said[0][2])
        raise SourceError(f"truncated: its header says {claims:,} bytes of {chunk}, the file holds {holds:,} (cut "
                          "short, or a header never finished; rewrite it, e.g. sox in.wav out.wav, to keep it)")
    if f.format == "OGG" and isinstance(source, (str, os.PathLike)) and not _ogg_ended(source):
        raise SourceError("truncated: its last Ogg page does not end the stream (cut short)")


def _ogg_ended(path) -> bool:
    """Whether an Ogg file ends with a whole page that has the end-of-stream flag."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - 65_307 - 27))  # a page is at most 27 + 255 + 255 * 255 bytes
        tail = f.read()
    at = len(tail)
    while (at := tail.rfind(OGG_PAGE, 0, at)) >= 0:
        if at + 27 <= len(tail):
            lacing = tail[at + 27: at + 27 + tail[at + 26]]
            if at + 27 + len(lacing) + sum(lacing) == len(tail) and len(lacing) == tail[at + 26]:
                return bool(tail[at + 5] & 0x04)
    return False


def _check_channels(have: int, want: int) -> None:
    if have < 1:
        raise SourceError("no channels")
    if want == 2 and have > 2:
        raise SourceError(f"{have} channels cannot be mixed down to 2 without knowing their layout; build with "
                          "--channels 1 (their mean), or convert it first")


def _read_blocks(f, rate: int, max_seconds: float) -> np.ndarray:
    """Every frame of an open file as float32 [T, C], read a block at a time, and never more
    than max_seconds of it (SourceError past that)."""
    limit = math.ceil(max_seconds * rate)
    blocks, frames = [], 0
    while True:
        block = f.read(frames=BLOCK_FRAMES, dtype="float32", always_2d=True)
        if not len(block):
            break
        frames += len(block)
        if frames > limit:
            length = f"{f.frames / rate:,.2f} s by its header" if f.frames > limit else f"over {max_seconds:g} s"
            raise SourceError(f"longer than --max-seconds {max_seconds:g} ({length}); pass a larger --max-seconds "
                              "to keep it")
        blocks.append(block)
    return np.concatenate(blocks) if blocks else np.zeros((0, f.channels), np.float32)


def _why(exc: BaseException) -> str:
    """libsndfile's reason, less the path it repeats, and said plainly where its words mislead
    (garbage in a .mp3 is "File does not exist"; a truncated FLAC "lost sync" or "psf_fseek")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^Error opening .*?: ", "", text).removeprefix("Error : ").rstrip(".")
    if "does not exist" in text or "not recognised" in text.lower():
        return "not audio that libsndfile reads: format not recognised"
    if "lost sync" in text or "psf_fseek" in text:
        return f"damaged or truncated: {text}"
    return text[:200]


@contextlib.contextmanager
def quiet():
    """libsndfile's decoders (mpg123) print their notes on damaged files to the process's
    stderr, past Python: while they run, fd 2 goes to /dev/null, so a build's output stays
    its own (a skip says what went wrong)."""
    try:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def header_frames(path: str, sample_rate: int, max_seconds: float) -> int:
    """The frames a file will take at `sample_rate`, from its header without decoding, capped at
    max_seconds (a lying header costs nothing here); 0 when libsndfile cannot tell (the build
    skips it later)."""
    import soundfile as sf

    try:
        with quiet():
            info = sf.info(path)
        seconds = min(info.frames / info.samplerate, max_seconds) if info.samplerate > 0 else 0.0
    except Exception:  # noqa: BLE001 - a file libsndfile cannot open: skipped when decoded
        return 0
    return math.ceil(seconds * sample_rate)
