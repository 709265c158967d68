"""Datasets in object storage, one package with one interface: the URL (`url`), the client and
its helper for forked processes (`client`, `helper`), whole files up and down (`transfer`:
push, pull, a file fetched verified), the node's cache of a dataset (`entry`, `cache`, `ledger`,
`limits`: what a limit must hold) and what one process holds of it for a batch source
(`residency`: the shards and rows a gather asks for, and the next uses the loader's lookahead,
`loaders.lookahead`, tells it).

It imports the format (`packer.dataset`) and is never imported by it: a local dataset needs
none of this. `loaders` opens URLs through it.
"""

from packer.remote.cache import ShardCache
from packer.remote.entry import build_dir, materialize, open_cached
from packer.remote.limits import check_first_batches, check_limit, check_workers, parse_limit
from packer.remote.transfer import DEFAULT_CACHE, DOWNLOADS, pull, push, push_staging, read_manifest, read_published
from packer.remote.url import SCHEMES, Remote, is_url

__all__ = ["DEFAULT_CACHE", "DOWNLOADS", "SCHEMES", "Remote", "ShardCache", "build_dir",
           "check_first_batches", "check_limit", "check_workers", "is_url", "materialize", "open_cached", "parse_limit", "pull",
           "push", "push_staging", "read_manifest", "read_published"]
