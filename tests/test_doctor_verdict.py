"""The doctor's verdict, fixes and headline from recorded reports (tests/data/doctor/: what
`bench doctor --json` wrote on the 2-core VM, an H100 and an H200). `diagnosis.judge` is a pure
function of a report's figures, so these run no script and time nothing."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from bench.doctor import read_report, text, write_report
from bench.doctor.codec import from_json
from bench.doctor.diagnosis import judge
from bench.doctor.headline import MIN_STEPS, SURE_SE
from bench.doctor.report import Report, StepTime
from bench.doctor.verdict import DATA_BOUND

RECORDED = Path(__file__).resolve().parent / "data" / "doctor"
SAID = ("verdict", "fixes", "rates", "headline")  # what judge makes: left out of what it is given


def _judged(name: str) -> tuple[dict, Report]:
    """A recorded report as written, and judge's report from its figures alone."""
    recorded = json.loads((RECORDED / name).read_text())
    figures = {k: v for k, v in recorded.items() if k not in SAID}
    return recorded, judge(from_json(Report, {**figures, "verdict": ""}))


def _second_line(report: Report) -> str:
    return text(report).split("\n")[1]


def test_a_dataloader_without_workers_that_waits_most_of_its_loop_is_told_to_add_them():
    """The 2-core VM's stand-in script: 10 ms of data a sample on no worker, against a model that
    takes 213 samples/s: data-bound, more workers first (measured 2x alone), packing estimated."""
    recorded, got = _judged("doctor-2core-2026-11-26.json")
    assert got.verdict.startswith("data-bound: 68% of the loop waiting for the next batch (p50 41.7 ms, p95 44.2 ms)")
    assert "__getitem__ takes 10.27 ms a sample and the collate 0.08 ms, on 0 worker(s)" in got.verdict
    assert "so the wait is not its rate" not in got.verdict  # alone it makes 96 samples/s of the model's 213
    workers, pack = got.fixes
    assert workers.fix == "num_workers=2 (now 0)" and workers.how.startswith("measured") and workers.args == {
        "num_workers": 2}
    assert workers.gain == pytest.approx(recorded["more_workers"]["samples_per_s"] / recorded["loader_alone"][
        "samples_per_s"])
    assert pack.fix.startswith("pack the data once") and pack.how.startswith("estimated") and pack.gain is None
    h, waits = got.headline, [s["wait_ms"] for s in recorded["per_step"]]
    assert h.sure and h.steps == len(waits) == 29
    assert h.accelerator_utilisation == pytest.approx(1 - recorded["wait_share"])
    assert h.exposed_ms_per_step == pytest.approx(sum(waits) / len(waits))
    assert _second_line(got) == ("accelerator utilisation 32% (compute time over wall time, as MLPerf Storage counts "
                                 "it); exposed data loading 41.9 ms a step, over 29 steps")
    assert [r.what for r in got.rates] == ["the model (its steps)", "the loader alone", "num_workers=2 alone"]


def test_a_gpu_whose_stream_is_seldom_idle_is_compute_bound_by_its_own_clock():
    """An H100 fed by a Loader: the host waited 3% of the loop, the stream idle 3% between steps
    (CUDA events): compute-bound, nothing to fix, AU from the GPU's clock."""
    recorded, got = _judged("doctor-h100-2026-11-26-loader.json")
    assert got.verdict.startswith("compute-bound: 3% of the loop waiting") and got.fixes == []
    assert "its stream idle 3% of the loop between steps (CUDA events)" in got.verdict
    assert "100% of it from pinned memory" in got.verdict
    h = got.headline
    assert h.sure and h.steps == 150
    assert h.accelerator_utilisation == pytest.approx(1 - recorded["cuda_events"]["gap_share"])
    assert "accelerator utilisation 97%" in _second_line(got) and "not sure" not in _second_line(got)


