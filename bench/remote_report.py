"""`bench remote`'s table and plot (`bench.remote_bench` measures)."""

from __future__ import annotations

import statistics
from pathlib import Path


def _rows_first_row(first: dict | None) -> list[str]:
    if not first:
        return []
    if "link_bytes" not in first:  # a run before the first batch's bytes were kept
        return [f"{'  its first batch by rows':34} {'':>10} {'':>8} {first['first_batch_s']:>13.3f}"]
    return [f"{'  its first batch by rows':34} {'':>10} {'':>8} {first['first_batch_s']:>13.3f} {'':>12}  "
            f"({first['link_bytes'] / 1e6:,.1f} MB over the link for a batch of {first['batch_bytes'] / 1e6:,.1f} MB: "
            "as for a dataset whose first batch's shards hold over 512 MiB)"]


def remote_table(r: dict) -> str:
    if "throttle" in r:
        from .throttle_bench import throttle_table

        return "\n".join(throttle_table(r["throttle"]))
    if "peer_cache" in r:
        return "\n".join([f"bench remote --peers --peer-cache {r['peer_cache']:g}: {r['images']:,} images in "
                          f"{r['shards']} shards ({r['dataset_bytes'] / 1e6:,.0f} MB), batch {r['batch_size']}, "
                          f"from {r['url']}", *_peer_rows(r)])
    if "cold" not in r:  # --nodes
        from .nodes_bench import nodes_table

        return "\n".join([f"{r['images']:,} images in {r['shards']} shards, {r['dataset_bytes'] / 1e6:,.0f} MB, batch "
                          f"{r['batch_size']}, from {r['url']}", *nodes_table(r["nodes"])])
    cold, zc = r["cold"], r["zstd_cold"]
    lines = [f"{r['images']:,} images in {r['shards']} shards, {r['dataset_bytes'] / 1e6:,.0f} MB, batch {r['batch_size']}, "
             f"from {r['url']} ({r['downloads_at_once']} downloads at once)",
             f"{'':34} {'images/s':>10} {'MB/s':>8} {'first batch s':>13} {'of the limit':>12}",
             f"{'raw GET of every file':34} {'':>10} {r['raw_get_bytes_per_s'] / 1e6:>8,.0f} {'':>13} {'100%':>12}",
             f"{'raw GET of every file, into files':34} {'':>10} {r['raw_get_to_files_bytes_per_s'] / 1e6:>8,.0f} {'':>13} "
             f"{100 * r['raw_get_to_files_bytes_per_s'] / r['raw_get_bytes_per_s']:>11.0f}%  (the cache's disk: the "
             "node's own limit)",
             f"{'local disk (warm page cache)':34} {r['local_samples_per_s']:>10,.0f} {'':>8} {'':>13} {'100%':>12}",
             f"{'remote, cold (empty cache)':34} {statistics.median(c['samples_per_s'] for c in cold):>10,.0f} "
             f"{statistics.median(c['bytes_per_s'] for c in cold) / 1e6:>8,.0f} "
             f"{statistics.median(c['first_batch_s'] for c in cold):>13.3f} {100 * r['cold_of_raw_get']:>11.0f}%  "
             f"({100 * r['cold_of_raw_get_to_files']:.0f}% of the GETs into files)",
             *_rows_first_row(r.get("cold_rows_first")),
             f"{'remote, zstd -' + str(r['zstd_level']) + ', cold (empty cache)':34} "
             f"{statistics.median(c['samples_per_s'] for c in zc):>10,.0f} "
             f"{statistics.median(c['bytes_per_s'] for c in zc) / 1e6:>8,.0f} "
             f"{statistics.median(c['first_batch_s'] for c in zc):>13.3f} "
             f"{100 * statistics.median(c['bytes_per_s'] for c in zc) / r['raw_get_bytes_per_s']:>11.0f}%  "
             f"({statistics.median(c['link_share'] for c in zc):.2f}x the dataset's bytes over the link)",
             *_link_rows(r),
             f"{'remote, warm (cache full)':34} {r['warm_samples_per_s']:>10,.0f} {'':>8} {'':>13} "
             f"{100 * r['warm_of_local']:>11.0f}%  (alternated with local disk, best of 4 passes a round)",
             "", "cache limit (share of the dataset): bytes over the link per epoch / the dataset's, epochs 1 and 2, "
             "counted by a proxy in front of the server (`ds.traffic` where there is none); epoch 2's GET requests "
             "and shards found in the cache",
             f"{'order':12} {'limit':>6} {'epoch 1':>8} {'epoch 2':>8} {'images/s 2':>10} {'cache MB':>9} "
             f"{'GETs 2':>7} {'hits 2':>7}"]
    for row in r["limits"]:
        head = f"{row['order']:12} {100 * row['limit_share']:>5.0f}%"
        if row.get("images", r["images"]) != r["images"]:
            head = f"{row['order'] + ' (' + format(row['images'], ',') + ' small)':30} {100 * row['limit_share']:>5.0f}%"
        if "refused" in row:
            lines.append(f"{head} refused: {row['refused'][:110]}")
        else:
            e = row["epochs"]
            share = "link_share" if "link_share" in e[0] else "downloaded_share"
            lines.append(f"{head} {e[0][share]:>7.2f}x {e[1][share]:>7.2f}x "
                         f"{e[1]['samples_per_s']:>10,.0f} {row['cache_bytes'] / 1e6:>9,.1f} "
                         f"{e[1].get('link_gets', e[1].get('gets', 0)):>7,} {e[1].get('shard_hits', 0):>7,}")
    lines.append("")
    for order in dict.fromkeys(x.get("order", "sequential") for x in r["ranks"]):
        rows = [x for x in r["ranks"] if x.get("order", "sequential") == order]
        shares = ", ".join(f"{x['downloaded_share']:.2f}x" for x in rows)
        touched = ", ".join(f"{x['touched_share']:.2f}x" for x in rows if "touched_share" in x)
        lines.append(f"{len(rows)} ranks, each its own cache, one epoch, {order} order ({rows[0].get('images', r['images']):,} "
                     f"images): each reads shards of {touched or '?'} of the dataset; downloaded per rank {shares} "
                     "(with the next epoch's first 64 batches)")
    lines += _peer_rows(r)
    return "\n".join(lines)


