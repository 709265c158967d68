"""Tables on the terminal and PNG plots (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

import math
import re
from pathlib import Path

from .measure import load_line


def _f(v, spec: str) -> str:
    """format(v, spec), or a right-aligned '-' of the same width when there is no figure."""
    if isinstance(v, (int, float)):
        return format(v, spec)
    return "-".rjust(int(re.match(r">(\d+)", spec).group(1)))


def loaders_table(report: dict) -> str:
    by_threads = ", ".join(f"{v / 1e9:.1f} GB/s on {k} thread(s)" for k, v in report.get("memcpy_by_threads", {}).items())
    lines = [f"memcpy ({report['batch_size']}-image buffers, best over the run): {by_threads}; "
             f"{report['num_images']} images "
             f"{report['image_shape']}, batch {report['batch_size']}, cache {report['cache'].split(';')[0]}"]
    head = (f"{'system':58} {'samples/s':>11} {'MB/s':>7} {'%memcpy':>7} {'x otf':>7} {'x coll':>7} "
            f"{'1st s':>6} {'cold/s':>9} {'RSS MB':>7} {'PSS MB':>7} {'CPUs/1k':>7} {'conv s':>7} {'disk MB':>8}")
    stall = report.get("step_ms") is not None or report.get("step_mode") == "model"
    if stall:
        head += f" {'GPU util':>8}" + (f" {'%resid':>7}" if report.get("resident_samples_per_s") else "")
    lines.append(head)
    for r in report["results"]:
        name = r["system"][:58]
        if "skipped" in r or "error" in r:
            lines.append(f"{name:58} {r.get('skipped') or 'error: ' + r['error']}")
            continue
        rate = r.get("samples_per_s", r.get("tokens_per_s"))
        unit = " tok" if r["kind"] == "tokens" else ""
        line = (f"{name:58} {rate:>11,.0f} {_f(r.get('mb_per_s'), '>7,.0f')} {_f(r.get('pct_memcpy'), '>6.0f')}% "
                f"{_f(r.get('x_on_the_fly'), '>7.1f')} {_f(r.get('x_dataloader_collate'), '>7.1f')} "
                f"{r['first_batch_s']:>6.2f} {_f(r.get('cold_samples_per_s'), '>9,.0f')} {r['peak_rss_mb']:>7,.0f} "
                f"{r['peak_pss_mb']:>7,.0f} {r['cpu_s_per_1000']:>7.2f} {r['convert_s']:>7.1f} "
                f"{r['disk_bytes'] / 1e6:>8,.1f}")
        if stall and "stall" in r:
            line += f" {_f(r['stall']['gpu_util_pct'], '>7.0f')}%"
            if report.get("resident_samples_per_s"):
                line += f" {_f(r['stall'].get('pct_resident'), '>6.0f')}%"
        lines.append(line + unit)
    d = report.get("default_vs_explicit")
    if d:
        lines.append(f"Loader's default against the best explicit thread count ({d['best_explicit']}): "
                     f"first pass of a fresh Loader {d['default_first_pass_pct']:.0f}% of its first pass, steady "
                     f"{d['default_steady_pct']:.0f}% of its steady rate; a fresh Loader's first pass runs at "
                     f"{d['first_pass_of_steady_pct']:.0f}% of its steady rate (its ring is allocated in it)")
    steady = next((r for r in report["results"] if r.get("steady_pct_memcpy")), None)
    if steady:
        lines.append(f"{steady['system']}: batches after each pass's first (a long epoch's rate) "
                     f"{steady['steady_pct_memcpy']:.0f}% of the best memcpy, against {steady['pct_memcpy']:.0f}% over "
                     "whole passes, each of which starts a producer thread and waits for its first batch")
    jpeg = next((r for r in report["results"] if "of_pixel_lane_pct" in r), None)
    if jpeg:
        lines.append(f"The JPEG lane (--store jpeg, quality 90, Pillow decoding in the Loader's threads) against the "
                     "pixel lane, each at the Loader's default threads: "
                     f"{jpeg['of_pixel_lane_pct']:.0f}% of its images/s in {jpeg['bytes_of_pixel_lane_pct']:.0f}% of "
                     f"its bytes ({jpeg['bytes_per_image']:,.0f} B per image), {jpeg['cpu_s_per_1000']:.2f} CPU s per "
                     "1000 images (the decode, on the host's cores; %memcpy counts the pixels it writes)")
    mix = next((r for r in report["results"] if "of_one_source_pct" in r), None)
    if mix:
        low, high = mix.get("of_one_source_range_pct", [mix["of_one_source_pct"]] * 2)
        lines.append(f"A Mixture of 3 datasets, the same images cut in thirds (5:3:2): {mix['of_one_source_pct']:.0f}% "
                     f"({low:.0f}-{high:.0f}%) of the default Loader's rate over them as one dataset, median of 5 "
                     "rounds alternating the two (target: at least 95%)")
    lines.append("%memcpy: against memcpy on as many threads as the row uses (Loader threads, else DataLoader "
                 "workers; Loader's default: the best memcpy of any thread count); x otf: vs the on-the-fly baseline of the same kind; x coll: vs DataLoader(MMapDataset) "
                 "with default collate; RSS/PSS: peak of the whole process tree; CPUs/1k: CPU seconds per 1000 samples")
    if load_line(report.get("load")):
        lines.append(load_line(report["load"]))
    if stall and report.get("model"):
        lines.append(f"GPU util: share of wall time spent in a training step of {report['model']}, i.e. not "
                     "waiting for data")
        if report.get("resident_samples_per_s"):
            lines.append(f"%resid: the loop's images/s against the step alone on a batch already on the device "
                         f"({report['resident_samples_per_s']:,.0f} images/s)")
    elif stall:
        lines.append(f"GPU util: share of wall time spent in the {report['step_ms']} ms step "
                     f"({report['step_mode']}), i.e. not waiting for data")
    return "\n".join(lines)


def augment_table(report: dict) -> str:
    m = report["machine"]
    lines = [f"bench augment on {report['device']} ({m['gpu'] or str(m['cores']) + ' cores'}), batch "
             f"{report['batch_size']}, {report['num_images']} real photo crops, output {report['size']} px",
             f"{'Loader over':16} {'stored as':58} {'images/s':>10} {'canvas of a batch':>22} {'padding':>8} {'CPU s/1k':>9}"]
    for r in report["loaders"]:
        lines.append(f"{r['dataset']:16} {r['flags']:58} {r['images_per_s']:>10,.0f} "
                     f"{' x '.join(map(str, r['canvas'])):>22} {r.get('padding_pct', 0):>7.0f}% {r['cpu_s_per_1000']:>9.2f}")
    models = report["model_step_ms"]
    lines.append(f"{'transform':58} {'ms/batch':>9} " + " ".join(f"{'% of ' + k:>16}" for k in models)
                 + f" {'ops':>6} {'kernels':>8} {'GPU ops':>8}")
    for r in report["transforms"]:
        lines.append(f"{r['transform']:58} {r['ms']:>9.2f} " + " ".join(f"{r['pct_of_step'][k]:>15.1f}%" for k in models)
                     + f" {_f(r.get('ops'), '>6')} {_f(r.get('kernels'), '>8')} {_f(r.get('gpu_path_ops'), '>8')}")
    lines.append("ops: aten ops a call dispatches from Python (torch's profiler); kernels: the CUDA kernels it ran; "
                 "GPU ops, on a CPU: the kernels the path a GPU runs would launch, run here (views, allocations and "
                 "copies between host and device not counted)")
    lines.append("model step: one forward + backward + SGD step on the transform's output: "
                 + ", ".join(f"{k} {v:,.1f} ms" for k, v in models.items())
                 + ("; targets on an H100: train_transform < 3% of ResNet-50, < 5% of ResNet-18" if "ResNet-50" in models
                    else "; on CUDA the models are ResNet-18 and ResNet-50 (bf16, channels_last)"))
    return "\n".join(lines)


def plot_augment(report: dict, path: Path) -> None:
    plt = _plt()
    rows = report["transforms"]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.8))
    ax.barh([r["transform"] for r in rows][::-1], [r["ms"] for r in rows][::-1], color="tab:blue")
    for (name, ms), style in zip(report["model_step_ms"].items(), ("--", ":")):
        ax.axvline(ms, color="k", linestyle=style, label=f"one {name} step: {ms:,.1f} ms")
    ax.set_xscale("log")
    ax.set_xlabel(f"ms per batch of {report['batch_size']} on {report['device']} (log scale)")
    ax.set_title("bench augment: transform cost against a training step")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sampler_table(report: dict) -> str:
    lines = [f"open an order and take the first batch of {report['batch_size']} on rank 0 of "
             f"{report['world_size']}; a resumed state's first batch; each in a fresh process",
             f"{'order':26} {'samples':>16} {'seconds':>9} {'peak RSS MB above the imports':>30} {'resumed s':>9} "
             f"{'len() s':>9}"]
    for r in report["results"]:
        head = f"{r['system']:26} {r['num_samples']:>16,}"
        if "skipped" in r or "error" in r:
            lines.append(f"{head} {r.get('skipped') or 'error: ' + r['error']}")
        else:
            lines.append(f"{head} {r['seconds']:>9.4f} {r['peak_rss_mb']:>30,.1f} {_f(r.get('resume_seconds'), '>9.4f')} "
                         f"{_f(r.get('count_seconds'), '>9.4f')}")
    if any("resume_seconds" in r for r in report["results"]):
        lines.append(f"plans by length: batch {report['batch_size']}, or max_tokens {report.get('max_tokens', 0):,}, over "
                     "log-logistic lengths (median 128); their seconds are the first batch, the resumed state's apart, "
                     "and len() (the epoch's batch count: every window counted) apart")
    return "\n".join(lines)


def packer_table(report: dict) -> str:
    lines = [f"{'build':16} {'workers':>7} {'cores':>5} {'rate':>14} {'raw/core':>14} {'efficiency':>10} {'runs':>9} "
             f"{'raw scaling':>11} {'vs busy':>7} {'seconds':>8} {'shards':>6} {'out MB':>8} {'MB/s out':>8} {'% disk':>6} "
             f"{'disk wait':>9} {'peak RSS MB':>11}"]
    for r in report["builds"]:
        runs = "/".join(f"{100 * e:.0f}" for e in r.get("efficiency_runs", [r["efficiency"]]))
        what = r["what"] + (f" {r['input']}" if r.get("input", "folder") != "folder" else "")
        what += (" cold" if r.get("inputs") == "cold" else "") + ("*" if r.get("short") else "")
        lines.append(f"{what:16} {r['workers']:>7} {r['cores_used']:>5} {r['rate']:>10,.0f} {r['unit'].split('/')[0][:3]:>3} "
                     f"{r['raw_per_core']:>10,.0f}/core {100 * r['efficiency']:>9.0f}% {runs:>8}% "
                     f"{100 * r['raw_scaling']:>10.0f}% {100 * r['efficiency_busy']:>6.0f}% {r['seconds']:>8.1f} "
                     f"{r['shards']:>6} {r['size_bytes'] / 1e6:>8,.1f} {_f(r.get('written_bytes_per_s', 0) / 1e6, '>8,.0f')} "
                     f"{_f(r.get('pct_disk'), '>5.0f')}% {_f(100 * r.get('disk_wait', 0), '>8.0f')}% "
                     f"{r['peak_rss_mb']:>11,.0f}")
    lines.append("efficiency = build rate / (raw per-core rate x cores used), the median over the timed builds "
                 "(runs: each build's own, against the raw passes right before and after it); raw = Pillow "
                 "decode+resize or tokenizers batch encode alone, one core (a fresh process, one Rust thread), same "
                 "inputs, measured before the first build and after each; raw "
                 "scaling = a core's raw rate while as many processes as the build's cores used do the raw work "
                 "at once (measured after each build) / a core's raw rate alone; vs busy = build rate / (that busy "
                 "per-core rate x cores used); build rate = `packer build` in its own process, by its own clock "
                 "(scan to published manifest); cores used, as the build records it: one per worker for images, "
                 "and tokenizers' threads for text (every core when one process builds); cold: the build's inputs "
                 "evicted from the page cache before it (the raw rate stays cached); MB/s out = bytes the build wrote "
                 "per second of its run; % disk = that against the output file system's write rate with fsync, "
                 f"{report.get('disk_write_bytes_per_s', 0) / 1e6:,.0f} MB/s here (near 100%: the disk is the limit); disk wait "
                 "= the share of the workers' time spent in writes and fsyncs, as the build measures it (the build's "
                 "summary line gives it from 25%)")
    forms = _by_form(report["builds"])
    if forms:
        lines.append(forms)
    short = [r for r in report["builds"] if r.get("short")]
    if short:
        need: dict[str, int] = {}
        for r in short:
            need[r["what"]] = max(need.get(r["what"], 0), r["units_for_long_enough"])
        per_mb = _tokens_per_mb(report)
        flags = {"images": lambda n: f"--images {n}",
                 "tokens": lambda n: (f"--text-mb {math.ceil(n / per_mb)} " if per_mb else "") + f"({n:,} tokens)"}
        lines.append(f"* under {report.get('short_build_s', 5):g} s: mostly the build's start-up (worker processes, scan, publish), not how its work "
                     "scales; long enough: " + ", ".join(flags[w](n) for w, n in need.items()))
    for a in report["archives"]:
        lines.append(f"zstd -{a['level']} {a['what']:6}: {a['raw_bytes'] / 1e6:,.1f} MB -> {a['zstd_bytes'] / 1e6:,.1f} MB "
                     f"(ratio {a['ratio']:.2f}x); pack {a['pack_mb_per_s']:,.0f} MB/s, unpack+verify "
                     f"{a['unpack_mb_per_s']:,.0f} MB/s (raw bytes)")
    return "\n".join(lines)


def _by_form(builds: list[dict]) -> str:
    """Each input form's image build rate against the folder's at the same worker count (the
    target: Parquet and tars within 10%), and its peak memory beside the input's bytes."""
    folder = {r["workers"]: r["rate"] for r in builds if r["what"] == "images" and r.get("input") == "folder"
              and r.get("inputs") != "cold"}
    parts = [f"{r['input']} on {r['workers']}: {100 * r['rate'] / folder[r['workers']]:.0f}% of the folder's rate, "
             f"peak RSS {r['peak_rss_mb']:,.0f} MB for {r['input_bytes'] / 1e6:,.0f} MB of input"
             for r in builds if r.get("input", "folder") != "folder" and r["workers"] in folder and r.get("inputs") != "cold"]
    return "input forms: " + "; ".join(parts) if parts else ""


