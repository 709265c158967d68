"""Real recorded audio, offline: pinned files out of two Debian packages and the pygame wheel.

The same scheme as `bench.data`: each archive is fetched once into `$MMPACK_CACHE/downloads`, its
named members kept under `$MMPACK_CACHE/data`, every file sha256-checked (a changed one fails
loudly). The .deb files come over plain HTTP from Debian's pool and are unpacked here in Python
(ar, then tar.xz or tar.gz), so no apt is needed. `make_audio_folders` turns them into RAW class
folders, `hostile_audio` writes files a packer must survive. Needs `soundfile` (and numpy).

What these files taught (libsndfile 1.2.2, soundfile 0.14): alsa-utils holds 8 voices and a noise
clip; 8 of the freedesktop .oga files are symlinks, and its spoken `audio-channel-*` clips are
the ALSA recordings again (a dedup or class-balance test should know). An MP3's header frame
count is an estimate (house_lo.mp3: 80,151 claimed, 80,064 decoded). A FLAC whose STREAMINFO
claims 2**36 frames makes `soundfile.read` allocate 128 GiB; a WAV that claims 2**31 is cut to
what it holds. Garbage named `.mp3` opens as "File does not exist", a truncated FLAC as "lost
sync" or "psf_fseek() failed", and mpg123 prints notes on damaged input to fd 2. pygame 2.6.1
has wheels up to Python 3.13. An MP3 read in blocks through `SoundFile.read` has ~2 MPEG frames of
zeros or garbage after a block's end (up to 0.3 of full scale; 20 of 20 `mp3_clips` at 4,096
frames a block): soundfile seeks after every read, and libsndfile's MP3 seek restarts mpg123
without its bit reservoir (`packer.builder.audio` reads MP3 without that seek).
"""

from __future__ import annotations

import hashlib
import io
import random
import tarfile
from dataclasses import dataclass
from pathlib import Path

from bench.data import Package, _sha256, cache_dir, fetch


@dataclass(frozen=True)
class Deb:
    url: str  # in Debian's pool, a pinned version
    sha256: str  # of the .deb
    prefix: str  # member prefix inside its data.tar
    files: dict[str, str]  # member name (after prefix) -> sha256


