"""Conversations built through the CLI as users have them: Minimind's chat JSONL, a Hugging Face
Parquet table of messages, LLaVA's JSON list with images, Minimind's DPO pairs. Tokens equal
transformers' `apply_chat_template`, masks its assistant mask where the template has generation
blocks, every image at its placeholder; packed rows lose no token, label exactly the masked
tokens and never let attention cross two conversations; hostile records are skips; found =
packed + skipped; a JSON list streams in bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from bench import dialogue
from loaders import Loader, MMapDataset, PackedDocuments
from packer.builder.chat.conversation import conversation
from packer.builder.images import decode_image
from packer.cli import main

from .test_chat_template import _hf, models  # noqa: F401 - models: a fixture

transformers = pytest.importorskip("transformers")


def _build(raw, out, model, *more):
    assert main(["build", str(raw), str(out), "--tokenizer", str(model / "tokenizer.json"), "--chat-template",
                 str(model / "tokenizer_config.json"), "-q", *map(str, more)]) == 0
    ds = MMapDataset(out)
    c = ds.manifest.counts
    assert c["found"] == c["packed"] + c["skipped"]
    return ds


def _messages(line: str) -> list[dict]:
    return conversation(json.loads(line)).messages


@pytest.mark.parametrize("name", ["minimind", "qwen2.5-generation"])
def test_minimind_jsonl_tokens_and_masks_equal_transformers(models, tmp_path, name):  # noqa: F811
    raw = tmp_path / "raw"
    dialogue.write_minimind(raw / "sft.jsonl", 60, seed=5)
    ds = _build(raw, tmp_path / "out", models[name], "--workers", "2", "--shard-size", "8KB")
    assert len(ds.manifest.shards) > 1 and ds.manifest.kind == "chat" and ds.manifest.version == "4.3"
    hf = _hf(models[name])
    lines = (raw / "sft.jsonl").read_text().splitlines()
    blocks = ds.manifest.build["chat_template"]["generation_blocks"]
    assert blocks == (name == "qwen2.5-generation")
    for i in range(len(ds)):
        sample = ds[i]
        n = int(sample["key"].rsplit(":", 1)[1])
        want = hf.apply_chat_template(_messages(lines[n - 1]), tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=blocks)
        assert sample["tokens"].tolist() == want["input_ids"]
        assert len(sample["loss_mask"]) == len(sample["tokens"])
        if blocks:
            assert sample["loss_mask"].tolist() == want["assistant_masks"]
        said = hf.decode(sample["tokens"][sample["loss_mask"].bool()].tolist())  # what the loss is taken on
        messages = _messages(lines[n - 1])
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        for m in messages:
            if m["role"] == "assistant":
                assert m["content"] in said
            elif not any(m["content"] in a for a in answers):
                assert m["content"] not in said


def test_a_parquet_table_of_messages_builds_as_its_jsonl(models, tmp_path):  # noqa: F811
    import datasets

    datasets.disable_progress_bars()
    raw = tmp_path / "jsonl"
    dialogue.write_minimind(raw / "train.jsonl", 30, seed=6)
    rows = [json.loads(x)["conversations"] for x in (raw / "train.jsonl").read_text().splitlines()]
    pq = tmp_path / "parquet" / "data"
    pq.mkdir(parents=True)
    datasets.Dataset.from_dict({"messages": rows}).to_parquet(str(pq / "train-00000-of-00001.parquet"))
    a, b = _build(raw, tmp_path / "a", models["minimind"]), _build(tmp_path / "parquet", tmp_path / "b",
                                                                  models["minimind"])
    assert [a[i]["tokens"].tolist() for i in range(len(a))] == [b[i]["tokens"].tolist() for i in range(len(b))]
    assert [a[i]["loss_mask"].tolist() for i in range(len(a))] == [b[i]["loss_mask"].tolist() for i in range(len(b))]


@pytest.fixture(scope="module")
def llava(models, tmp_path_factory):  # noqa: F811
    """LLaVA's layout, plus hostile records: a missing image, more placeholders than images, a
    path out of RAW, an unknown role; and an image no record names."""
    raw = dialogue.write_llava(tmp_path_factory.mktemp("llava") / "raw", 24, seed=7)
    records = json.loads((raw / "data.json").read_text())
    records += [{"id": "x1", "image": "images/missing.jpg", "conversations": records[0]["conversations"]},
                {"id": "x2", "image": records[1]["image"],
                 "conversations": [{"from": "human", "value": "<image> <image> two?"}, {"from": "gpt", "value": "no"}]},
                {"id": "x3", "image": "../outside.jpg", "conversations": records[0]["conversations"]},
                {"id": "x4", "image": records[2]["image"],
                 "conversations": [{"from": "narrator", "value": "once"}, {"from": "gpt", "value": "upon"}]}]
    (raw / "data.json").write_text(json.dumps(records, indent=1))
    (raw / "images" / "unnamed.jpg").write_bytes((raw / records[0]["image"]).read_bytes())
    (raw.parent / "outside.jpg").write_bytes((raw / records[0]["image"]).read_bytes())  # a real file, out of RAW
    out = tmp_path_factory.mktemp("llava-out") / "out"
    _build(raw, out, models["minimind"], "--image-size", "32", "--shard-size", "16KB")
    return raw, out


def test_llava_json_keeps_every_image_at_its_placeholder(llava, models):  # noqa: F811
    raw, out = llava
    ds = MMapDataset(out)
    records = json.loads((raw / "data.json").read_text())
    image_id = _hf(models["minimind"]).convert_tokens_to_ids("<image>")
    assert len(ds) == 24
    for i in range(len(ds)):
        s = ds[i]
        record = records[int(s["key"].rsplit(":", 1)[1])]
        assert s["images"].shape == (1, 32, 32, 3)
        assert np.array_equal(s["images"][0].numpy(), decode_image(raw / record["image"], 32))
        assert s["tokens"][s["image_positions"]].tolist() == [image_id]
    skipped = {s.key: s.reason for s in ds.manifest.skipped}
    assert "no such file" in skipped["data.json:24"] and "2 <image> placeholder(s) for 1 image" in skipped["data.json:25"]
    assert "outside RAW" in skipped["data.json:26"] and "unknown role 'narrator'" in skipped["data.json:27"]
    assert skipped["images/unnamed.jpg"] == "an image no conversation names"


def test_packed_conversations_label_the_masked_tokens_and_keep_images_in_their_rows(llava, models):  # noqa: F811
    raw, out = llava
    ds = MMapDataset(out)
    packed = PackedDocuments(out, 256, image_tokens=8)
    total = sum(len(ds[i]["tokens"]) for i in range(len(ds)))
    seen = real = 0
    for batch in Loader(packed, 3, order="sequential"):
        t, labels, cu = batch["tokens"], batch["labels"], batch["cu_seqlens"].tolist()
        flat_t, flat_l = t.reshape(-1), labels.reshape(-1)
        real += int(batch["lengths"].sum())
        seen += int((flat_l != -100).sum())
        for r in range(len(t)):  # padding: -100; a row with its images' 7 more tokens each fits
            n = int(batch["lengths"][r])
            assert (labels[r, n:] == -100).all()
            assert n + 7 * int((batch["image_rows"] == r).sum()) <= 256
        for a, b in zip(cu, cu[1:]):  # a segment is one conversation, or the padding
            segment = flat_t[a:b]
            assert (segment == 1).sum() <= 0 or segment[0] == 1 or (flat_l[a:b] == -100).all()
        assert (t[batch["image_rows"], batch["image_positions"]] == t[batch["image_rows"],
                                                                     batch["image_positions"]][0]).all()
    assert real + packed.num_truncated_tokens == total
    assert seen == sum(int(ds[i]["loss_mask"].sum()) for i in range(len(ds)) if ds[i]["tokens"].numel() + 7 <= 256)


def test_dpo_pairs_build_and_batch_together(models, tmp_path):  # noqa: F811
    raw = tmp_path / "raw"
    dialogue.write_pairs(raw / "dpo.jsonl", 20, seed=8)
    ds = _build(raw, tmp_path / "out", models["minimind"])
    assert list(ds.columns) == ["chosen_tokens", "chosen_loss_mask", "rejected_tokens", "rejected_loss_mask", "key"]
    hf = _hf(models["minimind"])
    lines = (raw / "dpo.jsonl").read_text().splitlines()
    for i in range(len(ds)):
        record = json.loads(lines[int(ds[i]["key"].rsplit(":", 1)[1]) - 1])
        for side in ("chosen", "rejected"):
            assert ds[i][f"{side}_tokens"].tolist() == hf.apply_chat_template(record[side], tokenize=True,
                                                                               return_dict=True)["input_ids"]
            said = hf.decode(ds[i][f"{side}_tokens"][ds[i][f"{side}_loss_mask"].bool()].tolist())
            assert record[side][-1]["content"] in said and record[side][0]["content"] not in said
    batch = next(iter(Loader(ds, 4)))
    assert batch["chosen_tokens"].shape[0] == batch["rejected_tokens"].shape[0] == 4


def test_a_json_list_of_conversations_streams_in_bounded_memory(tmp_path):
    """Planning a chat JSON list and reading its records, as a build does: a list 16 times longer
    costs about the same memory (the whole list parsed at once would cost it many times over)."""
    code = """