def _tokens_per_mb(report: dict) -> float | None:
    """Tokens a MB of this run's text made (what --text-mb asks for, in tokens)."""
    row = next((r for r in report["builds"] if r["what"] == "tokens"), None)
    return row["units"] / report["text_mb"] if row and report.get("text_mb") else None


def sweep_table(report: dict) -> str:
    lines = [f"{'system':24} {'axis':>8} {'value':>5} {'batch':>6} {'samples/s':>11} {'waiting':>8} {'wait p95':>9}"]
    for p in report["points"]:
        lines.append(f"{p['system']:24} {p['axis']:>8} {p['value']:>5} {p['batch_size']:>6} "
                     f"{p['samples_per_s']:>11,.0f} {100 * p['wait_share']:>7.0f}% {p['wait_p95_ms']:>6.1f} ms")
    lines.append(report["recommendation"])
    if load_line(report.get("load")):
        lines.append(load_line(report["load"]))
    return "\n".join(lines)


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'mmpack[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loaders(report: dict, path: Path, *, kind: str = "images", unit: str = "images/s (224x224x3 uint8") -> None:
    """Samples/s of the rows of `kind` on a log axis, with the memcpy limit of the most threads
    in samples of the report's size (`sample_bytes`, else an image's)."""
    plt = _plt()
    rows = [r for r in report["results"] if r["kind"] == kind and "samples_per_s" in r]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.6))
    names = [r["system"] for r in rows][::-1]
    rates = [r["samples_per_s"] for r in rows][::-1]
    colors = {"mmpack": "tab:blue", "baseline": "tab:red", "peer": "tab:gray"}
    ax.barh(names, rates, color=[colors[r["family"]] for r in rows][::-1])
    top = max(report.get("memcpy_by_threads", {"1": report["memcpy_bytes_per_s"]}).items(), key=lambda kv: int(kv[0]))
    sample_bytes = report.get("sample_bytes") or report["memcpy_bytes_per_s"] / report["memcpy_images_per_s"]
    ax.axvline(top[1] / sample_bytes, color="k", linestyle="--",
               label=f"memcpy limit ({top[0]} threads)")
    ax.set_xscale("log")
    ax.set_xlabel(f"{unit}, batch {report['batch_size']}, warm cache; log scale)")
    ax.set_title(f"{report.get('command', 'bench loaders')} on {report['machine']['cores']} cores")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(report: dict, path: Path) -> None:
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict = {}
    for p in report["points"]:
        series.setdefault((p["system"], p["axis"], p["batch_size"]), []).append(p)
    for (system, axis, bs), pts in series.items():
        xs = [p["value"] for p in pts]
        label = f"{system}, batch {bs}"
        a.plot(xs, [p["samples_per_s"] for p in pts], marker="o", label=label)
        b.plot(xs, [100 * p["wait_share"] for p in pts], marker="o", label=label)
    a.set_yscale("log")
    a.set_xlabel("worker processes (DataLoader) / threads (Loader)")
    a.set_ylabel("images/s")
    b.set_xlabel("worker processes (DataLoader) / threads (Loader)")
    b.set_ylabel(f"% of the loop waiting for data ({report['step_ms']:g} ms step)")
    from matplotlib.ticker import MaxNLocator

    for ax in (a, b):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    a.legend(fontsize=7)
    fig.suptitle(report["recommendation"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
