"""The report's headline in the terms the field uses, and how sure its verdict is.

- Accelerator utilisation (AU), as MLPerf Storage defines it: compute time over wall time. Here
  the loop's time less its waiting for data (on the GPU's clock where CUDA events were taken:
  less the stream's idle gaps between steps); for a loop seen from its optimizer's steps, the
  share of its stack samples in the model's forward, backward and step.
- Exposed data-loading time per step (Ray Train's "exposed" time): what the step waits for its
  data on average, the loading that does not overlap compute.
- How many steps the verdict needs: the wait share is a ratio of sums over steps whose waits
  vary (an epoch start's stall among fast batches); its standard error from the per-step values
  says whether the share lies clearly on one side of the data-bound line (two standard errors),
  and if not, about how many steps would put it there (the error falls as one over the root of
  the steps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .codec import omitted

SURE_SE = 2.0  # standard errors between the share and the line: about 95% sure of the side
MIN_STEPS = 8  # under this many, the spread itself is not known: never sure
MOST_STEPS = 100_000  # "about N steps" is not said past this (a share on the line is never sure)


@dataclass(kw_only=True)
class Headline:
    """AU, exposed data-loading time per step, and whether the verdict's side of the line is sure."""

    accelerator_utilisation: float
    exposed_ms_per_step: float
    steps: int
    share_se: float | None = omitted()  # the standard error of the share that decides
    sure: bool = True
    steps_to_be_sure: int | None = omitted()


def ratio_se(parts: list[float], wholes: list[float]) -> float | None:
    """The standard error of sum(parts) / sum(wholes) over paired per-step values (the ratio
    estimator's linearisation); None under three steps."""
    n = len(wholes)
    total = sum(wholes)
    if n < 3 or total <= 0:
        return None
    r = sum(parts) / total
    residual = sum((p - r * w) ** 2 for p, w in zip(parts, wholes)) / (n - 1)
    return math.sqrt(residual / n) / (total / n)


def headline(decides: float, au: float, parts: list[float], wholes: list[float], line: float) -> Headline:
    """The headline of a loop whose verdict is `decides` (the share not computing) against `line`,
    with utilisation `au`; `parts` (ms not computing) and `wholes` (ms) of each step give the
    exposed time and the spread (the host's, where the GPU's clock decides: its gaps are not per
    step)."""
    n = len(wholes)
    se = ratio_se(parts, wholes)
    out = Headline(accelerator_utilisation=au, exposed_ms_per_step=sum(parts) / n if n else 0.0, steps=n, share_se=se)
    distance = abs(decides - line)
    if n >= MIN_STEPS and se is not None and distance >= SURE_SE * se:
        return out
    need = max(MIN_STEPS, n * (SURE_SE * se / distance) ** 2 if se is not None and distance > 0 else
               (MIN_STEPS if se is None else math.inf))
    out.sure = False
    out.steps_to_be_sure = int(math.ceil(need)) if need <= MOST_STEPS else None
    return out


def said(h: Headline) -> str:
    """The headline as the report's second line."""
    line = (f"accelerator utilisation {100 * h.accelerator_utilisation:.0f}% (compute time over wall time, as MLPerf "
            f"Storage counts it); exposed data loading {h.exposed_ms_per_step:.1f} ms a step, over {h.steps} steps")
    if h.sure:
        return line
    more = f"watch about {h.steps_to_be_sure:,} steps (--steps {h.steps_to_be_sure})" if h.steps_to_be_sure else \
        "the share sits on the line: more steps will not settle it"
    spread = f"the share is +-{100 * SURE_SE * h.share_se:.0f} points" if h.share_se is not None else \
        f"under {MIN_STEPS} steps, its spread is not known"
    return f"{line}; not sure yet ({spread}): {more}"
