"""`bench remote --nodes N`: a multi-node job on one machine. Each node is a set of rank
processes (started as torchrun starts them: one process a rank, RANK and WORLD_SIZE) with a cache
dir of its own, shared by its ranks, behind a link of its own to the S3 server: a pacing proxy of
`--link-mb` MB/s (`stores.link`) that also counts, at the node's side of the link, the bytes and
the GETs of each object. Every rank reads its part of each epoch in block order through
`Loader`; the epochs are in step across all ranks (a barrier, as a training step's collective
would keep them), and the counts are read at each epoch's end.

Per node, for each cache size (a share of the node's part of the dataset): the bytes over its
link each epoch against its share of the dataset, its cold epoch's rate against the link's, the
time to its ranks' first batch, and the most GETs any one shard file took at that node (one:
its ranks shared each download through the node's cache; a batch read by rows takes ranged GETs
instead). Block order keeps a rank's part of an epoch within few shards only on a dataset many
times the order's window a rank: the bench's dataset of small images (`--block-samples`).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from loaders.order.orders import WINDOW

SHARES = (1.0, 0.5, 0.25)  # cache limits, of the node's share of the dataset
EPOCHS = 2
WAIT_S = 600.0  # the longest a rank waits for the others at an epoch's edge


def _say(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def _rank(rank: int, world: int, local: int, url: str, endpoint: str, cache: str, limit: int | None, batch: int,
          epochs: int, barrier, out, window: int) -> None:
    """One rank, in its own process: EPOCHS epochs of its part, in step with every rank; a rank
    that fails (a cache limit refused) says why and breaks the barrier, so no rank waits for it."""
    os.environ.update(AWS_ENDPOINT_URL=endpoint, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local),
                      LOCAL_WORLD_SIZE=str(local))  # as torchrun sets them: a node's ranks share its cache limit
    try:
        from loaders import Loader, MMapDataset

        from .measure import timed_pass

        import warnings

        ds = MMapDataset(url, cache_dir=cache, cache_limit=limit)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            loader = Loader(ds, batch, seed=0, order="block", rank=rank, world_size=world, block_window=window)
        warned, got = [str(w.message) for w in said], []
        for _ in range(epochs):
            barrier.wait(timeout=WAIT_S)
            n, seconds, first = timed_pass(loader)
            got.append({"samples": n, "seconds": seconds, "first_batch_s": first})
            barrier.wait(timeout=WAIT_S)  # the epoch over on every rank: the parent reads the counts
        out.put((rank, {"epochs": got, "warned": warned}))
    except BaseException as exc:  # noqa: BLE001 - said to the parent, which reports the run as refused
        barrier.abort()
        said = (str(exc).splitlines() or [""])[0][:300]
        out.put((rank, {"error": f"{type(exc).__name__}: {said}" if said else type(exc).__name__,
                        "broken": isinstance(exc, threading.BrokenBarrierError)}))


def bench_nodes(url: str, endpoint: str, local, work: Path, nodes: int, ranks: int, link_mb: float,
                batch: int, shares=SHARES, window: int | None = None) -> dict:
    """The multi-node rows (see the module), one run per cache share."""
    from packer.remote import ShardCache

    total = local.manifest.size_bytes
    index = ShardCache(url, work, local.manifest).index_bytes
    runs = []
    for share in shares:
        limit = None if share >= 1.0 else int(share * total / nodes) + index
        runs.append(_run(url, endpoint, work / f"nodes-{share:g}", nodes, ranks, link_mb, batch, limit, share, total,
                         window or WINDOW))
        last = runs[-1]
        _say(f"{nodes} nodes x {ranks} ranks, cache {share:.0%} of a node's share: " + (last.get("refused") or "; ".join(
            f"node {k}: " + ", ".join(f"{e['share_of_part']:.2f}x" for e in node["epochs"])
            for k, node in enumerate(last["nodes"]))))
    return {"nodes": nodes, "ranks_per_node": ranks, "link_mb_per_s": link_mb, "order": "block",
            "block_window": window or WINDOW, "runs": runs}


def _run(url, endpoint, work: Path, nodes: int, ranks: int, link_mb: float, batch: int, limit, share: float,
         total: int, window: int) -> dict:
    from .stores import link

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter a rank, as torchrun starts them
    world = nodes * ranks
    barrier, out = ctx.Barrier(world + 1), ctx.Queue()
    counts = [{"paths": {}} for _ in range(nodes)]
    with ExitStack() as stack:
        proxies = [stack.enter_context(link(endpoint, link_mb * 1e6, counts[k])) for k in range(nodes)]
        procs = [ctx.Process(target=_rank, args=(k * ranks + r, world, ranks, url, proxies[k], str(work / f"node{k}"),
                                                 limit, batch, EPOCHS, barrier, out, window))
                 for k in range(nodes) for r in range(ranks)]
        for p in procs:
            p.start()
        per_epoch = []
        try:
            for _ in range(EPOCHS):
                barrier.wait(timeout=WAIT_S)  # every rank opened and is about to start the epoch
                before = [(c["bytes"], c["gets"]) for c in counts]
                started = time.perf_counter()
                barrier.wait(timeout=WAIT_S)
                seconds = time.perf_counter() - started
                per_epoch.append([(c["bytes"] - b, c["gets"] - g, seconds) for c, (b, g) in zip(counts, before)])
        except threading.BrokenBarrierError:
            pass
        results = dict(out.get(timeout=WAIT_S) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    # the rank whose failure broke the barrier first: the others only saw it broken
    failed = sorted((r["broken"], r["error"]) for r in results.values() if "error" in r)
    failed = [error for _, error in failed]
    if failed:
        return {"cache_share": share, "limit_bytes": limit, "refused": failed[0]}
    part = total / nodes
    rows = []
    for k in range(nodes):
        epochs = []
        for e in range(EPOCHS):
            nbytes, gets, seconds = per_epoch[e][k]
            firsts = [results[k * ranks + r]["epochs"][e]["first_batch_s"] for r in range(ranks)]
            epochs.append({"bytes": nbytes, "gets": gets, "share_of_part": nbytes / part, "seconds": seconds,
                           "link_share": nbytes / seconds / (link_mb * 1e6) if seconds else None,
                           "first_batch_s": statistics.median(firsts),
                           "samples": sum(results[k * ranks + r]["epochs"][e]["samples"] for r in range(ranks))})
        shard_files = [n for path, n in counts[k]["paths"].items() if "/shard-" in path]  # (each process reads the manifest)
        rows.append({"node": k, "epochs": epochs, "most_gets_per_object": max(shard_files, default=0),
                     "objects": len(shard_files)})
    warned = sorted({w for r in results.values() for w in r["warned"]})  # (one a rank: its own numbers)
    return {"cache_share": share, "limit_bytes": limit, "nodes": rows, "warned": warned[0] if warned else None}


def nodes_table(r: dict) -> list[str]:
    if not r:
        return []
    lines = ["", f"{r['nodes']} nodes x {r['ranks_per_node']} ranks, each node its own cache and a {r['link_mb_per_s']:g} "
                 f"MB/s link (counted at its proxy), block order (window {r.get('block_window', WINDOW):,}): bytes over the "
                 "node's link per epoch / its share of "
                 "the dataset; its cold epoch's rate / the link's; median first batch; most GETs of one object",
             f"{'cache':>6} {'node':>4}  {'epoch 1':>8} {'epoch 2':>8} {'cold/link':>9} {'first s':>8} {'GETs/obj':>8}"]
    for run in r["runs"]:
        if "refused" in run:
            lines.append(f"{run['cache_share']:>6.0%}    -  refused: {run['refused']}")
            continue
        for node in run["nodes"]:
            e = node["epochs"]
            lines.append(f"{run['cache_share']:>6.0%} {node['node']:>4}  {e[0]['share_of_part']:>7.2f}x "
                         f"{e[-1]['share_of_part']:>7.2f}x {e[0]['link_share'] or 0:>8.0%} {e[0]['first_batch_s']:>8.2f} "
                         f"{node['most_gets_per_object']:>8}")
        if run.get("warned"):
            lines.append(f"{'':>6}    -  warned: {run['warned']}")
    return lines


def plot_nodes(plt, r: dict, path: Path) -> None:
    """Each node's bytes over its link per epoch, over its share, at each cache size."""
    fig, ax = plt.subplots(figsize=(9, 4))
    labels, first, second = [], [], []
    for run in r["runs"]:
        for node in run.get("nodes", []):
            labels.append(f"{run['cache_share']:.0%}\nnode {node['node']}")
            first.append(node["epochs"][0]["share_of_part"])
            second.append(node["epochs"][-1]["share_of_part"])
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], first, width=0.4, color="#c66", label="epoch 1 (cold)")
    ax.bar([i + 0.2 for i in x], second, width=0.4, color="#4a8", label="epoch 2")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("over the node's link / its share")
    ax.set_title(f"{r['nodes']} nodes x {r['ranks_per_node']} ranks, {r['link_mb_per_s']:g} MB/s links, block order, "
                 "cache per node (share of its part)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
