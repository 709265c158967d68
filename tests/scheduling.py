"""The order in which the suite's test processes take its tests (pytest-xdist's scheduler, made by
tests/conftest.py): whole files, as `--dist loadfile`, then the tests marked `timing` (conftest
puts them in the xdist group "timing") last, in one process while no other test runs, since a
test beside them slows what they time."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

TIMING = "timing"


class TimingLast(LoadScopeScheduling):
    """Files to whichever process is free; the timing tests, one unit, held until they are all that
    is left, then given to the last process running while the others stop."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        # files in collection order, which conftest sorts slowest first (SLOW_FIRST), not by
        # their count of tests as xdist 3.6 and later reorder them: a long file started last kept
        # one process busy while the other waited to start the timing tests
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        """A test's file; a timing test's group (xdist ends its id with "@timing" under loadgroup)."""
        return TIMING if nodeid.endswith("@" + TIMING) else nodeid.split("::", 1)[0]

    def _assign_work_unit(self, node) -> None:
        if TIMING in self.workqueue and len(self.workqueue) > 1:
            self.workqueue.move_to_end(TIMING)  # every file first
        others = [other for other in self.nodes if other is not node]
        if next(iter(self.workqueue)) != TIMING or not others:
            super()._assign_work_unit(node)
        elif any(not other.shutting_down for other in others):
            node.shutdown()  # (after its last test) another process takes the timing tests once its files are done
        # else: the others are ending their last test; remove_node hands the timing tests to this one

    def remove_node(self, node):
        crashed = super().remove_node(node)
        for other in self.nodes:
            self._reschedule(other)
        return crashed
