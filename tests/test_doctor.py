"""`bench doctor` on scripts with known answers: data-bound (the wait share the sleeps imply),
compute-bound, a script that fails mid-way (a partial report, no traceback of ours), and the
in-process `watch` for loops that are not a script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bench import doctor

ROOT = Path(__file__).resolve().parent.parent
MEMMAP = ROOT / "tests" / "tools" / "doctor_memmap.py"
SCRIPT = ROOT / "tests" / "tools" / "doctor_train.py"


def _doctor(tmp_path, *args, steps: int = 12, script: Path = SCRIPT, status: int = 0,
            confirm: int = 0, options: tuple = ()) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "doctor", "--steps", str(steps), "--json", str(out),
                           "--confirm", str(confirm), *options, "--",
                           "python", str(script), *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == status, proc.stderr[-2000:]
    return json.loads(out.read_text()), proc


@pytest.mark.timing
def test_a_data_bound_script_is_told_so_with_the_wait_its_sleeps_imply(tmp_path):
    report, proc = _doctor(tmp_path, 0.02, 0.02)  # 4 samples x 20 ms of data against a 20 ms step
    assert report["verdict"].startswith("data-bound") and report["verdict"] in proc.stdout
    # what the dataset's sleeps make each next() wait: at least their 80 ms (a busy machine's
    # sleeps overshoot, never undershoot), and under two batches as the doctor timed a sample
    batch_ms = 4 * report["per_sample"]["getitem_ms"]
    assert 76 <= report["wait"]["p50_ms"] < 2 * batch_ms, (report["wait"], batch_ms)
    assert report["wait"]["total_s"] > report["step"]["total_s"]  # waiting most of the loop: 80 ms to 20
    assert report["batches"] == 12 and report["per_sample"]["getitem_ms"] >= 20 and report["fixes"]
    assert report["loader_alone"]["samples_per_s"] > 0 and report["model_samples_per_s"] > 0
    more = next(f for f in report["fixes"] if "num_workers" in f["fix"])  # measured, with workers on every core
    assert more["how"].startswith("measured") and report["more_workers"]["samples_per_s"] > 1.3 * report["loader_alone"]["samples_per_s"]
    cores = os.cpu_count() or 1  # the sweep: 1, 2, 4, ... workers up to the cores, then the best with prefetch_factor=4
    sweep = report["workers_sweep"]
    assert [x["num_workers"] for x in sweep[:-1]] == sorted({min(2 ** k, cores) for k in range(cores.bit_length() + 1)})
    assert sweep[-1]["prefetch_factor"] == 4 and all(x["samples_per_s"] > 0 for x in sweep)
    if not torch.cuda.is_available():  # nothing to pin for
        assert not any("pin_memory" in f["fix"] for f in report["fixes"])


@pytest.mark.timing
def test_a_loop_with_no_loader_is_judged_from_its_optimizer_steps_naming_what_holds_it(tmp_path):
    """nanoGPT's shape: get_batch() slices an np.memmap, no DataLoader or Loader anywhere. Its
    optimizer's steps mark the iterations and the stack between them names get_batch when it
    holds the loop, and nothing when the model does."""
    png = tmp_path / "steps.png"
    slow, proc = _doctor(tmp_path, 60, 100, script=MEMMAP, steps=8, options=("--plot", str(png)))
    top = slow["steps"]["functions"][0]
    assert len(slow["steps"]["iteration_ms"]) == 7 and png.stat().st_size > 0  # each iteration drawn, get_batch in it
    assert slow["verdict"].startswith("data-bound") and "get_batch (doctor_memmap.py:22)" in slow["verdict"]
    assert top["function"] == "get_batch (doctor_memmap.py:22)"  # its list comprehensions too
    assert slow["steps"]["steps"] == 8 and slow["steps"]["samples"] > 50 and "optimizer: 8 steps" in proc.stdout
    fast, _ = _doctor(tmp_path, 0, 100, script=MEMMAP, steps=8)  # get_batch's slicing alone
    # (compute-bound where the machine is idle; a busy one stretches the slicing more than the model's threads)
    assert _share_of("get_batch", fast) < _share_of("get_batch", slow) / 2
    assert fast["steps"]["model_share"] > slow["steps"]["model_share"]  # the batches' making took the model's share


def _share_of(function: str, report: dict) -> float:
    """The share of the loop the stack found in `function` (none named: 0)."""
    return next((f["share"] for f in report["steps"]["functions"] if f["function"].startswith(function)), 0.0)


@pytest.mark.timing
def test_a_compute_bound_script_is_told_so(tmp_path):
    report, _ = _doctor(tmp_path, 0, 0.04)  # no data to wait for, a 40 ms step
    assert report["verdict"].startswith("compute-bound") and not report["fixes"]
    assert report["wait"]["total_s"] < report["step"]["total_s"] / 4


def test_a_script_that_fails_gives_a_partial_report_its_own_traceback_and_its_status(tmp_path):
    """The report covers what ran, the script's traceback is shown as python shows it (its file
    and line; none of the doctor's frames), and `bench doctor` exits as the script did (a CI step
    that runs its training under the doctor must still fail when the training does)."""
    report, proc = _doctor(tmp_path, 0.002, 0.005, 4, status=1)
    assert report["batches"] == 5 and "the script's own failure" in report["error"]
    assert report["exit_code"] == 1 and "stopped early" in proc.stdout
    assert 'doctor_train.py", line' in proc.stderr and "bench/doctor" not in proc.stderr
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    report, proc = _doctor(tmp_path, script=exits, status=3)
    assert report["exit_code"] == 3 and "exit 3" in proc.stdout


def test_watch_reports_a_loop_in_this_process(built):
    from loaders import Loader, MMapDataset

    loader = Loader(MMapDataset(built["images"], columns=["image", "label"]), 8)
    with doctor.watch(loader, steps=5) as w:
        for _ in loader:
            torch.ones(256, 256) @ torch.ones(256, 256)
    report = w.report()
    assert report["batches"] == 5 and report["loader"] == "Loader" and report["loader_alone"]["samples_per_s"] > 0
    assert report["verdict"].split(":")[0] in ("data-bound", "compute-bound")
    probe = doctor.Nvml.start()  # the GPU's utilisation where NVML is (an NVIDIA driver and nvidia-ml-py)
    if probe is None:
        assert report["gpu"] is None and "NVML" not in report["verdict"]
    else:
        probe.report()
        assert report["gpu"]["samples"] >= 0 and all(0 <= u <= 100 for _, u in probe.samples)
    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a server the suite started
    try:
        with doctor.watch() as nothing:
            time.sleep(0.3)  # sampled with it alive: not a process the watched code started
        assert nothing.report()["verdict"] == "no DataLoader or Loader was iterated"
    finally:
        before.kill()
        before.wait()


def test_the_report_gives_the_padding_share_of_the_batches_the_loop_took(built):
    """From an mmpack loader's own count, or from a batch's `{name}_lengths` (or an
    attention_mask) on the host: the share of the elements the loop's batches hold that are
    padding, and where it is large, the options that cut it."""
    from loaders import Loader, MMapDataset

    captions = MMapDataset(built["pairs"], columns=["tokens", "key"])
    for loader in (Loader(captions, 8, seed=1), torch.utils.data.DataLoader(captions.batched(8, seed=1), batch_size=None)):
        real = padded = 0
        with doctor.watch(loader) as w:
            for batch in loader:
                real += int(batch["tokens_lengths"].sum())
                padded += batch["tokens"].numel()
        report = w.diagnose(ceiling=False, probes=False)
        assert (report.loop.padding.real, report.loop.padding.padded) == (real, padded)
        assert report.loop.padding.column == "tokens" and report.loop.padding.share == pytest.approx(1 - real / padded)
        assert f"padding: {100 * (1 - real / padded):.0f}% of the {padded:,} tokens elements" in doctor.text(report)
        assert "bucket_by='length'" in doctor.text(report)  # random captions of 8: over a fifth padding
    masked = [{"attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])}] * 3
    with doctor.watch() as w:
        for _ in iter(torch.utils.data.DataLoader(masked, batch_size=None)):
            pass
    assert w.diagnose(ceiling=False, probes=False).loop.padding.share == pytest.approx(0.5)


class _Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        time.sleep(0.01)
        return i


@pytest.mark.timing
def test_the_loader_alone_is_timed_past_the_batches_its_workers_made_ahead():
    """4 workers on an epoch of 4 batches make all 4 while the first is made: timed from the
    first batch over that epoch alone, the rest come at no cost. Over epochs, it is what 4
    workers sleeping 10 ms a sample can make (400 samples/s), not more."""
    loader = torch.utils.data.DataLoader(_Slow(), batch_size=4, num_workers=4)
    got = doctor.to_json(doctor._ceiling(loader))
    assert got["batches"] >= 3 * 4 * 2 and 0 < got["samples_per_s"] <= 400 * 1.1, got


def _slow_start(worker_id):
    time.sleep(0.15)  # a worker's start-up: imports, opening files, a tokenizer


class _Quick(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i


@pytest.mark.timing
def test_workers_that_start_again_every_epoch_are_told_to_persist():
    """An epoch of 2 batches whose 2 workers take 0.15 s to start: alone, the loader spends
    nearly all its time starting workers; with persistent_workers=True, measured, at least twice
    the rate, and that is the fix named."""
    loader = torch.utils.data.DataLoader(_Quick(), batch_size=4, num_workers=2, worker_init_fn=_slow_start)
    alone, steady = doctor.to_json(doctor._ceiling(loader)), doctor.to_json(doctor._persistent(loader))
    assert steady["num_workers"] == 2 and steady["samples_per_s"] > 2 * alone["samples_per_s"], (alone, steady)
    r = {"wait_share": 0.6, "wait": {"n": 10, "p50_ms": 1.0, "p95_ms": 300.0}, "step": {"total_s": 1.0},
         "loader_alone": alone, "persistent": steady, "cores": 2,
         "per_sample": {"getitem_ms": 0.01, "collate_ms_per_sample": 0.01, "num_workers": 2, "pin_memory": False}}
    verdict, fixes = doctor._verdict(r)
    assert verdict.startswith("data-bound") and fixes[0]["fix"] == "persistent_workers=True", fixes
    assert fixes[0]["how"].startswith("measured")
    persistent = torch.utils.data.DataLoader(_Quick(), batch_size=4, num_workers=2, persistent_workers=True)
    assert doctor._persistent(persistent) is None  # nothing to suggest


def test_a_data_bound_loader_is_measured_with_more_threads_and_grouped_by_aspect(built):
    """A Loader with fewer gather threads than cores is timed alone with one per core, and one
    over a keep-aspect dataset whose canvas is mostly padding is timed grouped by aspect: the
    fixes named are those measured to gain."""
    from loaders import Loader, MMapDataset
    from packer.system import available_cores

    loader = Loader(MMapDataset(built["aspect"], columns=["image", "label"]), 8, num_threads=1)
    alt = doctor.to_json(doctor._loader_alternatives(loader))
    assert alt["num_threads"] == 1 and loader.num_threads == 1  # given back as it was
    assert 0 < alt["padding"] < 1
    if available_cores() > 1:
        assert alt["more_threads"]["num_threads"] == available_cores() and alt["more_threads"]["samples_per_s"] > 0
    if alt["padding"] > doctor.BUCKET_PADDING:
        assert alt["bucketed"]["samples_per_s"] > 0
    r = {"wait_share": 0.5, "wait": {"n": 4, "p50_ms": 5.0, "p95_ms": 9.0}, "step": {"total_s": 1.0},
         "loader_alone": {"samples_per_s": 100.0}, "loader_alternatives": {
             **alt, "more_threads": {"num_threads": 4, "samples_per_s": 150.0}, "bucketed": {"samples_per_s": 300.0}}}
    r["processes"] = {"worker_cpu_busy": 6.08}  # a child the script started (a build), not a worker
    verdict, fixes = doctor._verdict(r)
    assert "a Loader with 1 gather thread(s)" in verdict and f"{100 * alt['padding']:.0f}% of its canvas" in verdict
    assert "CPU each" not in verdict
    assert [(f["fix"], f["gain"]) for f in fixes] == [('bucket_by="aspect"', 3.0), ("num_threads=4 (now 1)", 1.5)]
    r["loader_alternatives"]["bucketed"]["samples_per_s"] = 105.0  # under 10% more: not named
    assert [f["fix"] for f in doctor._verdict(r)[1]] == ["num_threads=4 (now 1)"]
    tokens = doctor.to_json(doctor._loader_alternatives(Loader(MMapDataset(built["text"]), 4,
                                                               num_threads=available_cores())))
    assert tokens == {"num_threads": available_cores()}  # nothing to group, no more threads to give


def test_the_gpu_figure_is_the_loops_own_not_the_scripts_start_up():
    """NVML samples taken while the script imported, built its data or warmed up its model are
    outside the loop: the figure is over the loop's window; the whole run's mean is beside it."""
    from types import SimpleNamespace

    fake = SimpleNamespace(nvmlDeviceGetUtilizationRates=lambda handle: SimpleNamespace(gpu=50))
    nvml = doctor.Nvml(fake, None, every_s=60)
    nvml.stop.set()
    nvml.samples = [(1.0, 0), (2.0, 80), (3.0, 100), (4.0, 0)]
    got = doctor.to_json(nvml.report(0.5, 3.5))
    assert (got["samples"], got["util_mean_pct"], got["run_samples"], got["run_util_mean_pct"]) == (2, 90, 4, 45)
    # a reading covers up to a second before it: those of the loop's first second still hold the
    # idle time before the loop (seen on an H200: 69% against nvidia-smi's 84-91%), left out
    got = doctor.to_json(nvml.report(1.5, 3.5))
    assert (got["samples"], got["util_mean_pct"]) == (1, 100)
    assert nvml.report(1.5, 2.2).samples == 1  # a loop shorter than that: what there is
    assert nvml.report(1.5, None).samples == 4  # a loop with no step: the whole run


def _gpu_clock(monkeypatch) -> dict:
    """CUDA events stood in for: each records the time in the dict returned (seconds)."""
    clock = {"t": 0.0}

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock["t"]

        def elapsed_time(self, other):
            return 1e3 * (other.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return clock


def test_the_gpus_own_clock_says_how_long_its_stream_sat_idle_between_steps(monkeypatch):
    """CUDA events stood in for (this runs without a GPU): hand-overs at 0, 0.1, 0.2 s of the
    GPU's clock, steps ending at 0.08 and 0.18: the stream idle 0.04 s of 0.2, 20%. Nothing is
    recorded before the script has started CUDA."""
    clock = _gpu_clock(monkeypatch)
    marks = doctor.CudaMarks()
    marks.mark("start")
    assert marks.marks == [] and marks.report() is None  # CUDA not started by the script: no call
    monkeypatch.setattr(doctor.gpu, "_cuda_started", lambda: True)
    for kind, t in (("start", 0.0), ("end", 0.08), ("start", 0.1), ("end", 0.18), ("start", 0.2)):
        clock["t"] = t
        marks.mark(kind)
    got = doctor.to_json(marks.report())
    assert got["steps"] == 2 and got["gap_share"] == pytest.approx(0.2)
    assert got["gap"]["p50_ms"] == pytest.approx(20) and got["step"]["p50_ms"] == pytest.approx(100)
    # the loader's start-up (a first ask) is left out, as the host leaves out the first wait; an
    # epoch's end, then an evaluation pass on the GPU (0.18 to 0.5 s), then the next epoch's
    # first ask: the pass is neither step nor gap, the next epoch's first wait is a gap
    marks.marks.clear()
    for kind, t in (("end", 0.0), ("start", 5.0), ("end", 5.08), ("start", 5.1), ("end", 5.18),
                    ("end", 5.5), ("start", 5.52), ("end", 5.6)):
        clock["t"] = t
        marks.mark(kind)
    got = doctor.to_json(marks.report())
    assert got["gap_share"] == pytest.approx(0.04 / 0.28) and got["steps"] == 1
    watch, loader = doctor.Watch(processes=False), [1, 2]
    for _ in range(2):  # two epochs: each ask is marked, the one that ends an epoch too
        for _ in watch.iterate(loader, iter(loader)):
            pass
    assert [k for k, _ in watch.by_loader[id(loader)]["cuda"].marks] == ["end", "start", "end", "start", "end"] * 2


def test_a_gpu_busy_through_the_hosts_waits_is_compute_bound():
    """A script that queues its steps ahead waits on the host while the GPU still works: with
    the GPU's clock saying its stream was idle 2% of the loop, that is no data-bound loop."""
    r = {"wait_share": 0.5, "wait": {"n": 10, "p50_ms": 20.0, "p95_ms": 30.0}, "step": {"total_s": 1.0},
         "model_samples_per_s": 100.0, "cuda_events": {"gap_share": 0.02}, "copies": None}
    verdict, fixes = doctor._verdict(r)
    assert verdict.startswith("compute-bound") and "stream idle 2%" in verdict and fixes == []
    r["cuda_events"]["gap_share"] = 0.4
    assert doctor._verdict(r)[0].startswith("data-bound")


