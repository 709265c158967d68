"""The scripts a user starts from, run as a user runs them: the demo, training on a folder
(stopped and started again), and DDP with torchrun on two CPU processes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import data

ROOT = Path(__file__).resolve().parent.parent


def run(*args, cwd=ROOT, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_train_on_a_folder_stops_and_goes_on(tmp_path):
    raw = data.make_image_folders(tmp_path / "photos", 40, seed=7, max_side=160)
    first = run("scripts/train_folder.py", raw, "--epochs", "2", "--batch-size", "8", "--stop-after", "7")
    assert first.returncode == 0 and "stopped after step 7" in first.stdout, first.stderr[-2000:]
    assert (tmp_path / "photos.mmpack" / "manifest.json").exists()
    again = run("scripts/train_folder.py", raw, "--epochs", "2", "--batch-size", "8")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed at epoch 1, step 7" in again.stdout  # 5 batches an epoch: the 3rd of epoch 1 is next
    assert "done: 10 steps over 2 epochs of 40 images" in again.stdout


def test_ddp_with_torchrun_on_two_processes_splits_every_epoch(tmp_path):
    from packer.cli import main

    raw = data.make_image_folders(tmp_path / "raw", 30, seed=8, max_side=120)
    assert main(["build", str(raw), str(tmp_path / "out"), "--image-size", "32", "-q"]) == 0
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "scripts/ddp.py", tmp_path / "out", "--epochs", "2", "--batch-size", "4", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    epochs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [e["epoch"] for e in epochs] == [0, 1]
    for e in epochs:
        assert e["per_rank"] == [15, 15] and e["distinct"] == e["dataset"] == 30 and e["shared"] == 0


def test_the_demo_runs_and_cleans_up(tmp_path):
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("mmpack-demo-*"))
    out = run("scripts/demo.py", "--images", "120", "--text-mb", "0.5")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Loader" in out.stdout and "Pillow decode + resize" in out.stdout and "work dir removed" in out.stdout
    assert set(Path(tempfile.gettempdir()).glob("mmpack-demo-*")) == before
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_imagenet_example_trains_from_keep_aspect_datasets(tmp_path):
    """scripts/train_imagenet.py: the PyTorch ImageNet example with mmpack's dataset and transform
    lines, on sample photos (train/ and val/ class folders, packed keep-aspect on first use)."""
    out = run("scripts/train_imagenet.py", tmp_path / "data", "--sample", "60", "--arch", "small", "--epochs", "2",
              "-b", "16", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    epochs = [line for line in out.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2 and all("60 train images" in e and "of 12" in e for e in epochs), out.stdout
    from loaders import MMapDataset

    train = MMapDataset(tmp_path / "data" / "train.mmpack")
    assert train.columns["image"].ragged and train.manifest.build["max_side"] == 512


def test_the_imagenet_example_on_the_fly_trains_from_the_folders(tmp_path):
    """--on-the-fly: the example's own pipeline (torchvision's ImageFolder in DataLoader workers),
    the comparison bench doctor runs on a GPU; nothing is packed."""
    folder = pytest.importorskip("torchvision.datasets.folder")
    out = run("scripts/train_imagenet.py", tmp_path / "data", "--sample", "40", "--arch", "small", "--epochs", "1",
              "-b", "16", "--on-the-fly", "-j", "1", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # ImageFolder takes only its own extensions (no .gif, say): what it found, not what the folder holds
    images = [f for f in (tmp_path / "data" / "train").rglob("*") if f.suffix.lower() in folder.IMG_EXTENSIONS]
    assert 0 < len(images) <= 40
    assert f"{len(images)} train images" in out.stdout and "on the fly, 1 workers" in out.stdout, out.stdout
    assert not (tmp_path / "data" / "train.mmpack").exists()


def test_the_mixture_example_trains_on_code_and_prose_70_30(tmp_path):
    out = run("scripts/mix_lm.py", "--steps", "12", "--seq-len", "64", "--work", tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "every prefix within" in out.stdout and ": ok" in out.stdout
    assert "(70.0%)" in out.stdout and "(30.0%)" in out.stdout


def test_the_voice_example_maps_features_once_and_trains_by_length_resuming_exactly(tmp_path):
    """scripts/voice_features.py: real clips through a feature function of torch ops with
    packer.map (1 worker, then 2: the same bytes), then batches of about max_tokens frames; a run
    stopped at step 5 and started again trains on exactly the uninterrupted run's batches."""
    from bench import sounds

    clips = sounds.make_audio_folders(tmp_path / "clips", 24, seed=0)
    args = ("--epochs", "2", "--max-tokens", "4000")
    whole = run("scripts/voice_features.py", clips, "--out", tmp_path / "a", "--workers", "1", *args)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert "found 24 = packed 24 + skipped 0" in whole.stdout and "done: " in whole.stdout
    head = run("scripts/voice_features.py", clips, "--out", tmp_path / "b", "--workers", "2", "--stop-after", "5", *args)
    assert head.returncode == 0 and "stopped after step 5" in head.stdout, head.stderr[-2000:]
    tail = run("scripts/voice_features.py", clips, "--out", tmp_path / "b", "--workers", "2", *args)
    assert tail.returncode == 0 and "resumed at epoch 0, step 5" in tail.stdout, tail.stderr[-2000:]

    def steps(out: str) -> list[str]:  # each step's batch: its clips, their keys, frames padded and real
        return [line.split(", loss")[0] for line in out.splitlines() if line.startswith("step ")]
    assert len(steps(whole.stdout)) > 8 and steps(head.stdout) + steps(tail.stdout) == steps(whole.stdout)
    frames = [int(line.split(" frames padded, ")[0].rsplit(" ", 1)[1]) for line in steps(whole.stdout)]
    assert max(frames) <= 4000 or "1 clip(s)" in steps(whole.stdout)[frames.index(max(frames))]

    def npy(root: Path) -> dict:
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*.npy")}
    assert npy(tmp_path / "a") == npy(tmp_path / "b")  # the map's bytes do not depend on its workers


def test_the_results_page_names_every_step_of_the_lent_gpu_script():
    """bench/results/README.md says what each step of scripts/lent_gpu.sh runs (its GPU rows cite
    them): a step added to the script and not to the page is a figure nobody can trace."""
    import re

    steps = set(re.findall(r"\bwant ([a-z_]+)", (ROOT / "scripts" / "lent_gpu.sh").read_text()))
    page = (ROOT / "bench" / "results" / "README.md").read_text()
    listed = page[page.index("## The steps of scripts/lent_gpu.sh"):]
    assert steps and not [s for s in sorted(steps) if f"`{s}`" not in listed]
