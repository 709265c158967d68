"""What a cache entry brought over the link (packer.remote.traffic), against the GETs a proxy in
front of the server counted."""

from __future__ import annotations



from loaders import MMapDataset
from packer.cli import main

from .remote import NEEDS_SERVER, _same_batches, _through_proxy, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


def test_a_datasets_traffic_counts_the_gets_the_server_saw_and_the_shards_found_cached(s3, built, tmp_path,
                                                                                     monkeypatch):
    """`ds.traffic`: bytes, GETs, shards downloaded and shards found in the cache, against the
    GETs a proxy in front of the server counted (whole files and ranges alike)."""
    from packer.remote import transfer

    from ..faulty_proxy import FaultyProxy

    monkeypatch.setattr(transfer, "RANGE_BYTES", 16384)  # a large file in ranges, each a GET
    url = _url(tmp_path, "images")
    assert main(["push", str(built["images"]), url]) == 0
    local = MMapDataset(built["images"])
    proxy = FaultyProxy(s3, [], target="/shard-")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        ds = MMapDataset(url, cache_dir=tmp_path / "c")
        opened = proxy.gets  # the index files, fetched at the open
        _same_batches(ds, local)
        shards = len(local.manifest.shards)
        assert ds.traffic["gets"] == proxy.gets - opened > shards
        assert ds.traffic["bytes"] == ds.bytes_downloaded > 0
        assert ds.traffic["shard_downloads"] == shards  # (and a shard needed again later is a hit)
        again = MMapDataset(url, cache_dir=tmp_path / "c")
        _same_batches(again, local)
        got = again.traffic
        assert (got["bytes"], got["gets"], got["shard_downloads"]) == (0, 0, 0) and got["shard_hits"] >= shards
        assert proxy.gets - opened == ds.traffic["gets"]  # nothing more came over the link
    finally:
        proxy.close()
    local = MMapDataset(built["images"])
    local.traffic["gets"] += 1  # a caller's own copy: no later count of any dataset moves with it
    assert local.traffic == MMapDataset(built["images"]).node_traffic == {"bytes": 0, "gets": 0, "shard_downloads": 0,
                                                                          "shard_hits": 0}


def test_the_doctor_reports_what_a_dataloaders_workers_fetched_as_the_server_counted(s3, large_rows, tmp_path,
                                                                                   monkeypatch):
    """Forked DataLoader workers fetch in their own processes: `ds.traffic` in the script's
    process sees none of it, `ds.node_traffic` (the entry's count over every process) all of it,
    and so does the report of `bench doctor`'s watch, to the GET as the proxy counted."""
    from bench.doctor import watch
    from loaders import StatefulDataLoader

    url = _url(tmp_path, "rows")
    assert main(["push", str(large_rows), url]) == 0
    proxy = _through_proxy(s3, monkeypatch)
    try:
        ds = MMapDataset(url, cache_dir=tmp_path / "c")
        opened, body = proxy.gets, proxy.body_bytes  # the index files, fetched at the open
        loader = StatefulDataLoader(ds.batched(8, seed=1), num_workers=2, multiprocessing_context="fork", timeout=120)
        with watch(loader) as w:
            batches = sum(1 for _ in loader)
        report = w.report(ceiling=False)
        assert batches == 12 and ds.traffic["bytes"] == 0
        got = report["remote"]
        assert got["urls"] == [url] and got["gets"] == proxy.gets - opened > 12
        assert 0 < got["bytes"] <= proxy.body_bytes - body and got["shard_downloads"] == len(ds.manifest.shards)
        assert ds.node_traffic == {k: got[k] for k in ("bytes", "gets", "shard_downloads", "shard_hits")}
        assert got["bytes_per_s"] > 0 and got["gpus_on_node"] == 1
        from bench.doctor.probes import link_rate

        before = proxy.gets
        assert link_rate(loader) > 0 and proxy.gets > before  # the link measured by plain GETs, through the proxy
    finally:
        proxy.close()
