"""`bench sweep`: DataLoader workers and Loader threads by batch size, each point's throughput
and the share of a loop with a stand-in step spent waiting (bench doctor's measure), and the best
setting for each batch size."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from .doctor import DATA_BOUND, stall
from .loaders_bench import PIN, _progress, machine
from .measure import MachineLoad, measure
from .peers import MP_CONTEXT
from .prepare import prepare_images


def bench_sweep(args) -> dict:
    from loaders import Loader, MMapDataset

    load = MachineLoad()
    work = Path(args.work or tempfile.mkdtemp(prefix="mmpack-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    _, out, _ = prepare_images(work, args.images)
    ds = MMapDataset(out, columns=["image", "label"])
    points = []
    for bs in args.batch_sizes:
        for w in args.workers_list:
            make = lambda w=w, bs=bs: torch.utils.data.DataLoader(  # noqa: E731
                ds, batch_size=bs, shuffle=True, num_workers=w, pin_memory=PIN,
                multiprocessing_context=MP_CONTEXT if w else None)
            points.append(_point("DataLoader(MMapDataset)", "workers", w, bs, make, args))
        for t in args.threads_list:
            make = lambda t=t, bs=bs: Loader(ds, bs, num_threads=t)  # noqa: E731
            points.append(_point("mmpack Loader", "threads", t, bs, make, args))
    # the batch size is the training's choice: the best loader setting for each one, said as the doctor says it
    best = {bs: min((p for p in points if p["batch_size"] == bs),
                    key=lambda p: (round(p["wait_share"], 2), -p["samples_per_s"])) for bs in args.batch_sizes}
    rec = "recommendation: " + "; ".join(
        f"batch {bs}: {p['system']} with {p['axis']}={p['value']}, "
        f"{'data-bound' if p['wait_share'] > DATA_BOUND else 'compute-bound'}: {100 * p['wait_share']:.0f}% of the "
        f"loop waiting (p95 {p['wait_p95_ms']:.1f} ms) with a {args.step_ms:g} ms step; {p['samples_per_s']:,.0f} "
        "samples/s alone" for bs, p in best.items())
    return {"command": "bench sweep", "machine": machine(), "load": load.report(), "step_ms": args.step_ms, "points": points,
            "recommendation": rec, "best": {str(bs): p for bs, p in best.items()}}


def _point(system, axis, value, bs, make, args) -> dict:
    r = measure(make, lambda b: len(b["label"]), passes=1)
    steps = max(3, min(args.stall_steps or 20, 20))
    s = stall(make(), args.step_ms, steps=steps, mode=args.step_mode)
    p = {"system": system, "axis": axis, "value": value, "batch_size": bs, "samples_per_s": r["samples_per_s"],
         "wait_share": s["wait_share"], "wait_p95_ms": s["wait"].get("p95_ms", 0.0), "gpu_util_pct": s["gpu_util_pct"]}
    _progress(p)
    return p