POOL = "http://deb.debian.org/debian/pool/main"
# speaker-test's voices: a man saying each channel's name; 48 kHz mono PCM_16, about 1.4 s each.
ALSA = Deb(f"{POOL}/a/alsa-utils/alsa-utils_1.2.8-1_amd64.deb",
           "fb24eb1a318228b974efbef726190dd90c6106a208814a3ee8f5d69b91ee0ba4", "./usr/share/sounds/alsa/", {
    "Front_Center.wav": "0d61518bcd3f13b0c709a5298e939caf698b80d31d71d50475365ee0e5536cc9",
    "Front_Left.wav": "9f97e8458785da2f0aa0ec60bf9cc81520cbf80a4683e83eca9cb5f2958e9fef",
    "Front_Right.wav": "1fdea4d7003f1f7d3e48d3521aaab0a112c4ac570b02ddf1813abacac3070f6f",
    "Rear_Center.wav": "9343207e3298813fdc4d26b7948e15a38533c37a9f232c3eff809b565398b330",
    "Rear_Left.wav": "1679e0557701864d55b742a0abd3fe5f50d95b1bfcb55ffad4b597dcc7e3c7b8",
    "Rear_Right.wav": "12828d125f692faa75c7445d52125dcc2c36f82c4f7a3ef49b8ae6afd74ada9d",
    "Side_Left.wav": "03dc7c641d7825417d2a261831715e945e95d87343fb037db910e7ce4f87a2a1",
    "Side_Right.wav": "ecdd0329945f355960796a56f8126d5080ed93fdd2437c7eaddbbbd56137d7e9",
    "Noise.wav": "0d897df3862192ea078efc1dd8fdc4f51fae9e93d3ed4c15e049829b0386729e",  # noise, not a voice
})
# The freedesktop sound theme, Ogg Vorbis: 16 of its 27 files (8 more are symlinks), every rate
# (8000, 22050, 44100, 48000, 96000) in mono and stereo. audio-channel-* are the voices above again.
FREEDESKTOP = Deb(f"{POOL}/s/sound-theme-freedesktop/sound-theme-freedesktop_0.8-2_all.deb",
                  "135cc4893ba590d428577bc3bf42df756a165c05a2a43f84311ad7db779a70ea",
                  "./usr/share/sounds/freedesktop/stereo/", {
    "audio-channel-front-center.oga": "986708048bb5ed244f2243150781a222a5c20c0e5954576a7c65ae5559c0b8cf",
    "audio-channel-front-left.oga": "87c2b9b97fd0e9ad86d80ee1af37c324b8496622ce480c14b3a28136eacba208",
    "audio-channel-front-right.oga": "952d828706e26a36c9a5996e4497f61b59b556d93899355c0e6eb52f46789c74",
    "audio-channel-rear-center.oga": "04b6245aef451c42b0ecffe3c899ae1c50eaf5de88ea06319e6b331aa7f420a2",
    "audio-channel-rear-left.oga": "09fe3c6db1c21c47c3f0dc3a40f689874edc0d50f05ba254f0d34da6af65705b",
    "audio-channel-rear-right.oga": "9c9872bc06d445cc47789f985dbf1ee9548e66121480a43ae2ba4d4b1f59ac1e",
    "audio-channel-side-left.oga": "de3c262206bdbb8f566cb1e440ad2b14fd44c313879832780cd7c19520b26569",
    "audio-channel-side-right.oga": "6c51a7d9478fa7f90f63c7caec51e6135ae306598bf10387f137c92d3d3830f1",
    "alarm-clock-elapsed.oga": "c28b4e0463eb3f19a3352049991c919cf8755e3f301f56a6276f5a81df472595",  # 48k st, 6.1 s
    "message-new-instant.oga": "500dbfffb6d6b7cac73cc0b230f077d60a8ce18c94e38e0cc664c3d678fa26f0",  # 48k stereo
    "camera-shutter.oga": "72dbfcb2e4f25f9ff4855358127d8268dcecf8f133ac01509502be4b1746933f",  # 96k stereo
    "bell.oga": "7bb1ae73f3db55d99ea1826f114ce161002ac71879ad4649d9e001bc4efb1bdc",  # 44.1k stereo
    "complete.oga": "f06d2f85aa1b4c66c2ce5c9cc98459b80a7850cc7454d369529001ca66978199",  # 44.1k stereo
    "suspend-error.oga": "855a7a3c05100710ccd955798c40c7362c196a16a260d50721c0cc5fdf3d4984",  # 44.1k mono
    "service-login.oga": "16dfca166af2c8e0729b32eeaf032b9056aa9c590adbb4a69cfacae915bbf1cc",  # 22.05k stereo
    "phone-outgoing-busy.oga": "56032f3fc6f1f0795f2fb2b93c835e9932b583d11c177c9b5ece43d0fe245ddc",  # 8k mono
})
# pygame's example sounds, all 11025 Hz mono (the members are the same in every pygame wheel).
PYGAME = Package("pygame==2.6.1", True, "pygame/examples/data/", {
    "house_lo.ogg": "eb8162435663abe70e8fa066c9afefdd98c45a605a199953975f6e74a6b3eac5",  # music, Vorbis
    "house_lo.mp3": "4749d9517ca6329fd72cf53c4b5cafb2255e593e8c28bb79463a7e5929d5acb4",  # the same, MP3
    "house_lo.wav": "0750707c568f22c4b169ab21fa281523f604f5241dd410974539d200ab0dba76",  # the same, PCM_U8
    "secosmic_lo.wav": "f842059338fb939a84a86d389fb9a7506529d52b32089e27d3c4f33d3eb4d036",  # music, MS_ADPCM
    "boom.wav": "91fa16b345550c61efd0949ae3a9d76411b2c3bd3e8e97cfabf077d6a340fc5f",  # PCM_U8 effects
    "whiff.wav": "14c58cdd79d8b5c7ba98715740260f8334fec6ef90e032726d97e93e31bc7291",
    "car_door.wav": "4f061656a99ee4da955480f53787acf76452284753624c5b371e9d35a98afbfe",
    "punch.wav": "034175c53f1a219e9a348ff931c32a2f281bd447e6748ccf8b8916914e04c107",
})


def fetch_deb(deb: Deb) -> Path:
    """The .deb's named files in a cache folder, downloading it once; every file sha256-checked."""
    name = deb.url.rsplit("/", 1)[1]
    dest = cache_dir() / "data" / name.removesuffix(".deb")
    if all(_sha256(dest / f) == h for f, h in deb.files.items()):
        return dest
    download = cache_dir() / "downloads" / name.removesuffix(".deb")
    archive = download / name
    if not archive.is_file():
        download.mkdir(parents=True, exist_ok=True)
        _download(deb.url, archive, deb.sha256)
    if _sha256(archive) != deb.sha256:
        raise RuntimeError(f"{archive}: does not match its pinned sha256 {deb.sha256} (drift?)")
    wanted = {deb.prefix + f: f for f in deb.files}
    dest.mkdir(parents=True, exist_ok=True)
    with _data_tar(archive) as t:
        for m in t.getmembers():
            if m.name in wanted and m.isfile():
                data = t.extractfile(m).read()
                if hashlib.sha256(data).hexdigest() != deb.files[wanted[m.name]]:
                    raise RuntimeError(f"{archive}: {wanted[m.name]} does not match its pinned sha256 (drift?)")
                (dest / wanted[m.name]).write_bytes(data)
    missing = [f for f in deb.files if not (dest / f).is_file()]
    if missing:
        raise RuntimeError(f"{archive}: lacks {', '.join(missing)}")
    return dest


