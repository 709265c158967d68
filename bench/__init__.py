"""mmpack's benchmarks. `bench.stall(loader, step_ms=...)` diagnoses any iterable loader."""

from .measure import stall

__all__ = ["stall"]
