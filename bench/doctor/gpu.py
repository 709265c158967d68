"""The GPU side of the watched loop: NVML's utilisation sampled in a thread, CUDA events on the
script's stream at each hand-over, and the host-to-GPU copies it makes. No CUDA call of the
doctor's own before the script has started CUDA."""

from __future__ import annotations

import os
import threading
import time

from .report import CopyFigures, CudaEvents, GpuUtil, Stats, share

NVML_PERIOD_S = 1.0  # the longest period one NVML utilisation reading covers


class Nvml:
    """The GPU's utilisation as NVML gives it (what nvidia-smi shows: the share of time a kernel
    ran), sampled while the loop runs, of the first device CUDA_VISIBLE_DEVICES names (else
    device 0). NVML only, never CUDA: a CUDA call here, before the script forks its workers,
    could keep them from using CUDA. `None` from `start()` where there is no NVML (no NVIDIA
    driver, or no `pip install nvidia-ml-py`)."""

    def __init__(self, nvml, handle, every_s: float):
        self.nvml, self.handle, self.every_s, self.samples = nvml, handle, every_s, []
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="mmpack-doctor-nvml").start()

    @classmethod
    def start(cls, every_s: float = 0.2) -> Nvml | None:
        try:
            import pynvml

            pynvml.nvmlInit()
            first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first)) if first.isdigit() else \
                pynvml.nvmlDeviceGetHandleByUUID(first)
            pynvml.nvmlDeviceGetUtilizationRates(handle)
            return cls(pynvml, handle, every_s)
        except Exception:  # noqa: BLE001 - no NVML here: the report says so
            return None

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                self.samples.append((time.perf_counter(), self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))
            except Exception:  # noqa: BLE001 - a sample missed is not the script's failure
                pass

    def report(self, start: float | None = None, end: float | None = None) -> GpuUtil:
        """Over the watched loop, from `start` to `end` (perf_counter), not the script's start-up
        (imports, data set-up, the model's first kernels), which would dilute the figure; the
        whole run's mean beside it. A reading covers NVML's own sample period before it (1/6 s
        to 1 s, by the product): the readings of the loop's first second, which still hold the
        idle time before it, are left out where later ones exist."""
        self.stop.set()
        every = [u for _, u in self.samples]
        whole = start is None or end is None  # no loop to bound it
        inside = [(t, u) for t, u in self.samples if whole or start < t <= end]
        settled = [u for t, u in inside if whole or t > start + NVML_PERIOD_S]
        ordered = sorted(settled or [u for _, u in inside])
        return GpuUtil(samples=len(ordered), util_mean_pct=sum(ordered) / len(ordered) if ordered else None,
                       util_p50_pct=ordered[len(ordered) // 2] if ordered else None,
                       run_samples=len(every), run_util_mean_pct=sum(every) / len(every) if every else None,
                       readings=[[round(t - (start or 0.0), 2), u] for t, u in inside])


def _cuda_started() -> bool:
    """Whether the script has started CUDA itself: only then may the doctor make CUDA calls (its
    own first one, before the script forks its workers, could keep them from using CUDA)."""
    import torch

    return torch.cuda.is_initialized()


class CudaMarks:
    """The loop on the GPU's own clock: a CUDA event on the current stream where each batch is
    handed over ("start") and where the next is asked for ("end"). A stream runs its work in
    order, so from a step's end to the next batch's hand-over it has only what was queued before
    to do: where that is nothing, the GPU waited for the data (or for what `next()` queued, such
    as copies). That gap holds whatever the host's clock says of a script that queues its steps
    ahead. An epoch's end is marked "end" again where the next epoch's first batch is asked for:
    what the script did between (an evaluation pass, a checkpoint) is neither step nor wait, as on
    the host's clock. Recorded only once the script has started CUDA; at most MOST events."""

    MOST = 20_000

    def __init__(self):
        self.marks: list = []

    def mark(self, kind: str) -> None:
        if len(self.marks) < self.MOST and _cuda_started():
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((kind, event))

    def report(self) -> CudaEvents | None:
        """The GPU's time from each hand-over to the next ask (`busy`) and from each ask to the
        next hand-over (`gap`: a later epoch's first batch too); `gap_share` the gaps' share of both;
        `step` from one hand-over to the next within an epoch."""
        if not self.marks:
            return None
        import torch

        kinds = [k for k, _ in self.marks]
        steps, gaps, busy = [], [], []
        try:
            torch.cuda.synchronize()
            for i in range(len(kinds) - 1):
                a, b = self.marks[i][1], self.marks[i + 1][1]
                if kinds[i:i + 2] == ["start", "end"]:
                    busy.append(a.elapsed_time(b) / 1e3)
                elif kinds[i:i + 2] == ["end", "start"] and i:  # the first: the loader's start-up, as on the host
                    gaps.append(a.elapsed_time(b) / 1e3)
                    if kinds[i - 1] == "start":
                        steps.append(self.marks[i - 1][1].elapsed_time(b) / 1e3)
        except RuntimeError:  # events of two devices (a script that switched), a CUDA error: no figure
            return None
        if not steps:
            return None
        return CudaEvents(steps=len(steps), step=Stats.of(steps), gap=Stats.of(gaps),
                          gap_share=share(sum(gaps), sum(busy)))


class Copies:
    """Host-to-device copies made with `Tensor.to` or `Tensor.cuda` while watched: how many, their
    bytes, how many of those from pinned memory, and the host's time blocked in the calls (a copy
    from pageable memory blocks until it is done; a `non_blocking` one from pinned memory does
    not). No CUDA call: a copy is known by the result's device."""

    def __init__(self, kept=None):
        self.kept = kept  # a replay's batches (`rerun.Kept`): their copies made once
        self.copies = self.bytes = self.pinned_bytes = 0
        self.blocked_s = 0.0
        self.active = False  # from the loop's first batch on: not the model's move to the GPU

    def wrap(self, original):
        copies = self

        def method(tensor, *args, **kwargs):
            started = time.perf_counter()
            if copies.kept is not None:
                return copies.kept.device_copy(tensor, args, kwargs, lambda: original(tensor, *args, **kwargs))
            out = original(tensor, *args, **kwargs)
            if copies.active and out is not tensor and out.device.type == "cuda" and tensor.device.type == "cpu":
                copies.blocked_s += time.perf_counter() - started
                copies.copies += 1
                copies.bytes += tensor.nbytes
                copies.pinned_bytes += tensor.nbytes if tensor.is_pinned() else 0
            return out
        return method

    def report(self, batches: int) -> CopyFigures | None:
        if not self.copies:
            return None
        return CopyFigures(copies=self.copies, bytes=self.bytes, bytes_per_batch=self.bytes / max(batches, 1),
                           pinned_share=self.pinned_bytes / self.bytes if self.bytes else None,
                           blocked_s=self.blocked_s)