def _peer_rows(r: dict) -> list[str]:
    """Each system over the same server, through a counting proxy: cold and warm epochs."""
    if not r.get("peers"):
        return []
    total = r["dataset_bytes"]
    lines = ["", "the same pixels over the same server, each system's own S3 reader and cache; bytes and GETs counted "
             "by a proxy (answers' bytes with their headers)",
             f"{'system':58} {'epoch':>5} {'images/s':>9} {'first s':>8} {'link/dataset':>12} {'GETs':>7}"]
    for row in r["peers"]:
        if "epochs" not in row:
            lines.append(f"{_system(row['system'])[:58]:58} {row.get('skipped') or row.get('error')}"[:160])
            continue
        for name, e in zip(("cold", "warm"), row["epochs"]):
            lines.append(f"{_system(row['system'])[:58]:58} {name:>5} {e['samples_per_s']:>9,.0f} {e['first_batch_s'] or 0:>8.2f} "
                         f"{e['link_bytes'] / total:>11.2f}x {e['gets']:>7,}")
    return lines


def _link_rows(r: dict) -> list[str]:
    x = r.get("link")
    if not x:
        return []
    head = f"link of {x['link_mb_per_s']:g} MB/s"
    rows = [f"{head + ', raw GET of every file':34} {'':>10} {x['raw_get_bytes_per_s'] / 1e6:>8,.0f} {'':>13} "
            f"{'100%':>12}"]
    for name, c in (("plain", x["plain"]), (f"zstd -{r['zstd_level']}", x["zstd"]), ("JPEG lane", x.get("jpeg"))):
        if c is None:
            continue
        rows.append(f"{head + ', cold, ' + name:34} {c['samples_per_s']:>10,.0f} {c['bytes_per_s'] / 1e6:>8,.0f} "
                    f"{c['first_batch_s']:>13.3f} {100 * c['bytes_per_s'] / x['raw_get_bytes_per_s']:>11.0f}%  "
                    f"({c['link_share']:.2f}x the dataset's bytes over the link)")
    return rows


