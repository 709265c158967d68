"""The README's Python blocks run as written, each pasted alone into a fresh process (on the
sample data), so the README cannot drift from the API; its training loop, stopped right after a checkpoint and run
again in a new process, trains on exactly the batches of a run that was never stopped."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import chat_templates, data, dialogue
from packer.cli import main

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
TRAINING = next(block for block in BLOCKS if "ckpt.pt" in block and "MMapDataset(\"out/\")" in block)

HARNESS = """
import json, sys, torch
import loaders
STOP = int(sys.argv[2])
seen, saves = [], [0]
iterate, save = loaders.Loader.__iter__, torch.save


def recording(self):
    for batch in iterate(self):
        if isinstance(batch, dict) and "image" in batch:
            seen.append(int(batch["image"].sum()))
        yield batch


def saving(obj, path):
    save(obj, path)
    saves[0] += 1
    if saves[0] == STOP:  # preempted right after this checkpoint
        raise SystemExit(3)


loaders.Loader.__iter__, torch.save = recording, saving
try:
    exec(open(sys.argv[1]).read(), {"__name__": "__main__"})
finally:
    print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def readme_dir(tmp_path_factory, image_raw, text_raw, audio_raw, minilm):
    """A working dir with the datasets the README's blocks open: out/ (images), text-out/ (text),
    prose-out/ (text), data/train (keep-aspect images), speech-out/ (audio at 16 kHz), chat-out/
    (conversations)."""
    work = tmp_path_factory.mktemp("readme")
    assert main(["build", str(audio_raw), str(work / "speech-out"), "--sample-rate", "16000", "-q"]) == 0
    assert main(["build", str(image_raw), str(work / "out"), "--image-size", "48", "-q"]) == 0
    assert main(["build", str(text_raw), str(work / "text-out"), "--tokenizer", str(minilm), "-q"]) == 0
    assert main(["build", str(image_raw), str(work / "data" / "train"), "--image-size", "40", "--keep-aspect", "-q"]) == 0
    (work / "prose").mkdir()
    (work / "prose" / "lines.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in data.caption_lines(300)))
    assert main(["build", str(work / "prose"), str(work / "prose-out"), "--tokenizer", str(minilm), "-q"]) == 0
    dialogue.write_minimind(work / "chat" / "sft.jsonl", 40, seed=0)
    template = work / "chatml.jinja"
    template.write_text(chat_templates.MINIMIND)
    assert main(["build", str(work / "chat"), str(work / "chat-out"), "--tokenizer", str(dialogue.chat_tokenizer()),
                 "--chat-template", str(template), "-q"]) == 0
    return work


def test_the_readme_has_the_blocks_a_user_needs():
    text = "\n".join(BLOCKS)
    for needed in ("load_state_dict", "set_epoch", "StatefulDataLoader", "TokenWindows", "PackedDocuments",
                   "cu_seqlens", "Mixture", "normalize", "train_transform", "eval_transform", "image_size",
                   "AudioClips", "audio_lengths", "labels"):
        assert needed in text, needed


def test_every_python_block_of_the_readme_runs_pasted_alone(readme_dir):
    for k, block in enumerate(BLOCKS):
        script = readme_dir / f"block{k}.py"
        script.write_text(block)
        for _ in range(2 if "ckpt.pt" in block else 1):  # the second run starts from the checkpoint the first left
            out = subprocess.run([sys.executable, str(script)], cwd=readme_dir, capture_output=True, text=True,
                                 timeout=600)
            assert out.returncode == 0, (k, block[:200], out.stderr[-3000:])


def test_the_readme_training_loop_resumes_with_the_next_batch(readme_dir, tmp_path):
    loop = tmp_path / "loop.py"
    loop.write_text(TRAINING)
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)

    def run(cwd: Path, stop: int) -> tuple[int, list[int]]:
        out = subprocess.run([sys.executable, str(harness), str(loop), str(stop)], cwd=cwd, capture_output=True,
                             text=True, timeout=600)
        return out.returncode, json.loads(out.stdout.strip().splitlines()[-1])

    for name in ("whole", "stopped"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "out").symlink_to(readme_dir / "out")
    rc, whole = run(tmp_path / "whole", stop=0)
    assert rc == 0 and len(whole) == 6  # 79 images, batches of 64, 3 epochs
    rc, head = run(tmp_path / "stopped", stop=3)  # preempted mid-epoch, after the 3rd batch's checkpoint
    assert rc == 3 and len(head) == 3
    rc, tail = run(tmp_path / "stopped", stop=0)  # a new process: the loop goes on
    assert rc == 0 and head + tail == whole
