"""mmpack's benchmarks. `bench.stall(loader, step_ms=...)` times any iterable loader in a loop with
a stand-in step, as `bench doctor` times a training script's (`bench.doctor.watch` for a loop of
your own)."""

from .doctor import stall

__all__ = ["stall"]
