"""`--engine ray`: a build's shard tasks as Ray tasks, the same shard function as the pool's
workers run whole (`packer.builder.shard.run_shard`), so the bytes are the same."""

from __future__ import annotations

from itertools import islice

from packer.builder.pool import Advance, Jobs
from packer.builder.shard import ShardContext, ShardResult, run_shard
from packer.errors import ConfigError


def run_ray(ctx: ShardContext, jobs: Jobs, advance: Advance, address: str | None) -> list[ShardResult]:
    """The same shard function as Ray tasks, on the cluster at `address` (None: a local one).
    Inputs and OUT must be reachable at the same paths from every Ray node (a shared FS)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--engine ray: Ray is not installed (pip install 'mmpack[ray]')") from None
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", configure_logging=False)
    remote = ray.remote(run_shard)
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    jobs = iter(jobs)
    results: list[ShardResult] = []
    pending = [remote.remote(ctx, *job) for job in islice(jobs, 2 * cpus)]
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:  # the task's own error, unwrapped
                raise (exc.cause or exc) from None
            results.append(result)
            advance(result.items)
            pending += [remote.remote(ctx, *job) for job in islice(jobs, 1)]
    return results
