"""The resume contract every loader keeps (`Loader`, `StatefulDataLoader`) around its `Epochs`:
set_epoch, state_dict / load_state_dict, `padding`, and the count of batches handed over (a
batch is taken when the caller gets it)."""

from __future__ import annotations

from loaders.order.sampler import Epochs, Pass


class Resumable:
    """The resume contract every loader keeps (`Loader`, `StatefulDataLoader`), around its
    `_epochs`: set_epoch, state_dict / load_state_dict, and the count of batches handed over."""

    _epochs: Epochs

    @property
    def epochs(self) -> Epochs:
        """The plan of its passes (`loaders.order.sampler.Epochs`): which ids each batch of each
        epoch holds, a pure function of integers."""
        return self._epochs

    @property
    def epoch(self) -> int:
        return self._epochs.epoch

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next pass; the epoch the loader is in keeps its cursor (a resumed one)."""
        self._epochs.set_epoch(epoch)

    def state_dict(self) -> dict:
        """Where the batches handed over so far end: load it into a loader built the same way
        (any thread, worker or rank count, any process) and iterating goes on with the next batch."""
        return self._epochs.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._epochs.load_state_dict(state)

    @property
    def padding(self):
        """Real and padded elements of the ragged column's batches handed over, per batch and per
        epoch (`loaders.padding.Padding`); None where the batches have no ragged column."""
        return self._epochs.padding

    def _counted(self, p: Pass, batches, figures=None):
        """Yield `batches` of pass `p`, each counted as taken when the caller gets it (not when it
        is made, prefetched or copied); the pass's end moves on to the next epoch. Each batch's
        padding is counted then too: from `figures` (what was measured of it on the host, in
        order), else from the batch itself."""
        taken = 0
        padding = self._epochs.padding
        if padding is not None:
            padding.begin(p, self._epochs)
        try:
            for batch in batches:
                taken += 1
                self._epochs.taken(p, taken)
                if padding is not None:
                    padding.handed(figures.popleft() if figures is not None else padding.measure(batch))
                yield batch
                del batch  # the caller's reference is the only one left
            if taken == 0:
                self._epochs.taken(p, 0)
            if padding is not None:
                padding.end()
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
