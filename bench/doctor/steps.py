"""The step boundary every training loop has, and where its time goes between them: each
optimizer's `step()` (torch's global post-hook; `GradScaler.step` calls it) ends an iteration,
and a sampler thread reads the training thread's Python stack every SAMPLE_S. So a loop that
iterates no DataLoader or Loader (nanoGPT's `get_batch` slicing an `np.memmap`, a custom
iterator, a streaming dataset) still gets a verdict, naming the functions that hold it outside
the model's forward, backward and optimizer step.

A sample is the model's when any frame on the stack is torch's own code (a module's forward,
autograd's backward, an optimizer's step), torch's data loading aside; else it is charged to
the innermost frame of the user's code (not the standard library, not an installed package):
the function that called the optimizer (the loop itself: its logging, a `loss.item()`), or one
it called (`get_batch`), named with its file and first line. Each sample weighs the time since
the one before: a thread that holds the GIL in pure Python is sampled as often as the
interpreter lets the sampler run, and what it held meanwhile still counts.
"""

from __future__ import annotations

import bisect
import os
import sys
import sysconfig
import threading
import time
from collections import Counter
from contextlib import contextmanager

from .gpu import CudaMarks
from .report import GapFunction, OptimizerSteps, Stats

SAMPLE_S = 0.002
MOST_SAMPLES = 200_000  # about 7 minutes at SAMPLE_S: the sampler stops there, the figures stand
NAMED = 5  # functions named in the report
LOOP = "the loop's own lines"
INNER = frozenset({"<listcomp>", "<genexpr>", "<setcomp>", "<dictcomp>", "<lambda>"})  # charged to their function


class Steps:
    """The optimizer steps of the watched process and the training thread's stack between them."""

    def __init__(self, on_step=None):
        self.times: list[float] = []
        self.on_step = on_step  # called after each step (the watch's step limit)
        self.samples: list[tuple[float, float, str | None]] = []  # (time, weight, label: None = the model's)
        self.thread = threading.main_thread().ident
        self.loop_code = None  # the code object of the function that calls optimizer.step
        self.stop = threading.Event()
        self.sampler: threading.Thread | None = None
        # the GPU's clock: an event at each iteration's first module forward ("start") and at its
        # optimizer step ("end"), so the stream's idle time between steps is known as for a loader
        self.cuda = CudaMarks()
        self.armed = True

    def forward(self, module, args) -> None:
        """torch's global module forward pre-hook: the first forward after a step starts an iteration."""
        if self.armed:
            self.armed = False
            self.cuda.mark("start")

    def hook(self, optimizer, args, kwargs) -> None:
        """torch's optimizer step post-hook: an iteration ends."""
        self.times.append(time.perf_counter())
        self.cuda.mark("end")
        self.armed = True
        if self.sampler is None:  # the first step: torch is imported, the stepping thread known
            self._torch = _folder("torch")
            self._torch_data = os.path.join(self._torch, "utils", "data", "")
            self._not_user = tuple({*(p for k in ("stdlib", "purelib", "platlib") if (p := sysconfig.get_paths().get(k))),
                                    os.path.join(os.path.dirname(os.path.abspath(__file__)), ""), self._torch})
            self.thread = threading.get_ident()  # the thread that steps is the one to sample
            self.loop_code = self._caller()
            self.sampler = threading.Thread(target=self._sample, daemon=True, name="mmpack-doctor-stacks")
            self.sampler.start()
        if self.on_step is not None:
            self.on_step()

    def _caller(self):
        """The code of the first frame outside torch above the hook: the loop that steps."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith((self._torch, __file__)):
            frame = frame.f_back
        return frame.f_code if frame is not None else None

    def _sample(self) -> None:
        last = time.perf_counter()
        while not self.stop.wait(SAMPLE_S) and len(self.samples) < MOST_SAMPLES:
            frame = sys._current_frames().get(self.thread)
            if frame is None:
                return
            now = time.perf_counter()
            self.samples.append((now, now - last, self.label(frame)))
            last = now

    def label(self, frame) -> str | None:
        """None where the stack is in the model's work; else the user's function that holds it."""
        innermost_user = None
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(self._torch) and not name.startswith(self._torch_data):
                return None
            if innermost_user is None and not name.startswith(self._not_user) and not name.startswith("<") and (
                    frame.f_code.co_name not in INNER):
                innermost_user = frame.f_code
            frame = frame.f_back
        if innermost_user is None:
            return "other (the standard library, installed packages)"
        if innermost_user is self.loop_code:
            return LOOP
        return f"{innermost_user.co_name} ({os.path.basename(innermost_user.co_filename)}:{innermost_user.co_firstlineno})"

    def figures(self) -> OptimizerSteps | None:
        """The steps and the stack samples between the first and the last of them (None: no
        optimizer stepped)."""
        self.stop.set()
        if not self.times:
            return None
        first, last = self.times[0], self.times[-1]
        inside = [(w, label) for t, w, label in self.samples if first < t <= last]
        total = sum(w for w, _ in inside)
        by = Counter()
        for w, label in inside:
            by[label] += w
        model = by.pop(None, 0.0)
        own = by.pop(LOOP, 0.0)
        other = [GapFunction(function=label, share=w / total) for label, w in by.most_common(NAMED)] if total else []
        top = other[0].function if other else None
        top_ms = [0.0] * (len(self.times) - 1)
        for t, w, label in self.samples:  # the top function's time in each iteration: how sure its share is
            if label == top and first < t <= last:
                top_ms[bisect.bisect_left(self.times, t) - 1] += 1e3 * w
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return OptimizerSteps(steps=len(self.times), iteration=Stats.of(gaps),
                              samples=len(inside), model_share=model / total if total else None,
                              loop_share=own / total if total else None,
                              outside_share=(total - model - own) / total if total else None, functions=other,
                              top_ms=top_ms if top else None, cuda_events=self.cuda.report(),
                              iteration_ms=[1e3 * g for g in gaps])


def _folder(package: str) -> str:
    """An imported package's folder, ending in a separator (a prefix of its files' names)."""
    return os.path.join(os.path.dirname(os.path.abspath(sys.modules[package].__file__)), "")


@contextmanager
def hooked(steps: Steps):
    """`steps.hook` after every optimizer's step while active (torch 2.0 and later)."""
    try:
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook
    except ImportError:  # an older torch: loaders alone are watched
        yield
        return
    handles = [register_optimizer_step_post_hook(steps.hook), register_module_forward_pre_hook(steps.forward)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        steps.stop.set()