def test_copies_to_the_gpu_are_counted_with_their_bytes_and_pinning():
    """Tensor.to and Tensor.cuda are watched while the loop runs (a copy is known by the result's
    device: no CUDA call), and given back as they were after it."""
    from types import SimpleNamespace

    on_gpu = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    copies = doctor.Copies()
    to = copies.wrap(lambda tensor, *a, **k: on_gpu)
    x = torch.zeros(1000, dtype=torch.float32)
    assert to(x, "cuda") is on_gpu and copies.report(batches=1) is None  # before the loop: the model's
    copies.active = True
    assert to(x, "cuda") is on_gpu and copies.wrap(lambda tensor, *a, **k: tensor)(x) is x
    got = doctor.to_json(copies.report(batches=2))
    assert (got["copies"], got["bytes"], got["bytes_per_batch"], got["pinned_share"]) == (1, 4000, 2000, 0)
    before = torch.Tensor.to, torch.Tensor.cuda
    with doctor.watch() as w:
        assert torch.Tensor.to is not before[0]
        torch.ones(3).to(torch.float64)  # not a copy to a GPU: not counted
    assert (torch.Tensor.to, torch.Tensor.cuda) == before and w.copies.report(1) is None


def test_the_plot_shows_each_step(tmp_path):
    pytest.importorskip("matplotlib")
    png, out = tmp_path / "r.png", tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "doctor", "--steps", "6", "--confirm", "0", "--plot", str(png), "--json",
                           str(out), "--", "python", str(SCRIPT), "0.002", "0.002"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and png.stat().st_size > 0, proc.stderr[-2000:]
    rates = {x["what"]: x["samples_per_s"] for x in json.loads(out.read_text())["rates"]}  # the second panel
    assert rates["the model (its steps)"] > 0 and rates["the loader alone"] > 0


