"""A seeded fuzz loop over damaged and hostile datasets (tests/fuzz_driver.py, its own process
with its address space capped): every read, Loader epoch and verify either works or is the
project's own one-line error; nothing asks for memory the files do not back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_four_hundred_damaged_datasets_give_our_errors_or_right_values(tmp_path, built, image_raw, audio_raw):
    import shutil

    from packer.cli import main

    aspect = tmp_path / "aspect-images"  # ragged images: the canvas gather, its shapes file
    assert main(["build", str(image_raw), str(aspect), "--image-size", "24", "--keep-aspect", "--shard-size", "20",
                 "-q"]) == 0
    clips = tmp_path / "clips"  # stereo clips ([T, 2], a shapes file) in a few shards: each case copies it
    for p in sorted(audio_raw.rglob("*.*"))[::4]:
        (clips / p.parent.name).mkdir(parents=True, exist_ok=True)
        shutil.copy(p, clips / p.parent.name / p.name)
    audio = tmp_path / "small-audio"
    assert main(["build", str(clips), str(audio), "--sample-rate", "8000", "--channels", "2", "--shard-size", "96KB",
                 "-q"]) == 0
    work = tmp_path / "work"
    work.mkdir()
    halves = [subprocess.Popen([sys.executable, "-m", "tests.fuzz_driver", "20261124", cases, str(work),
                                str(built["images"]), str(built["text"]), str(built["pairs"]), str(aspect),
                                str(audio)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
              for cases in ("0:200", "200:400")]  # each case its own draws: two processes, one run of 400
    done = {"ok": 0, "refused": 0}
    for proc in halves:
        stdout, stderr = proc.communicate(timeout=600)
        lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        assert proc.returncode == 0 and lines and "done" in lines[-1], stderr[-3000:]
        assert [line for line in lines if "failure" in line] == []
        done = {k: done[k] + lines[-1]["done"][k] for k in done}
    assert done["ok"] + done["refused"] == 400 and done["refused"] > 100  # the damage was real
