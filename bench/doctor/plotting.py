"""The report drawn: each step's work and wait as stacked bars, and the model's rate against the
loader's alone and each measured fix's (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from .report import Report, StepTime


def plot(r: Report, path: Path) -> None:
    from ..report import _plt

    plt = _plt()
    rates = r.rates or []
    if rates:  # the model against the loader's ceiling beside the steps; a loop with no loader has none
        fig, (ax, side) = plt.subplots(1, 2, figsize=(14, 4), gridspec_kw={"width_ratios": [2, 1]})
    else:
        fig, ax = plt.subplots(figsize=(10, 4))
    if r.loop:
        _steps(ax, r.loop.per_step)
    elif r.steps and r.steps.iteration_ms:  # a loop seen from its optimizer: the top function in each iteration
        s, top = r.steps, (r.steps.functions or [None])[0]
        named = s.top_ms or [0.0] * len(s.iteration_ms)
        _steps(ax, [StepTime(wait_ms=t, step_ms=max(0.0, i - t)) for i, t in zip(s.iteration_ms, named)],
               work="the rest of the iteration", wait=f"in {top.function}" if top else "outside the model")
    if rates:
        _rates(side, rates)
    fig.suptitle(textwrap.fill(r.verdict.split(";")[0], 150, max_lines=2), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _rates(side, rates) -> None:
    side.barh([x.what for x in rates][::-1], [x.samples_per_s for x in rates][::-1],
              color=["#888" if x.what.startswith("the model") else "#4c72b0" for x in rates][::-1])
    side.set_xlabel("samples/s")
    side.xaxis.set_major_formatter(lambda v, _: f"{v / 1e3:g}k" if v else "0")
    side.set_title("the model against the loader's ceiling", fontsize=10)


def _steps(ax, steps: list[StepTime], work: str = "working (the step)", wait: str = "waiting for the batch") -> None:
    """Each step's work, its wait stacked on it."""
    x = range(1, len(steps) + 1)
    label = work
    work = [s.step_ms for s in steps]
    ax.bar(x, work, color="#4c72b0", label=label)
    ax.bar(x, [s.wait_ms for s in steps], bottom=work, color="#dd8452", label=wait)
    ax.set_xlabel("step")
    ax.set_ylabel("ms")
    ax.set_title("each step: working and waiting", fontsize=10)
    totals = sorted(w + s.wait_ms for w, s in zip(work, steps))
    if totals and totals[-1] > 0:
        # a step or two far above the rest (the first, with its warm-up) would flatten every other
        # bar: the scale is the 99th percentile's, and a bar above it says its height in ms
        p99 = totals[(99 * (len(totals) - 1)) // 100]
        top = totals[-1] if totals[-1] <= 3 * p99 else p99
        ax.set_ylim(0, 1.25 * top)  # head room: the legend above the bars, not over them
        for i, (w, s) in enumerate(zip(work, steps), 1):
            if w + s.wait_ms > 1.25 * top:
                ax.annotate(f"{w + s.wait_ms:,.0f} ms", (i + 0.8, 1.12 * top), ha="left", va="center", fontsize=8)
    ax.legend(loc="upper right", ncol=2)
