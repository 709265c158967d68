"""Golden datasets of every format version (tests/data/golden, written by the mmpack release of
each version from the same tiny RAW): this reader opens and verifies each and reads the same
samples from all; the current writer reproduces the newest byte for byte."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from loaders import Loader, MMapDataset, PackedDocuments, TokenWindows
from packer.cli import main
from packer.dataset.reader import load_manifest

from ..trees import tree

GOLDEN = Path(__file__).parents[1] / "data" / "golden"
VERSIONS = ("1.0", "2.0", "3.0", "4.0")
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())
BUILD_ARGS = {"images": ["--image-size", "8", "--shard-size", "4"],
              "text": ["--tokenizer", str(GOLDEN / "tokenizer.json"), "--append-eos", "--shard-size", "2"]}


@pytest.mark.parametrize("kind", ["images", "text"])
@pytest.mark.parametrize("version", VERSIONS)
def test_every_version_opens_verifies_and_reads_the_same_samples(version, kind, capsys):
    root = GOLDEN / f"v{version}-{kind}"
    assert load_manifest(root).version == version
    ds = MMapDataset(root)
    want = EXPECTED[kind]
    assert ds.classes == want["classes"] and len(ds) == len(want["samples"])
    for i, expected in enumerate(want["samples"]):
        sample = ds[i]
        assert sample["key"] == expected["key"]
        if kind == "images":
            assert sample["label"].item() == expected["label"]
            assert hashlib.sha256(sample["image"].numpy().tobytes()).hexdigest() == expected["image_sha256"]
        else:
            assert sample["tokens"].tolist() == expected["tokens"]
    assert main(["verify", str(root)]) == 0 and "ok:" in capsys.readouterr().out
    assert main(["info", str(root)]) == 0 and f"mmpack {version}" in capsys.readouterr().out
    seen = [k for batch in Loader(ds, 4, shuffle=False, columns=["key"]) for k in batch["key"]]
    assert seen == [s["key"] for s in want["samples"]]
    if kind == "text":
        tokens = sum(len(s["tokens"]) for s in want["samples"])
        assert sum(b["lengths"].sum().item() for b in Loader(PackedDocuments(root, 8), 2)) == tokens
        assert len(TokenWindows(root, 4)) == (tokens - 5) // 4 + 1


@pytest.mark.parametrize("kind", ["images", "text"])
def test_the_current_writer_reproduces_the_newest_golden_byte_for_byte(tmp_path, kind):
    raw = tmp_path / "raw"
    shutil.copytree(GOLDEN / f"raw-{kind}", raw)
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), "-q", "--workers", "1", *BUILD_ARGS[kind]]) == 0
    mine, golden = tree(out), tree(GOLDEN / f"v{VERSIONS[-1]}-{kind}")
    for t in (mine, golden):
        t["files"].pop("inputs.jsonl")  # the RAW files' mtimes: this checkout's
        t["manifest"]["tokenizer"] = t["manifest"]["tokenizer"] and {
            k: v for k, v in t["manifest"]["tokenizer"].items() if k != "path"}
    assert mine == golden


@pytest.mark.parametrize("kind", ["images", "text"])
def test_column_bytes_never_changed_across_versions(kind):
    files = {}
    for version in VERSIONS:
        root = GOLDEN / f"v{version}-{kind}"
        m = load_manifest(root)
        files[version] = {"/".join(f.path.split("/")[-2:]): (root / f.path).read_bytes()
                          for s in m.shards for f in s.files}
    assert all(files[v] == files[VERSIONS[0]] for v in VERSIONS)


def test_the_chat_golden_opens_verifies_and_is_reproduced_byte_for_byte(tmp_path, capsys):
    """4.3's conversations (tests/data/golden/v4.3-chat, written by mmpack 0.7 from raw-chat with
    chat-tokenizer.json and chatml.jinja): read as recorded, and written again the same."""
    root = GOLDEN / "v4.3-chat"
    ds = MMapDataset(root)
    assert ds.manifest.version == "4.3" and ds.manifest.kind == "chat"
    assert [{"key": s["key"], "tokens": s["tokens"].tolist(), "loss_mask": s["loss_mask"].tolist()}
            for s in (ds[i] for i in range(len(ds)))] == EXPECTED["chat"]["samples"]
    assert main(["verify", str(root)]) == 0 and "ok:" in capsys.readouterr().out
    raw = tmp_path / "raw"
    shutil.copytree(GOLDEN / "raw-chat", raw)
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), "-q", "--workers", "1", "--tokenizer", str(GOLDEN / "chat-tokenizer.json"),
                 "--chat-template", str(GOLDEN / "chatml.jinja"), "--shard-size", "2"]) == 0
    mine, golden = tree(out), tree(root)
    for t in (mine, golden):
        t["files"].pop("inputs.jsonl")
        t["manifest"]["tokenizer"] = {k: v for k, v in t["manifest"]["tokenizer"].items() if k != "path"}
    assert mine == golden


def test_the_chat_image_list_golden_opens_verifies_and_is_reproduced_byte_for_byte(tmp_path, capsys):
    """4.3's conversations with images at their own sizes (an image list, "pixels-list"):
    tests/data/golden/v4.3-chat-images, written by mmpack 0.7 from raw-chat-images (LLaVA's JSON:
    one image, two, none) at --image-size 8 --keep-aspect. Read as recorded, and written again
    the same."""
    import hashlib

    root = GOLDEN / "v4.3-chat-images"
    ds = MMapDataset(root)
    assert ds.manifest.version == "4.3" and ds.manifest.column("images").encoding == "pixels-list"
    got = [{"key": s["key"], "tokens": s["tokens"].tolist(), "loss_mask": s["loss_mask"].tolist(),
            "image_positions": s["image_positions"].tolist(), "images_size": s["images_size"].tolist(),
            "images_sha256": hashlib.sha256(s["images"].numpy().tobytes()).hexdigest()}
           for s in (ds[i] for i in range(len(ds)))]
    assert got == EXPECTED["chat-images"]["samples"]
    assert main(["verify", str(root)]) == 0 and "ok:" in capsys.readouterr().out
    raw = tmp_path / "raw"
    shutil.copytree(GOLDEN / "raw-chat-images", raw)
    out = tmp_path / "out"
    assert main(["build", str(raw), str(out), "-q", "--workers", "1", "--tokenizer", str(GOLDEN / "chat-tokenizer.json"),
                 "--chat-template", str(GOLDEN / "chatml.jinja"), "--image-size", "8", "--keep-aspect",
                 "--shard-size", "2"]) == 0
    mine, golden = tree(out), tree(root)
    for t in (mine, golden):
        t["files"].pop("inputs.jsonl")
        t["manifest"]["tokenizer"] = {k: v for k, v in t["manifest"]["tokenizer"].items() if k != "path"}
    assert mine == golden
