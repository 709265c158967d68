"""Audio clips as an audio build packs them (FORMAT.md section 4, "Audio samples"): decoded by
libsndfile (`soundfile`), mixed to the channels asked, resampled by soxr (its HQ mode) where the
file's rate differs, and stored as int16 PCM or float32 in [-1, 1); and the scan of a folder of
audio files, with class folders, sidecar transcripts (`<stem>.txt`) or a transcript table
(LJSpeech's `metadata.csv`, Common Voice's TSV: `packer.builder.transcripts`).

A file goes through in blocks of BLOCK_FRAMES: each block decoded, mixed, resampled (one soxr
stream, whose output equals `soxr.resample` of the whole clip bit for bit) and converted into
the stored clip, so a worker holds the stored clip and a block, never the decoded float32 source
and its copies. A file is given up once it passes --max-seconds: a header that claims 2**31
frames costs what the file holds, never what it claims. `soundfile` and `soxr` come with the
`audio` extra; reading a packed audio dataset needs neither.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from packer import internals
from packer.errors import ConfigError, SourceError

EXTS = frozenset({".wav", ".flac", ".ogg", ".oga", ".mp3", ".opus", ".aiff", ".aif"})
MPEG = frozenset({"MPEG_LAYER_I", "MPEG_LAYER_II", "MPEG_LAYER_III"})  # libsndfile's MP3 subtypes
# frames decoded, mixed, resampled and stored at a time: 288 KB of float32 mono, 576 KB stereo.
# Any size gives the same bytes (FLAC, Vorbis, Opus, WAV, ADPCM, ALAC and MP3 read in blocks of 7
# to 73,728 frames equal a whole read; soxr's stream equals its one-shot resample)
BLOCK_FRAMES = 1152 * 64
DEFAULT_MAX_SECONDS = 600.0  # 10 min: 19 MB of int16 mono at 16 kHz, the clip a worker holds
DTYPES = {"int16": "<i2", "float32": "<f4"}
INT16_SCALE = 32768.0  # libsndfile's: float = int16 / 32768
FLOAT_TOP = np.float32(1 - 2**-24)  # the largest float32 below 1: a float32 clip lies in [-1, 1)
INSTALL = 'pip install "mmpack[audio]" (soundfile and soxr)'

_clipped = 0  # values of this process's packed clips not stored as decoded: `clipped()`


def clipped() -> int:
    """Values (samples x channels) of the clips decoded in this process so far that were NaN or
    infinite in the file, or past the stored range after mixing and resampling; read before and
    after a shard for its count (`build.audio_clipped`)."""
    return _clipped


def require() -> None:
    """ConfigError naming the install command when the audio extra is missing, or when soundfile
    lacks the binding of libsndfile that MP3s are read through (`_mpeg_reader`)."""
    try:
        import soundfile
        import soxr  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"an audio build needs {exc.name}: {INSTALL}") from None
    if not internals.sndfile_reads_blocks():
        raise ConfigError(f"soundfile {getattr(soundfile, '__version__', '?')} lacks the libsndfile binding an audio "
                          "build reads MP3 through (soundfile._snd, as 0.12 to 0.14 have it): install one that has it")


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

    global _clipped
    try:
        with quiet(), sf.SoundFile(source) as f:
            rate, claimed, subtype = f.samplerate, f.frames, f.subtype
            _check_whole(f, source)
            _check_channels(f.channels, spec.channels)
            clip = Clip(spec, _out_frames(min(claimed, math.ceil(spec.max_seconds * rate) + 1), rate, spec.sample_rate))
            frames = convert(_blocks(f, rate, spec.max_seconds), rate, spec, clip)
    except (sf.LibsndfileError, RuntimeError, ValueError, TypeError, OSError) as exc:
        raise SourceError(f"unreadable audio ({_why(exc)})") from None
    if frames == 0:
        raise SourceError("no audio (0 frames)")
    if subtype not in MPEG and 0 < claimed and frames < claimed:
        raise SourceError(f"truncated: its header says {claimed:,} frames, the file holds {frames:,}")
    if clip.frames == 0:
        raise SourceError(f"no audio at {spec.sample_rate:,} Hz: its {frames} frame(s) at {rate:,} Hz resample to none")
    _clipped += clip.clipped
    return clip.array()


def convert(blocks: Iterator[np.ndarray], rate: int, spec: AudioSpec, clip: Clip) -> int:
    """Decoded float32 blocks [n, C] at `rate`, in order, into `clip` as the spec stores them: NaN
    as 0 and +-Inf as +-1 (one would spread over the clip in the resampler); the mean of the
    channels for mono (a mono file copied to both for stereo); resampled by one soxr HQ stream;
    then int16 as clip(round(x * 32768)), or float32 clipped to [-1, 1). Returns the frames read."""
    stream = None
    if rate != spec.sample_rate:
        import soxr

        stream = soxr.ResampleStream(rate, spec.sample_rate, spec.channels, dtype="float32", quality="HQ")
    frames = 0
    for block in blocks:
        frames += len(block)
        clip.clipped += _finite(block)
        if block.shape[1] != spec.channels:
            block = block.mean(axis=1, keepdims=True, dtype=np.float32) if spec.channels == 1 else np.repeat(block, 2, axis=1)
        clip.add(stream.resample_chunk(np.ascontiguousarray(block)) if stream else block)
    if stream is not None:  # the resampler's tail: what it holds back for the samples after
        clip.add(stream.resample_chunk(np.zeros((0, spec.channels), np.float32), last=True))
    return frames


def _finite(block: np.ndarray) -> int:
    """NaN as 0 and +-Inf as +-1, in place (a float file can hold them); how many there were."""
    bad = block.size - int(np.count_nonzero(np.isfinite(block)))
    if bad:
        np.nan_to_num(block, copy=False, nan=0.0, posinf=1.0, neginf=-1.0)
    return bad


class Clip:
    """A clip as it is stored, filled a block at a time: one array sized from the file's header
    (its pages resident only as they are written, so a lying header costs nothing), grown
    where the file holds more (an MP3's header length is an estimate)."""

    def __init__(self, spec: AudioSpec, frames: int):
        self.dtype, self.frames, self.clipped = spec.dtype, 0, 0
        self.data = np.empty((max(frames, 1), spec.channels), spec.dtype)

    def add(self, x: np.ndarray) -> None:
        """float32 frames [n, C] at the dataset's rate, converted (`convert`) onto the end."""
        end = self.frames + len(x)
        if end > len(self.data):
            grown = np.empty((max(end, 2 * len(self.data)), self.data.shape[1]), self.dtype)
            grown[:self.frames] = self.data[:self.frames]
            self.data = grown
        out = self.data[self.frames:end]
        if self.dtype == "<i2":
            x = np.rint(x * INT16_SCALE)
            self.clipped += int(np.count_nonzero(x < -32768) + np.count_nonzero(x > 32767))
            np.clip(x, -32768, 32767, out=x)
            out[:] = x
        else:
            self.clipped += int(np.count_nonzero(x < -1) + np.count_nonzero(x > FLOAT_TOP))
            np.clip(x, -1, FLOAT_TOP, out=out)
        self.frames = end

    def array(self) -> np.ndarray:
        """[T] for mono, [T, C] otherwise (a view: the pages past T were never written)."""
        data = self.data[:self.frames]
        return data.reshape(-1) if data.shape[1] == 1 else data


def _out_frames(frames: int, rate: int, sample_rate: int) -> int:
    """The frames `frames` at `rate` come to at `sample_rate`, and one (soxr rounds)."""
    return -(-frames * sample_rate // rate) + 1


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


def _blocks(f, rate: int, max_seconds: float) -> Iterator[np.ndarray]:
    """Every frame of an open file as float32 blocks [n, C], and never more than max_seconds of
    them (SourceError past that)."""
    limit = math.ceil(max_seconds * rate)
    read = _mpeg_reader(f) if f.subtype in MPEG else lambda: f.read(BLOCK_FRAMES, dtype="float32", always_2d=True)
    frames = 0
    while len(block := read()):
        frames += len(block)
        if frames > limit:
            length = f"{f.frames / rate:,.2f} s by its header" if f.frames > limit else f"over {max_seconds:g} s"
            raise SourceError(f"longer than --max-seconds {max_seconds:g} ({length}); pass a larger --max-seconds "
                              "to keep it")
        yield block


def _mpeg_reader(f) -> Callable[[], np.ndarray]:
    """The next block of an MP3, read by libsndfile's own sf_readf_float on soundfile's handle.
    `SoundFile.read` seeks after every read (to keep its position), and libsndfile's MP3 seek
    restarts mpg123 without its bit reservoir: about two MPEG frames of zeros or garbage after
    every block (up to 14,449 int16 steps: 6 of the 20 `bench.sounds.mp3_clips` at 73,728 frames
    a block). Read without it, after one seek to frame 0 as `soundfile.read`
    does (mpg123's state after it: at 8-24 kHz the floats differ in their last bits without),
    the blocks equal `soundfile.read`'s whole decode bit for bit at any block size."""
    f.seek(0)

    def read() -> np.ndarray:  # soundfile's own binding of libsndfile (packer.internals; checked by `require`)
        block = np.empty((BLOCK_FRAMES, f.channels), np.float32)
        return block[:internals.sndfile_read_block(f, block)]

    return read


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