def _download(url: str, path: Path, sha256: str) -> None:
    import urllib.request

    part = path.with_name(f".{path.name}.part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=120) as reply, open(part, "wb") as f:
        while chunk := reply.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != sha256:
        part.unlink()
        raise RuntimeError(f"{path.name} from {url}: sha256 {digest.hexdigest()} is not the pinned {sha256} (drift?)")
    part.rename(path)


def _data_tar(deb: Path) -> tarfile.TarFile:
    """The data.tar inside a .deb: an ar archive ("!<arch>\\n", then members behind 60-byte headers:
    name 16, mtime 12, uid 6, gid 6, mode 8, size 10, "`\\n"; data padded to an even length)."""
    blob = deb.read_bytes()
    if blob[:8] != b"!<arch>\n":
        raise RuntimeError(f"{deb}: not a .deb (no ar header)")
    at = 8
    while at + 60 <= len(blob):
        header = blob[at:at + 60]
        name, size = header[:16].decode("ascii").strip().rstrip("/"), int(header[48:58])
        if header[58:60] != b"`\n":
            raise RuntimeError(f"{deb}: damaged ar member header at byte {at}")
        if name.startswith("data.tar"):
            mode = {"data.tar": "r:", "data.tar.xz": "r:xz", "data.tar.gz": "r:gz"}.get(name)
            if mode is None:
                raise RuntimeError(f"{deb}: holds {name}; only data.tar.xz and data.tar.gz are read here")
            return tarfile.open(fileobj=io.BytesIO(blob[at + 60:at + 60 + size]), mode=mode)
        at += 60 + size + (size & 1)
    raise RuntimeError(f"{deb}: has no data.tar member")


def speech() -> list[Path]:
    """The eight ALSA voices ("Front Center", ...), sorted: 48 kHz mono PCM_16 WAV (Noise.wav left out)."""
    folder = fetch_deb(ALSA)
    return [folder / f for f in sorted(ALSA.files) if f != "Noise.wav"]


def effects() -> list[Path]:
    """16 freedesktop theme sounds, sorted: Ogg Vorbis, 8 to 96 kHz, mono and stereo; bells, alarms,
    a shutter, and the eight spoken channel names (audio-channel-*)."""
    folder = fetch_deb(FREEDESKTOP)
    return [folder / f for f in sorted(FREEDESKTOP.files)]


def music() -> list[Path]:
    """pygame's example sounds, sorted, 11025 Hz mono: house_lo music as Vorbis, MP3 and PCM_U8 WAV,
    secosmic_lo as MS ADPCM WAV, and four short PCM_U8 WAV effects (boom, whiff, car_door, punch)."""
    folder = fetch(PYGAME)
    return [folder / f for f in sorted(PYGAME.files)]


def transcript(path: Path) -> str | None:
    """What a spoken clip says, from its name ("Front_Center.wav", "audio-channel-front-left.oga");
    None for the rest."""
    if path.name in ALSA.files and path.name != "Noise.wav":
        return path.stem.replace("_", " ").lower()
    if path.name.startswith("audio-channel-"):
        return path.stem.removeprefix("audio-channel-").replace("-", " ")
    return None


def make_audio_folders(raw: Path, count: int, *, seed: int = 0, transcripts: bool = False) -> Path:
    """RAW/<class>/<n>.<ext>: `count` real clips in class folders "speech", "music", "effects" (the
    source), taken in turn, cycling through each class's files (shuffled by `seed`). About a third
    are re-encoded as FLAC (PCM_16); the rest are the original WAV/OGG/OGA/MP3 bytes; every clip
    keeps its own sample rate. `transcripts`: only spoken clips (the ALSA voices and freedesktop's
    audio-channel-*), all under "speech", each beside <n>.txt holding what it says."""
    import soundfile as sf

    rng = random.Random(seed)
    if transcripts:
        pools = {"speech": speech() + [p for p in effects() if transcript(p)]}
    else:
        pools = {"speech": speech(), "music": music(), "effects": effects()}
    for files in pools.values():
        rng.shuffle(files)
    classes = sorted(pools)
    for i in range(count):
        name = classes[i % len(classes)]
        files = pools[name]
        src = files[(i // len(classes)) % len(files)]
        stem = raw / name / f"{i:06d}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        if rng.random() < 1 / 3:
            data, rate = sf.read(src, dtype="int16", always_2d=True)
            sf.write(stem.with_suffix(".flac"), data, rate, format="FLAC", subtype="PCM_16")
        else:
            stem.with_suffix(src.suffix.lower()).write_bytes(src.read_bytes())
        if transcripts:
            stem.with_suffix(".txt").write_text(transcript(src) + "\n", encoding="utf-8")
    return raw


def mp3_clips(folder: Path, count: int, *, seed: int = 0) -> list[Path]:
    """`count` MP3s written by soundfile (LAME) into `folder`, as Common Voice holds its clips: the
    ALSA voices, shuffled by `seed`, one after another until each clip is longer than two blocks of
    the packer's decode (2.2 x 73,728 frames at its own rate); at 48 kHz (MPEG-1) and, every third,
    24 kHz (MPEG-2, resampled by soxr); every fourth stereo, a second voice sequence on the right;
    every second at LAME's VBR level 0.9 (about 40 kbps), the others at soundfile's default (80)."""
    import numpy as np
    import soundfile as sf
    import soxr

    rng = random.Random(seed)
    voices = [sf.read(p, dtype="float32")[0] for p in speech()]  # 48 kHz mono
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        rate = 24000 if i % 3 == 2 else 48000
        tracks = []
        for _ in range(2 if i % 4 == 3 else 1):
            parts, frames = [], 0
            while frames < 2.2 * 73_728:
                voice = rng.choice(voices)
                parts.append(voice if rate == 48000 else soxr.resample(voice, 48000, rate, quality="HQ"))
                frames += len(parts[-1])
            tracks.append(np.concatenate(parts))
        frames = min(len(t) for t in tracks)
        path = folder / f"cv_{i:03d}.mp3"
        level = {"compression_level": 0.9} if i % 2 else {}
        sf.write(path, np.stack([t[:frames] for t in tracks], axis=1), rate, format="MP3", **level)
        paths.append(path)
    return paths


def long_clip(path: Path, seconds: float) -> Path:
    """A FLAC (PCM_16, 48 kHz mono) of `seconds` of real speech: the ALSA voices in turn, repeated."""
    import numpy as np
    import soundfile as sf

    voices = np.concatenate([sf.read(p, dtype="int16")[0] for p in speech()])
    frames = round(seconds * 48000)
    sf.write(path, np.resize(voices, frames), 48000, format="FLAC", subtype="PCM_16")
    return path


def hostile_audio(folder: Path) -> dict[str, str]:
    """Writes hostile audio files into `folder`, made from real clips; {file name: what it is}."""
    import numpy as np
    import soundfile as sf

    folder.mkdir(parents=True, exist_ok=True)
    voice, rate = sf.read(speech()[1], dtype="int16")  # Front_Left, mono
    out = io.BytesIO()
    sf.write(out, voice[:4800], rate, format="WAV", subtype="PCM_16")
    wav = bytearray(out.getvalue())
    at = 12  # RIFF size, "WAVE", then chunks: find "data" and patch both sizes
    while wav[at:at + 4] != b"data":
        at += 8 + int.from_bytes(wav[at + 4:at + 8], "little")
    wav[4:8] = wav[at + 4:at + 8] = (0xFFFFFFF0).to_bytes(4, "little")
    (folder / "claims_2g_frames.wav").write_bytes(bytes(wav))
    out = io.BytesIO()
    sf.write(out, voice, rate, format="FLAC", subtype="PCM_16")
    flac = out.getvalue()
    (folder / "truncated.flac").write_bytes(flac[:len(flac) * 2 // 5])
    header = b"ID3\x03\x00\x00\x00\x00\x00\x00"
    (folder / "garbage.mp3").write_bytes(header + random.Random(0).randbytes(20_480 - len(header)))
    sf.write(folder / "one_frame.wav", voice[len(voice) // 2:len(voice) // 2 + 1], rate, subtype="PCM_16")
    sf.write(folder / "eight_channels.wav", np.tile(voice[:, None], (1, 8)), rate, subtype="PCM_16")
    sf.write(folder / "empty.wav", np.zeros((0, 1), np.int16), rate, subtype="PCM_16")
    (folder / "not_audio.ogg").write_text("This is a text file, not Ogg audio.\n" * 40, encoding="utf-8")
    return {
        "claims_2g_frames.wav": "a real 0.1 s PCM_16 WAV (4800 frames) whose RIFF and data sizes claim 0xFFFFFFF0 "
                                "bytes (2**31 - 8 frames)",
        "truncated.flac": "a real 1.5 s voice clip as FLAC, cut to its first 40% of bytes",
        "garbage.mp3": "20 KiB of random bytes behind an empty ID3v2.3 header",
        "one_frame.wav": "one frame of PCM_16, 48 kHz mono",
        "eight_channels.wav": "a real 1.5 s voice clip copied into 8 channels, PCM_16",
        "empty.wav": "a valid PCM_16 WAV header with 0 frames",
        "not_audio.ogg": "a text file named .ogg",
    }
