"""The resume contract (tests/loaders/test_resume_contract.py) with every dataset read from the S3
server: through limited caches, elastic across ranks, and real gloo ranks sharing a node's cache."""

from __future__ import annotations


import pytest

from packer.cli import main

from .remote import NEEDS_SERVER, _shard_bytes, _url

pytestmark = NEEDS_SERVER  # the S3 server's tests: skipped where obstore or SeaweedFS is missing


@pytest.mark.parametrize("reader", ["Loader(images)", "StatefulDataLoader(batched)", "StatefulDataLoader(MMapIterableDataset)",
                                    "Loader(Mixture)", "Loader(images, bucket_by)", "Loader(TokenWindows)", "Loader(jpeg)",
                                    "StatefulDataLoader(pairs, max_tokens)"])
def test_the_resume_contract_holds_over_urls_through_a_limited_cache(s3, built, tmp_path, reader):
    """tests/loaders/test_resume_contract.py's contract, every dataset read from the server (the
    fresh processes too), through caches limited to what the readers' random batches need."""
    from tests.loaders import test_resume_contract

    urls = {k: _url(tmp_path, k) for k in built}
    for k, url in urls.items():
        assert main(["push", str(built[k]), url]) == 0
    urls["cache_limit"] = str(max(_shard_bytes(built[k]) for k in built) * 2)
    test_resume_contract.test_resume_in_a_fresh_process_goes_on_with_the_next_batch(urls, reader)


def test_elastic_resume_and_two_gloo_ranks_over_urls(s3, built, tmp_path):
    """The elastic resume contract (a state of 2 ranks resumed on 1 and on 3) and real
    torch.distributed ranks, every dataset read from the server; the ranks share the node's cache."""
    from tests.loaders import test_loader, test_resume_contract

    urls = {"images": _url(tmp_path, "images")}  # what these readers read
    assert main(["push", str(built["images"]), urls["images"]]) == 0
    for reader in ("Loader(images)", "StatefulDataLoader(batched)"):
        test_resume_contract.test_a_state_saved_on_two_ranks_resumes_on_one_and_on_three(urls, reader)
    test_loader.test_real_torch_distributed_gloo_two_ranks(urls, tmp_path)