def plot_remote(r: dict, path: Path) -> None:
    from .report import _plt

    plt = _plt()
    if "throttle" in r:
        from .throttle_bench import plot_throttle

        return plot_throttle(plt, r["throttle"], path)
    if "peer_cache" in r:
        return _plot_peers(plt, r, path)
    if "cold" not in r:  # --nodes
        from .nodes_bench import plot_nodes

        return plot_nodes(plt, r["nodes"], path)
    peers = [x for x in r.get("peers") or [] if x.get("epochs")]
    fig, axes = plt.subplots(1, 3 if peers else 2, figsize=(17 if peers else 11, 4.4))
    a, b = axes[0], axes[1]
    names = ["local disk", "cold", f"cold,\nzstd -{r['zstd_level']}", "warm"]
    rates = [r["local_samples_per_s"], statistics.median(c["samples_per_s"] for c in r["cold"]),
             statistics.median(c["samples_per_s"] for c in r["zstd_cold"]), r["warm_samples_per_s"]]
    colors = ["#888", "#c66", "#c96", "#4a8"]
    if r.get("link"):
        mb = format(r["link"]["link_mb_per_s"], "g")
        names[3:3] = [f"cold,\n{mb} MB/s link", f"cold, zstd,\n{mb} MB/s link"]
        rates[3:3] = [r["link"]["plain"]["samples_per_s"], r["link"]["zstd"]["samples_per_s"]]
        colors[3:3] = ["#a44", "#a74"]
    a.bar(names, rates, color=colors)
    a.set_yscale("log")
    a.tick_params(axis="x", labelsize=7)
    a.set_ylabel("images/s (log scale)")
    a.set_title(f"Loader, batch {r['batch_size']}")
    rows = [x for x in r["limits"] if "refused" not in x]
    labels = [f"{x['order']} {100 * x['limit_share']:.0f}%" + (f" ({x['images']:,} small)" if x["images"] != rows[0]["images"]
                                                               else "") for x in rows]
    shares = [x["epochs"][-1].get("link_share", x["epochs"][-1]["downloaded_share"]) for x in rows]
    b.bar(range(len(rows)), shares, color=["#4c72b0" if x["order"] == "sequential" else "#55a868" if x["order"] == "block"
                                           else "#c44e52" for x in rows])
    b.set_xticks(range(len(rows)), labels, rotation=55, ha="right", fontsize=7)
    b.axhline(1.0, color="k", lw=0.8)
    b.set_ylabel("over the link per epoch / dataset")
    b.set_title("cache limits (epoch 2, counted at a proxy)")
    if peers:
        _peers_panel(axes[2], peers)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _system(name: str) -> str:
    """A row's system, short: 'mmpack, block order, ...' for mmpack's Loader over its URL."""
    if name.startswith("mmpack Loader over "):
        rest = name[len("mmpack Loader over "):]
        return "mmpack" + (rest[rest.index(","):] if "," in rest else "")
    head, _, tail = name.partition(" (")
    return head + (tail[tail.index(")") + 1:] if ")" in tail else "")


def _peers_panel(c, peers: list[dict]) -> None:
    """Each system's cold and warm images/s, one bar each."""
    for k, (epoch, color) in enumerate((("cold", "#c66"), ("warm", "#4a8"))):
        c.barh([i + 0.4 * k for i in range(len(peers))], [x["epochs"][k]["samples_per_s"] for x in peers],
               height=0.4, color=color, label=epoch)
    c.set_yticks([i + 0.2 for i in range(len(peers))], [_system(x["system"]) for x in peers], fontsize=8)
    c.invert_yaxis()
    c.set_xscale("log")
    c.set_xlabel("images/s (log scale)")
    c.set_title("each system's own S3 reader, same server")
    c.legend(loc="lower right", fontsize=8)


def _plot_peers(plt, r: dict, path: Path) -> None:
    """--peer-cache: images/s, and what crossed the link an epoch with the mean request's size."""
    peers = [x for x in r["peers"] if x.get("epochs")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(16, 1.2 + 0.7 * max(len(peers), 1)))
    _peers_panel(a, peers)
    for k, (epoch, color) in enumerate((("cold", "#c66"), ("warm", "#4a8"))):
        shares = [x["epochs"][k]["link_bytes"] / r["dataset_bytes"] for x in peers]
        b.barh([i + 0.4 * k for i in range(len(peers))], shares, height=0.4, color=color, label=epoch)
        for i, (x, v) in enumerate(zip(peers, shares)):
            e = x["epochs"][k]
            b.text(v, i + 0.4 * k, f" {e['gets']:,} GETs, {e['link_bytes'] / max(e['gets'], 1) / 1e6:,.2f} MB each",
                   va="center", fontsize=7)
    b.set_yticks([i + 0.2 for i in range(len(peers))], [""] * len(peers))
    b.invert_yaxis()
    b.set_xlim(0, 1.6 * max([1.2] + [e["link_bytes"] / r["dataset_bytes"] for x in peers for e in x["epochs"]]))
    b.axvline(1.2, color="k", lw=0.8, ls="--")
    b.set_xlabel("over the link an epoch / the dataset (target 1.2x, dashed)")
    b.set_title(f"through a cache of {r['peer_cache']:.0%} of each dataset")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