def test_a_share_just_over_the_line_is_not_sure_and_the_steps_it_names_make_it_sure():
    """An H200 fed by a Loader making 6x what the model takes: 12% waiting, over the 10% line, so
    data-bound, but not at its rate; over 150 uneven steps that side of the line is not sure, and
    the steps the headline asks for (the same steps again as often) are enough."""
    recorded, got = _judged("doctor-h200-2026-11-26-loader.json")
    assert got.verdict.startswith("data-bound: 12% of the loop waiting") and got.fixes == []
    assert "alone it makes 6x what the model takes, so the wait is not its rate" in got.verdict
    h = got.headline
    assert not h.sure and h.steps == 150 and h.steps_to_be_sure > h.steps
    distance = abs(recorded["wait_share"] - DATA_BOUND)
    assert h.steps_to_be_sure == math.ceil(h.steps * (SURE_SE * h.share_se / distance) ** 2)
    assert f"not sure yet (the share is +-{100 * SURE_SE * h.share_se:.0f} points): watch about " \
           f"{h.steps_to_be_sure:,} steps (--steps {h.steps_to_be_sure})" in _second_line(got)
    times = -(-h.steps_to_be_sure // h.steps)
    longer = dataclasses.replace(got.loop, per_step=got.loop.per_step * times)
    assert judge(dataclasses.replace(got, loop=longer)).headline.sure


def test_an_image_folder_decoded_on_the_fly_is_told_to_pack_first_by_its_measured_gain():
    """An H100 training from JPEG files with 16 DataLoader workers: the stream idle 74% between
    steps, data-bound; packing measured at 87x the loader's rate, persistent workers at 1.3x:
    packing first."""
    _, got = _judged("doctor-h100-2026-11-26-otf.json")
    assert got.verdict.startswith("data-bound: 71% of the loop waiting")
    assert "its stream idle 74% of the loop between steps (CUDA events)" in got.verdict
    assert [f.fix.split(" ")[0] for f in got.fixes] == ["pack", "persistent_workers=True"]
    assert all(f.how.startswith("measured") for f in got.fixes)
    assert got.fixes[0].gain > 50 > 2 > got.fixes[1].gain > 1.1
    assert got.headline.accelerator_utilisation == pytest.approx(1 - 0.74325338077332)


def test_a_loop_with_no_loader_is_judged_from_its_optimizer_steps():
    """nanoGPT's shape (tests/tools/doctor_memmap.py 60 100): no DataLoader, get_batch holding
    43% of the loop: data-bound, named; its headline from the steps, AU the model's share, and 7
    iterations too few to be sure (MIN_STEPS)."""
    recorded, got = _judged("doctor-2core-2026-12-07-memmap.json")
    assert got.loop is None and got.fixes is None
    assert got.verdict.startswith("data-bound: 43% of the loop in get_batch (doctor_memmap.py:22), outside the model's")
    h, steps = got.headline, recorded["steps"]
    assert h.accelerator_utilisation == pytest.approx(steps["model_share"])
    assert h.exposed_ms_per_step == pytest.approx(sum(steps["top_ms"]) / len(steps["top_ms"]))
    assert (h.steps, h.sure, h.steps_to_be_sure) == (7, False, MIN_STEPS)
    one = from_json(Report, {**{k: v for k, v in recorded.items() if k not in SAID}, "verdict": ""})
    one.steps.steps = 1  # a single step judges nothing: said as no loader iterated
    assert judge(one).verdict == "no DataLoader or Loader was iterated" and judge(one).headline is None


def test_waits_at_the_epochs_starts_are_the_verdict_and_persistent_workers_the_first_fix():
    """test_doctor.py's EPOCHS script (2 workers started again each 2-batch epoch, 0.2 s each):
    the waiting is at the epochs' first batches, and persistent workers, measured, come first."""
    _, got = _judged("doctor-2core-2026-12-07-epochs.json")
    assert got.verdict.startswith("data-bound at epoch starts: 63% of the loop waiting for the first batch of each "
                                  "epoch (3 epoch start(s), p50 225 ms)")
    assert got.fixes[0].fix == "persistent_workers=True" and got.fixes[0].how.startswith("measured")


@pytest.mark.parametrize("name", sorted(p.name for p in RECORDED.glob("*.json")))
def test_a_report_is_judged_from_its_figures_alone_and_again_the_same_once_written(name, tmp_path):
    """Whatever verdict, fixes and headline a report holds, judge makes them again from its
    figures; written and read back, it judges the same."""
    recorded, got = _judged(name)
    stale = from_json(Report, recorded)
    assert judge(stale) == got
    write_report(got, tmp_path / "r.json")
    again = read_report(tmp_path / "r.json")
    assert judge(again) == again and again.verdict == got.verdict and again.headline == got.headline


def test_the_data_bound_line_decides_and_nothing_is_offered_below_it():
    """The 2-core report with its waits cut below DATA_BOUND: compute-bound, no fix; at the line
    itself, compute-bound still (waiting more than the line is data-bound)."""
    _, got = _judged("doctor-2core-2026-11-26.json")
    for share in (0.05, DATA_BOUND):
        waits = [StepTime(wait_ms=share / (1 - share) * s.step_ms, step_ms=s.step_ms) for s in got.loop.per_step]
        loop = dataclasses.replace(got.loop, wait_share=share, per_step=waits)
        cut = judge(dataclasses.replace(got, loop=loop))
        assert cut.verdict.startswith(f"compute-bound: {100 * share:.0f}% of the loop waiting") and cut.fixes == []
        assert cut.headline.accelerator_utilisation == pytest.approx(1 - share)