import json, resource, sys
from pathlib import Path
from packer.builder.chat.read import records
from packer.builder.plan import plan
from packer.builder.records import Record, Scan
path = Path(sys.argv[1])
convs = [[{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y" * 300}]] * int(sys.argv[2])
with open(path, "w") as f:
    f.write("[")
    for i, c in enumerate(convs):
        f.write(("," if i else "") + json.dumps({"conversations": c}))
    f.write("]")
del convs
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
found = Scan("chat", (Record("c.json", str(path)),), (), fields={"messages": "conversations", "image": None})
tasks = plan(found, image_size=None, token_itemsize=2, shard_rows=None, shard_bytes=4 << 20,
             text_key="conversations").tasks
n = sum(1 for t in tasks for s in t.spans for _ in records(found.records[0], s, 1 << 20))
print(n, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
"""
    grown = {}
    for count in (4_000, 64_000):
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"{count}.json"), str(count)],
                             capture_output=True, text=True, check=True).stdout.split()
        assert int(out[0]) == count
        grown[count] = int(out[1])  # KiB
    size = (tmp_path / "64000.json").stat().st_size
    assert size > 38e6 and grown[64_000] * 1024 < size / 8, (grown, size)


@pytest.mark.parametrize("column, value, words", [("loss_mask", 2, "a loss mask byte other than 0 or 1"),
                                                  ("image_positions", 10 ** 6, "outside its conversation's tokens")])
def test_verify_finds_a_mask_or_an_image_place_a_writer_got_wrong(llava, tmp_path, capsys, column, value, words):
    import shutil

    from ..loaders.test_jpeg_lane import _published

    out = tmp_path / "out"
    shutil.copytree(llava[1], out)
    path = next(out.glob(f"g-*/shard-00000/{column}.npy"))
    values = np.load(path, mmap_mode="r+")
    values[0] = value
    values.flush()
    _published(out, path)  # as a writer that wrote those bytes would have published them
    assert main(["verify", str(out)]) == 1 and words in capsys.readouterr().err


def test_a_parquet_table_of_conversations_with_image_bytes_keeps_each_at_its_placeholder(llava, models, tmp_path):  # noqa: F811
    """Hugging Face's VLM sets store each row's images in the row (a list of the Image feature):
    each decoded as the LLaVA layout's files are, in its conversation's order."""
    import io

    import datasets
    from datasets import Image, Sequence

    datasets.disable_progress_bars()
    raw = llava[0]
    records = json.loads((raw / "data.json").read_text())[:6]
    rows = {"messages": [[{"role": "user" if t["from"] == "human" else "assistant",
                           "content": t["value"] if "<image>" in t["value"] or k else "<image>\n" + t["value"]}
                          for k, t in enumerate(r["conversations"])] for r in records],
            "images": [[{"bytes": (raw / r["image"]).read_bytes(), "path": None}] for r in records]}
    folder = tmp_path / "hf" / "data"
    folder.mkdir(parents=True)
    datasets.Dataset.from_dict(rows).cast_column("images", Sequence(Image())).to_parquet(
        str(folder / "train-00000-of-00001.parquet"))
    ds = _build(tmp_path / "hf", tmp_path / "out", models["minimind"], "--image-size", "32")
    image_id = _hf(models["minimind"]).convert_tokens_to_ids("<image>")
    assert len(ds) == 6
    for i in range(6):
        s = ds[i]
        want = decode_image(io.BytesIO((raw / records[int(s["key"].rsplit(":", 1)[1])]["image"]).read_bytes()), 32)
        assert np.array_equal(s["images"][0].numpy(), want)
        assert s["tokens"][s["image_positions"]].tolist() == [image_id]


@pytest.mark.parametrize("layout, flags", [("pixels-list", ("--image-size", "24", "--keep-aspect", "--max-side", "40")),
                                           ("pixels-list", ("--image-size", "keep")),
                                           ("jpeg-list", ("--image-size", "24", "--keep-aspect", "--store", "jpeg"))])
def test_conversation_images_of_their_own_sizes_keep_each_at_its_placeholder(models, tmp_path, layout, flags):  # noqa: F811
    """--keep-aspect, --image-size keep and --store jpeg: each conversation's images at their own
    sizes (an image list: their pixels or JPEG files one after another, each's shape and bytes
    beside them). ds[i] gives them as a canvas with images_size, each equal to an image build's
    decode (the JPEG lane's: Pillow's decode of its stored bytes, close to those pixels); packed
    rows carry them at their placeholders, each counted as image_tokens(h, w) tokens."""
    from PIL import Image as PILImage

    from packer.dataset import codec

    raw = dialogue.write_llava(tmp_path / "raw", 10, seed=3)
    records = json.loads((raw / "data.json").read_text())
    two = {"id": "two", "image": [records[0]["image"], records[1]["image"]],
           "conversations": [{"from": "human", "value": "<image> and <image>: alike?"}, {"from": "gpt", "value": "no"}]}
    (raw / "data.json").write_text(json.dumps(records + [two]))
    records.append(two)
    ds = _build(raw, tmp_path / "out", models["minimind"], *flags)
    assert ds.manifest.column("images").encoding == layout and len(ds) == 11
    size = None if "keep" in flags else 24
    image_id = _hf(models["minimind"]).convert_tokens_to_ids("<image>")
    sizes_seen = set()
    for i in range(len(ds)):
        s = ds[i]
        record = records[int(s["key"].rsplit(":", 1)[1])]
        names = record["image"] if isinstance(record["image"], list) else [record["image"]]
        assert s["images"].shape[0] == len(names) == len(s["image_positions"]) and s["images_size"].shape == (len(names), 2)
        for k, name in enumerate(names):
            want = decode_image(raw / name, size, max_side=(40 if "--max-side" in flags else 48) if size else None)
            h, w = s["images_size"][k].tolist()
            assert (h, w) == want.shape[:2] and (s["images"][k, h:] == 0).all() and (s["images"][k, :, w:] == 0).all()
            got = s["images"][k, :h, :w].numpy()
            if layout == "pixels-list":
                assert np.array_equal(got, want)
            else:  # the stored JPEG's pixels, near the image build's
                assert np.mean(np.abs(got.astype(int) - want)) < 6
            sizes_seen.add((h, w))
        assert s["tokens"][s["image_positions"]].tolist() == [image_id] * len(names)
    assert len(sizes_seen) > 2  # the sample photos' own aspects, not one size
    calls = []

    def tokens_of(h: int, w: int) -> int:
        calls.append((h, w))
        return 1 + (h * w) // 64

    packed = PackedDocuments(ds.root, 512, image_tokens=tokens_of)
    assert set(calls) == sizes_seen
    for batch in Loader(packed, 4, order="sequential"):
        assert batch["images"].shape[0] == len(batch["image_rows"]) == batch["images_size"].shape[0]
        extra = np.zeros(len(batch["tokens"]), np.int64)
        for k, (row, pos) in enumerate(zip(batch["image_rows"].tolist(), batch["image_positions"].tolist())):
            assert int(batch["tokens"][row, pos]) == image_id
            h, w = batch["images_size"][k].tolist()
            extra[row] += tokens_of(h, w) - 1
            pixels = batch["images"][k, :h, :w]
            assert pixels.shape == (h, w, 3) and (batch["images"][k, h:] == 0).all()
        assert (batch["lengths"].numpy() + extra <= 512).all()
    with pytest.raises(Exception, match="own sizes; read the conversations with PackedDocuments"):
        Loader(ds, 4)
    with pytest.warns(UserWarning, match=r"conversations are longer than seq_len=16 with their images' image_tokens"):
        assert PackedDocuments(ds.root, 16, image_tokens=tokens_of).num_dropped == len(ds)
    assert main(["verify", str(ds.root)]) == 0
    if layout == "jpeg-list":  # what verify decodes is what the reader hands out
        first = ds[0]
        h, w = first["images_size"][0].tolist()
        stored = ds.reader.column(0, "images").sample(0)
        with PILImage.open(__import__("io").BytesIO(bytes(stored))) as img:
            assert np.array_equal(np.asarray(img.convert("RGB")), first["images"][0, :h, :w].numpy())
        assert codec.header(stored)[:2] == (h, w)


def test_an_image_list_whose_bytes_or_jpeg_disagree_is_our_error_everywhere(models, tmp_path, capsys):  # noqa: F811
    """A writer that got an image's byte count wrong, or a JPEG's bytes damaged, after publishing:
    verify names the shard's file and row, `packer show` and the readers say it in one line."""
    import shutil

    from packer.errors import IntegrityError

    from ..loaders.test_jpeg_lane import _published

    raw = dialogue.write_llava(tmp_path / "raw", 6, seed=4)
    good = _build(raw, tmp_path / "good", models["minimind"], "--image-size", "24", "--keep-aspect", "--store", "jpeg")
    assert main(["show", str(good.root)]) == 0 and "1 image" in capsys.readouterr().out
    for case in ("nbytes", "jpeg"):
        out = tmp_path / case
        shutil.copytree(good.root, out)
        name = "image_nbytes" if case == "nbytes" else "images"
        path = next(out.glob(f"g-*/shard-00000/{name}.npy"))
        values = np.load(path, mmap_mode="r+")
        if case == "nbytes":
            values[0] += 1
        else:
            values[-2:] = 0  # the last image's end-of-image marker: a torn write
        values.flush()
        _published(out, path)
        assert main(["verify", str(out)]) == 1
        err = capsys.readouterr().err
        assert "images.npy: row 0" in err or "images.npy: row" in err, err
        ds = MMapDataset(out)
        with pytest.raises(IntegrityError, match="run 'packer verify'"):
            for i in range(len(ds)):
                ds[i]
        with pytest.raises(IntegrityError):
            list(Loader(PackedDocuments(out, 256), 2))