def test_a_closed_pipe_ends_bench_quietly(tmp_path):
    proc = subprocess.run(f"{sys.executable} -u -m bench.cli doctor --steps 4 -- python {SCRIPT} 0.001 0.001 | true",
                          shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr[-2000:]


def test_busy_workers_are_counted_with_their_cpu(tmp_path):
    """2 workers spinning 4 ms of CPU time a sample: however loaded the machine (which stretches
    the loop, not the CPU a sample costs), their CPU is at least what the loop's samples cost (half
    of it: a worker's last 0.2 s may end unsampled), and each one's busy share is that CPU over
    the loop's time, the figure the verdict gives."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "doctor", "--steps", "40", "--confirm", "0", "--json", str(out), "--",
                           "python", str(ROOT / "tests" / "tools" / "doctor_workers.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    procs = report["processes"]
    assert procs["worker_processes"] == 2 and procs["workers_at_once"] == 2, procs
    assert procs["cpu_s_workers"] >= 0.5 * 0.004 * report["samples"], procs  # 320 samples: 1.28 s of CPU
    loop_s = report["first_batch_s"] + report["wait"]["total_s"] + report["step"]["total_s"]
    assert procs["worker_cpu_busy"] == pytest.approx(procs["cpu_s_workers"] / (2 * loop_s), rel=0.01), procs
    assert report["verdict"].startswith("data-bound")
    assert f"at {100 * procs['worker_cpu_busy']:.0f}% CPU each" in report["verdict"], report["verdict"]


@pytest.mark.timing
def test_an_image_folder_decoded_on_the_fly_is_told_to_pack_and_packed_the_verdict_flips(tmp_path):
    """scripts/train_folder.py the way most scripts train (DataLoader workers decoding every
    image) against the same images packed: the first fix named is packing, with the rate
    measured on a sample of the folder's files, and the packed run is no longer data-bound."""
    from bench import data

    # large crops into 16 px on one worker, against a model's step on 16 px: the decoding is
    # several times slower than the model even on a machine that slows both (a busy one slows
    # the model's threads more than a worker's decoding)
    raw = data.make_image_folders(tmp_path / "raw", 96, seed=2, min_side=300, max_side=800)
    train = ROOT / "scripts" / "train_folder.py"
    args = (raw, "--image-size", 16, "--batch-size", 16)
    report, proc = _doctor(tmp_path, *args, "--on-the-fly", "--workers", 1, script=train)
    assert report["verdict"].startswith("data-bound"), report["verdict"]
    first = report["fixes"][0]
    assert first["fix"].startswith("pack the data") and first["how"].startswith("measured") and first["gain"] > 3
    assert report["packed"]["files"] == 96 and report["packed"]["image_size"] == 16 and first["fix"] in proc.stdout
    assert f"packer build {raw} {raw}-packed --image-size 16;" in first["fix"]  # the exact command for its folder
    assert f"Loader('{raw}-packed', batch_size=16)" in first["fix"]  # and the line of the script that changes
    report, _ = _doctor(tmp_path, *args, "--out", tmp_path / "packed", script=train)
    # compute-bound; or, on 2 cores shared with the suite's other test process, a wait the
    # verdict lays on what changes beside the step, not on the Loader's rate (many times the model's)
    assert report["verdict"].startswith("compute-bound") or "so the wait is not its rate" in report["verdict"], \
        report["verdict"]


@pytest.mark.parametrize("command, expected", [
    (["python", "train.py", "-u", "--lr", "1"], ("python", [], ["train.py", "-u", "--lr", "1"])),
    (["python3", "-u", "train.py"], ("python3", ["-u"], ["train.py"])),
    (["python3.11", "-uO", "-W", "ignore", "-Xdev", "train.py", "-m", "x"],
     ("python3.11", ["-uO", "-W", "ignore", "-X", "dev"], ["train.py", "-m", "x"])),
    (["python", "-Wignore::DeprecationWarning", "-m", "pkg.train", "--epochs", "2"],
     ("python", ["-W", "ignore::DeprecationWarning"], ["-m", "pkg.train", "--epochs", "2"])),
    (["python", "-um", "pkg.train"], ("python", ["-u"], ["-m", "pkg.train"])),
    (["python", "-uBWignore", "t.py"], ("python", ["-uB", "-W", "ignore"], ["t.py"])),
    (["/opt/venv/bin/python", "-c", "print(1)", "a"], ("/opt/venv/bin/python", [], ["-c", "print(1)", "a"])),
    (["python", "--check-hash-based-pycs", "never", "-B", "t.py"],
     ("python", ["--check-hash-based-pycs", "never", "-B"], ["t.py"])),
    (["train.py", "--lr", "1"], (sys.executable, [], ["train.py", "--lr", "1"])),
])
def test_the_command_is_read_as_python_reads_its_own(command, expected):
    """python's options go to the interpreter that runs the script; -m and -c end them, as in
    python; what comes after the script is the script's, whatever it looks like."""
    assert doctor.python_command(command) == expected


@pytest.mark.parametrize("command, said", [
    ([], "give the training command"), (["bash", "train.sh"], "not a Python interpreter"),
    (["accelerate", "launch", "train.py"], "every rank of a torchrun job only"),
    (["python", "-"], "standard input"), (["python", "-u"], "standard input"), (["python", "-W"], "needs a value"),
])
def test_a_command_the_doctor_cannot_run_is_one_line_saying_what_to_give(command, said):
    with pytest.raises(SystemExit) as exc:
        doctor.python_command(command)
    assert said in str(exc.value) and "\n" not in str(exc.value)


def test_a_module_run_with_python_options_and_spawned_workers_is_watched_and_measured_alone(tmp_path):
    """`python -W ignore::UserWarning -m MODULE` as python runs it (argv[0] the module's file, the
    option given to its interpreter), its DataLoader's workers started by spawn; after the script,
    the loader alone is measured with workers that unpickle the script's dataset class from
    __main__, as the script's own did. (Not -O: with no optimized bytecode cached, every import
    of torch in the spawned workers would compile it anew.)"""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "doctor", "--steps", "6", "--confirm", "0", "--json", str(out), "--",
                           sys.executable, "-W", "ignore::UserWarning", "-m", "tests.tools.doctor_spawn"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    script = ROOT / "tests" / "tools" / "doctor_spawn.py"
    assert f"ran as __main__ from {script}, warnings: ['ignore::UserWarning']" in proc.stdout, proc.stdout
    report = json.loads(out.read_text())
    assert report["batches"] == 6 and report["error"] is None, report
    assert report["loader_alone"].get("samples_per_s", 0) > 0, report["loader_alone"]


def test_a_measured_fix_that_is_no_faster_is_not_named():
    """More workers measured no faster (spawned workers still starting, a disk already busy):
    not a fix; a deeper prefetch measured faster than both is."""
    r = {"wait_share": 0.6, "wait": {"n": 10, "p50_ms": 5.0, "p95_ms": 9.0}, "step": {"total_s": 1.0}, "cores": 4,
         "loader_alone": {"samples_per_s": 100.0}, "more_workers": {"num_workers": 4, "samples_per_s": 80.0},
         "workers_sweep": [{"num_workers": 4, "prefetch_factor": 4, "samples_per_s": 150.0}],
         "per_sample": {"getitem_ms": 1.0, "collate_ms_per_sample": 0.01, "num_workers": 2, "pin_memory": False}}
    names = [f["fix"] for f in doctor._verdict(r)[1]]
    assert not any(n.startswith("num_workers") for n in names) and names[0] == "prefetch_factor=4 with num_workers=4"
    r["more_workers"]["samples_per_s"] = 200.0
    assert [f["fix"] for f in doctor._verdict(r)[1]][0] == "num_workers=4 (now 2)"


def test_the_script_runs_in_the_interpreter_named_where_it_has_mmpack_and_torch(tmp_path):
    """The script's own environment where it can be watched there; else this Python, said."""
    bare, venv = tmp_path / "bare" / "python", tmp_path / "venv" / "python"
    for path, body in ((bare, "exit 1"), (venv, f'exec {sys.executable} "$@"')):
        path.parent.mkdir()
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    assert doctor._interpreter(str(venv)) == (str(venv), None)
    python, note = doctor._interpreter(str(bare))
    assert python == sys.executable and note.startswith(f"{bare} cannot import mmpack's bench and torch")
    assert doctor._interpreter(sys.executable) == (sys.executable, None)
    with pytest.raises(SystemExit, match="no such interpreter"):
        doctor._interpreter(str(tmp_path / "python3.99"))


class _Stream(torch.utils.data.IterableDataset):
    """A stream with no length and no __getitem__ (a webdataset, a streamed corpus)."""

    def __iter__(self):
        for i in range(1000):
            time.sleep(0.001)
            yield torch.zeros(4)


@pytest.mark.timing
def test_an_iterable_dataset_is_timed_by_its_iterator_and_more_workers_come_with_their_condition():
    """An IterableDataset's sample cost is its iterator's; more workers are an estimate only, said
    with what they need: each worker must take its own part, or each yields the whole stream."""
    loader = torch.utils.data.DataLoader(_Stream(), batch_size=4)
    ps = doctor.to_json(doctor._per_sample(loader))
    assert ps["iterable"] and 0.9 < ps["getitem_ms"] < 50 and "error" not in ps, ps  # its 1 ms sleep, or a few
    r = {"wait_share": 0.6, "wait": {"n": 10, "p50_ms": 5.0, "p95_ms": 9.0}, "step": {"total_s": 1.0}, "cores": 4,
         "loader_alone": {"samples_per_s": 900.0}, "per_sample": ps}
    verdict, fixes = doctor._verdict(r)
    assert "the dataset's iterator takes" in verdict, verdict
    more = next(f for f in fixes if f["fix"].startswith("num_workers=4"))
    assert more["how"].startswith("estimated") and "get_worker_info()" in more["how"]


def test_the_loader_measured_with_a_fix_keeps_the_rest_of_the_scripts_settings():
    """Only the fix changes: the workers' start, the collate and the pinning stay the script's
    (a clone without the pinning would credit the fix with the pinning's cost)."""
    loader = torch.utils.data.DataLoader(_Quick(), batch_size=4, num_workers=1, pin_memory=True, drop_last=True,
                                         worker_init_fn=_slow_start, multiprocessing_context="spawn",
                                         collate_fn=list)
    clone = doctor._clone(loader, num_workers=2)
    assert clone.num_workers == 2 and clone.batch_size == 4 and clone.pin_memory and clone.drop_last
    assert (clone.worker_init_fn, clone.collate_fn) == (_slow_start, list)
    assert clone.multiprocessing_context is loader.multiprocessing_context


class _OwnIter(torch.utils.data.DataLoader):
    """As torchdata's StatefulDataLoader: its own __iter__, which never calls DataLoader's."""

    def __iter__(self):
        return self._get_iterator()


class _Wrapping(torch.utils.data.DataLoader):
    """As accelerate's DataLoaderShard: its own __iter__ over DataLoader's, one batch ahead."""

    def __iter__(self):
        it = super().__iter__()
        ahead = next(it, None)
        for batch in it:
            yield ahead
            ahead = batch
        if ahead is not None:
            yield ahead


def test_dataloaders_with_their_own_iter_are_watched_once_a_batch():
    """A DataLoader subclass that replaces __iter__ (torchdata's StatefulDataLoader), one that
    wraps DataLoader's (accelerate), and one the script defines while watched: each batch of
    each is one wait, none missed, none counted twice; DataLoader is as it was afterwards."""
    before = torch.utils.data.DataLoader.__dict__["__iter__"], _OwnIter.__dict__["__iter__"]
    with doctor.watch() as w:
        class Late(torch.utils.data.DataLoader):
            def __iter__(self):
                return self._get_iterator()

        loaders = [cls(_Quick(), batch_size=2) for cls in (_OwnIter, _Wrapping, Late, torch.utils.data.DataLoader)]
        for loader in loaders:
            assert len(list(loader)) == 4
    assert [len(w.by_loader[id(loader)]["waits"]) for loader in loaders] == [4, 4, 4, 4]
    assert (torch.utils.data.DataLoader.__dict__["__iter__"], _OwnIter.__dict__["__iter__"]) == before
    assert "__init_subclass__" not in torch.utils.data.DataLoader.__dict__


def test_a_wait_beside_a_loader_far_faster_than_the_model_is_not_blamed_on_its_rate():
    """Data-bound by the share waited, yet the loader alone makes many times what the model takes:
    the verdict says the wait comes from running beside the step, not from the loader's rate."""
    r = {"wait_share": 0.15, "wait": {"n": 10, "p50_ms": 0.8, "p95_ms": 1.0}, "step": {"total_s": 1.0}, "cores": 2,
         "loader_alone": {"samples_per_s": 20000.0}, "model_samples_per_s": 2000.0}
    verdict = doctor._verdict(r)[0]
    assert verdict.startswith("data-bound") and "alone it makes 10x what the model takes" in verdict, verdict
    r["loader_alone"]["samples_per_s"] = 2500.0  # barely ahead: its rate is the cause
    assert "what the model takes, so" not in doctor._verdict(r)[0]


def test_a_script_whose_loops_run_in_processes_it_starts_is_told_where_to_watch(tmp_path):
    """torch.multiprocessing.spawn's ranks iterate their loaders in processes of their own: the
    report says the doctor saw none in the script's process and what to do, not just 'none'."""
    script = tmp_path / "ranks.py"
    script.write_text("import subprocess, sys\n"
                      "subprocess.run([sys.executable, '-c', 'import time; time.sleep(0.8)'], check=True)\n")
    report, _ = _doctor(tmp_path, script=script)
    assert report["verdict"].startswith("no DataLoader or Loader was iterated in the script's own process; "
                                        "it started 1 process(es)"), report["verdict"]


def test_processes_there_before_the_watch_count_only_for_what_they_do_in_it():
    """A process started before the watch (a notebook's, a test's server) that burnt CPU then and
    idles now is no worker, and its CPU of before is not the loop's; one started in the watch is."""
    burn = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\nprint(1, flush=True)\n"
    old = subprocess.Popen([sys.executable, "-c", burn + "time.sleep(30)"], stdout=subprocess.PIPE)
    new = None
    try:
        old.stdout.readline()  # its CPU burnt
        procs = doctor.Processes(every_s=0.05)
        new = subprocess.Popen([sys.executable, "-c", burn + "time.sleep(30)"], stdout=subprocess.PIPE)
        new.stdout.readline()
        procs.sample()
        got = doctor.to_json(procs.report(wall_s=1.0))
        assert got["worker_processes"] == 1 and got["started"] == 1 and got["workers_at_once"] == 1
        assert 0.5 <= got["cpu_s_workers"] < 1.0  # the new one's 0.6 s (and its start), not the old one's too
    finally:
        for p in (old, new):
            if p is not None:
                p.kill()
                p.wait()


LINGERS = """
import multiprocessing, sys, time
import torch

def sleeper():
    time.sleep(300)

if __name__ == "__main__":
    child = multiprocessing.get_context("fork").Process(target=sleeper)  # not a daemon: python's exit waits for it
    child.start()
    open(sys.argv[1], "w").write(str(child.pid))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(int(sys.argv[2])):
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        time.sleep(float(sys.argv[3]))
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone too: it runs nothing
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_script_that_does_not_exit_after_its_report_is_stopped_and_leaves_nothing(tmp_path, monkeypatch):
    """A non-daemon child process keeps the script's exit waiting for ever: the doctor reports,
    stops the script's process group LINGER_S after the report, and says so."""
    from bench.doctor import child

    monkeypatch.setattr(child, "LINGER_S", 1.0)
    script, pidfile = tmp_path / "lingers.py", tmp_path / "pid"
    script.write_text(LINGERS)
    report = doctor.run(["python", str(script), str(pidfile), "5", "0.05"], steps=None)
    assert report.verdict.startswith("compute-bound") and report.steps.steps == 5
    # stopped, not waited for: the child sleeps 300 s, and its exit would end the script before a stop
    assert "had not exited" in report.note and _gone(int(pidfile.read_text()))


def test_sigterm_to_the_doctor_ends_the_script_and_its_children(tmp_path):
    script, pidfile = tmp_path / "lingers.py", tmp_path / "pid"
    script.write_text(LINGERS)
    proc = subprocess.Popen([sys.executable, "-m", "bench.cli", "doctor", "--", "python", str(script), str(pidfile),
                             "1000", "0.05"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    grandchild = int(pidfile.read_text())
    proc.terminate()
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(grandchild)  # the script's child, and so the script, ended with the doctor


EPOCHS = """
import sys, time
import torch

def slow_start(worker_id):
    time.sleep(0.2)  # a worker's start-up: imports, opening files

class Eight(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.zeros(4)

if __name__ == "__main__":
    loader = torch.utils.data.DataLoader(Eight(), batch_size=4, num_workers=2, worker_init_fn=slow_start)
    for epoch in range(20):  # 2 batches an epoch, each epoch's workers started again
        for x in loader:
            time.sleep(0.05)  # the step
"""


@pytest.mark.timing
def test_waits_at_epoch_starts_are_told_from_waits_inside_epochs(tmp_path):
    """Each short epoch starts its workers again (0.2 s) while its steps never wait: the verdict
    says the loop waits at the epochs' starts, and the first fix is persistent workers, measured
    (not "pack the data" alone)."""
    script = tmp_path / "epochs.py"
    script.write_text(EPOCHS)
    report, proc = _doctor(tmp_path, steps=8, script=script)
    assert report["verdict"].startswith("data-bound at epoch starts"), report["verdict"]
    assert report["epoch_starts"]["n"] == 3 and report["epoch_starts"]["p50_ms"] > 150  # the workers' 0.2 s sleep
    assert report["epoch_start_share"] > 0.8 * report["wait_share"]  # nearly all the waiting
    fix = next(f for f in report["fixes"] if f["fix"] == "persistent_workers=True")
    assert fix["how"].startswith("measured") and fix["gain"] > 1.5, report["fixes"]


HANGS = ROOT / "tests" / "tools" / "doctor_hang.py"


def _pids_gone(pids: Path) -> bool:
    deadline = time.monotonic() + 10
    alive = [int(p) for p in pids.read_text().split()]
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if not _gone(p)]
        time.sleep(0.1)
    return not alive


def test_a_loop_stuck_on_one_item_is_reported_at_the_deadline_and_stopped(tmp_path):
    """A DataLoader worker that never returns item 40: the loop gets no batch for the deadline;
    the report of the 10 batches that came is written, the script and its workers stopped, and
    the doctor exits 124 (as `timeout` does)."""
    pids = tmp_path / "pids"
    report = doctor.run(["python", str(HANGS), "40", str(pids)], steps=50, deadline_s=3)  # (without it, for ever)
    assert report.exit_code == 124 and report.batches == 10
    assert "no batch and no optimizer step for 3 s" in report.run.error
    assert _pids_gone(pids)


def test_a_loader_alone_stuck_on_one_item_is_a_probe_that_says_so_not_a_hang(tmp_path):
    """The loop stops at 3 batches; the doctor's own run of the loader alone reaches item 70,
    which never returns: that probe is a failure naming the deadline, no trial runs after it
    (each would reach the same item), and the verdict comes."""
    pids = tmp_path / "pids"
    report = doctor.run(["python", str(HANGS), "70", str(pids)], steps=3, deadline_s=3)  # (without it, for ever)
    assert report.exit_code == 0 and report.batches == 3 and report.verdict
    assert "the loader alone gave no answer in 3 s" in report.probes.loader_alone.error
    assert report.probes.per_sample.getitem_ms >= 0  # items 0-63 came
    assert not (report.trials.workers_sweep or report.trials.persistent or report.trials.packed)
    assert "the loader alone not measured" in doctor.text(report)
    assert _pids_gone(pids)


def test_the_headline_says_au_exposed_time_and_how_many_steps_make_the_verdict_sure():
    """AU is compute over wall time; exposed loading the mean wait a step. A share near the
    data-bound line over few, uneven steps is not sure, and the steps it names are enough: the
    same pattern repeated to that many steps is sure."""
    from bench.doctor.headline import headline

    steady = headline(0.5, 0.5, [10.0] * 20, [20.0] * 20, 0.10)
    assert steady.sure and steady.accelerator_utilisation == 0.5 and steady.exposed_ms_per_step == 10.0
    for n in (1, 3, 7):  # a handful of steps is never sure, however far from the line
        few_steps = headline(0.76, 0.24, [76.0] * n, [100.0] * n, 0.10)
        assert not few_steps.sure and few_steps.steps_to_be_sure == 8
    waits = [0.5, 0.5, 0.5, 6.0, 0.5, 0.5, 0.5, 0.5]  # one stall among fast batches: 11% waiting
    wholes = [w + 10.0 for w in waits]
    share = sum(waits) / sum(wholes)
    few = headline(share, 1 - share, waits, wholes, 0.10)
    assert not few.sure and few.steps_to_be_sure > len(waits)
    times = -(-few.steps_to_be_sure // len(waits))
    assert headline(share, 1 - share, waits * times, wholes * times, 0.10).sure
    assert not headline(share, 1 - share, waits * (times // 4 or 1), wholes * (times // 4 or 1), 0.10).sure
    r = doctor.Report(wall_s=1.0, verdict="data-bound", headline=few)
    assert f"--steps {few.steps_to_be_sure}" in doctor.text(r)
    assert "accelerator utilisation 89%" in doctor.text(r)


@pytest.mark.timing
def test_the_first_fix_is_confirmed_in_the_users_run_and_the_replay_ceiling_is_the_steps_cost(tmp_path):
    """Too few workers (80 ms of data a batch against a 70 ms step): the measured fix,
    num_workers=2, applied in a second run of the unmodified script, cuts the loop's wait to
    under half and speeds its steps; the replay (its first 4 batches served again) steps at
    about the step's own cost, 70 ms, and the data's cost to the run is said."""
    report = doctor.run(["python", str(SCRIPT), "0.02", "-0.07"], steps=16, confirm=1, replay=4)
    first = report.fixes[0]
    assert first.fix.startswith("num_workers=2") and first.args == {"num_workers": 2}
    c = first.confirmed
    assert c.wait_share_before > doctor.DATA_BOUND and c.wait_share < c.wait_share_before / 2 and c.speedup > 1.2
    assert 0.5 / 0.07 <= report.replay.steps_per_s <= 1 / 0.07  # 1 / 70 ms, less the loop's own work
    assert report.replay.data_cost > 0.3  # the run stepped under 0.7 of the replay's rate
    said = doctor.text(report)
    assert "confirmed in your run:" in said and "the data costs you" in said
    assert doctor.read_report(_written(report, tmp_path)).fixes[0].confirmed == c


def _written(report, tmp_path: Path) -> Path:
    doctor.write_report(report, tmp_path / "r.json")
    return tmp_path / "r.json"


RANKS = ROOT / "tests" / "tools" / "doctor_ranks.py"


@pytest.mark.parametrize("command, expected", [
    (["torchrun", "--nproc-per-node", "2", "--standalone", "t.py", "--lr", "1"],
     ["--nproc-per-node", "2", "--standalone", "-m", "bench.doctor.rank", "t.py", "--lr", "1"]),
    (["torchrun", "--nproc_per_node=8", "-m", "pkg.train", "-m"], ["--nproc_per_node=8", "-m", "bench.doctor.rank",
                                                                    "-m", "pkg.train", "-m"]),
    (["python", "-m", "torch.distributed.run", "--nnodes", "1", "t.py"], ["--nnodes", "1", "-m", "bench.doctor.rank",
                                                                         "t.py"]),
])
def test_a_torchrun_command_keeps_its_options_and_runs_each_ranks_script_watched(command, expected):
    from bench.doctor.ranks import torchrun_command

    assert torchrun_command(command) == [sys.executable, "-m", "torch.distributed.run", *expected]
    assert torchrun_command(["python", "t.py"]) is None


@pytest.mark.timing
def test_every_rank_of_a_torchrun_job_is_watched_and_the_straggler_named(tmp_path):
    """Two gloo ranks on the CPU, rank 1's data 80 ms a batch, rank 0's free: rank 1 is the
    straggler, data-bound; rank 0 waits for it in DDP's all-reduce, which its clock counts as
    step: about those 80 ms a step, said as what the straggler costs the others."""
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "doctor", "--steps", "12", "--json", str(out), "--",
                           "torchrun", "--nproc-per-node", "2", "--standalone", str(RANKS), "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    ranks = report["ranks"]
    assert ranks["straggler"] == 1 and [r["rank"] for r in ranks["ranks"]] == [0, 1]
    slow, fast = ranks["ranks"][1], ranks["ranks"][0]
    assert 0.5 * slow["wait_ms"] < ranks["held_ms_per_step"] < 2 * slow["wait_ms"]  # what the straggler waits
    assert slow["wait_share"] > 2 * fast["wait_share"] and fast["step_ms"] > 2 * slow["step_ms"]
    assert report["verdict"].startswith("data-bound on rank 1 of 2") and "rank 1: 12 batches" in proc.stdout


def test_a_loop_seen_from_its_optimizer_is_timed_on_the_gpus_clock_too(monkeypatch):
    """CUDA events stood in for: each iteration's first module forward and its optimizer step
    are marked. A host that queues ahead shows its wait in whatever syncs (here a function
    holding 60% of the host's samples), but a stream idle 5% between steps is compute-bound;
    idle 40%, the function is named."""
    from bench.doctor.report import GapFunction, OptimizerSteps, Stats
    from bench.doctor.steps import Steps, hooked
    from bench.doctor.verdict import from_steps

    clock = _gpu_clock(monkeypatch)
    monkeypatch.setattr(doctor.gpu, "_cuda_started", lambda: True)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    s = Steps()
    with hooked(s):
        for k in range(4):  # forward at 0.1 k, step at 0.1 k + 0.095: idle 5 ms between steps
            clock["t"] = 0.1 * k
            model(torch.zeros(1, 2)).sum().backward()
            clock["t"] = 0.1 * k + 0.095
            optimizer.step()
    events = s.figures().cuda_events
    assert events.steps == 3 and events.gap_share == pytest.approx(0.015 / 0.395)  # 3 gaps of 5 ms, 4 steps of 95
    held = OptimizerSteps(steps=4, iteration=Stats.of([0.1] * 3), samples=100, model_share=0.4, loop_share=0.0,
                          outside_share=0.6, functions=[GapFunction(function="sync (t.py:3)", share=0.6)],
                          cuda_events=events)
    assert from_steps(held).startswith("compute-bound: the GPU is never short of work")
    held.cuda_events.gap_share = 0.4
    assert from_steps(held).startswith("data-bound: 60% of the loop in sync (t.py:3)")


INTERRUPTED = """
import sys, time
import torch

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100000):
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    if step == 3:
        open(sys.argv[1], "w").write("looping")
    time.sleep(0.02)
"""


@pytest.mark.parametrize("started", ["from a shell", "with SIGINT ignored"])
def test_a_first_ctrl_c_to_the_doctor_stops_the_script_with_its_partial_report(tmp_path, started):
    """The script runs in a session of its own, so a terminal's Ctrl-C reaches the doctor alone:
    the doctor passes the first one on, the script stops where it is (KeyboardInterrupt), and
    the report of what ran is printed, with the script's failure status. So too where the doctor
    was started with SIGINT ignored (a background job of a script, a test runner's worker), which
    its script inherited: it looped on for ever."""
    script, flag, out = tmp_path / "loops.py", tmp_path / "looping", tmp_path / "r.json"
    script.write_text(INTERRUPTED)
    ignored = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if started == "with SIGINT ignored" else None
    proc = subprocess.Popen([sys.executable, "-m", "bench.cli", "doctor", "--steps", "100000", "--json", str(out), "--",
                             "python", str(script), str(flag)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=ignored)
    deadline = time.monotonic() + 60
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    try:  # a busy machine may take its time; a doctor that never ends is the failure, with what it said
        stdout, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"the doctor did not end 240 s after a Ctrl-C: {stderr[-2000:]}") from None
    assert proc.returncode == 1, stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["error"].startswith("KeyboardInterrupt") and report["steps"]["steps"] >= 4
    assert "the script stopped early: KeyboardInterrupt" in stdout


def test_a_confirmation_whose_wait_and_rate_disagree_is_said_unclear_and_packing_nothing_is_not_offered():
    """A rerun on a machine whose load moved: more waiting yet more steps a second is neither
    confirmed nor refuted. A dataset with no work per sample is not told to pack."""
    from bench.doctor.report import Confirmed, SampleCost
    from bench.doctor.verdict import _confirmed, _pack_fix

    said = _confirmed(Confirmed(wait_share_before=0.49, wait_share=0.88, steps_per_s_before=10, steps_per_s=42,
                                speedup=4.2))
    assert said.startswith("unclear")
    assert _confirmed(Confirmed(wait_share_before=0.7, wait_share=0.04, steps_per_s_before=10, steps_per_s=28,
                                speedup=2.8)).startswith("confirmed in your run: 70% -> 4%")
    assert _confirmed(Confirmed(wait_share_before=0.3, wait_share=0.35, steps_per_s_before=10, steps_per_s=9.5,
                                speedup=0.95)).startswith("not confirmed")
    cost = SampleCost(getitem_ms=0.001, collate_ms_per_sample=0.01, iterable=False, num_workers=2, pin_memory=False,
                      batch_size=8, dataset="Cheap")
    assert _pack_fix(doctor.Report(wall_s=1.0, verdict=""), cost) is None
