"""What a loader's batches spend on padding: the real and padded elements of a ragged column
(tokens, audio frames) in the batches handed over, per batch and per epoch (`loader.padding`),
so that the cost of batches of random lengths, and what `bucket_by="length"` or `max_tokens`
save of it, is a figure rather than a guess."""

from __future__ import annotations


class Padding:
    """Counts of the batches handed over, from their `{column}_lengths`: `batch` the last one's,
    `epoch` the epoch in progress's (`epochs` every epoch's so far, one small dict each).

    Each figure: batches, samples, real elements (the samples' lengths), padded elements
    (samples x the batch's longest, what the batch's tensor holds), `share` (1 - real / padded);
    with a budget, `over_budget`: samples longer than the budget alone, each a batch of one;
    `repeated_batches`: batches of the epoch's last round repeated so every rank has as many;
    `dropped_batches`: that round's batches dropped instead (drop_last)."""

    def __init__(self, column: str, budget=None):
        self.column, self.budget = column, budget
        self.batch: dict | None = None
        self.epochs: dict[int, dict] = {}
        self._epoch, self._b, self._pass = 0, 0, None  # the pass's (Pass, its epochs)

    @property
    def epoch(self) -> dict | None:
        return self.epochs.get(self._epoch)

    def begin(self, p, epochs) -> None:
        """A pass starts: its epoch's figures go on from where a resumed or earlier pass left them."""
        self._epoch, self._b, self._pass = p.epoch, 0, (p, epochs)
        self.epochs.setdefault(p.epoch, _zeros(self.budget is not None))

    def end(self) -> None:
        """The pass went to its end: the batches of its last round dropped (drop_last) are known."""
        p, epochs = self._pass
        self.epochs[p.epoch]["dropped_batches"] = epochs.dropped(p)

    def measure(self, batch) -> tuple[int, int, int, int]:
        """(samples, real, padded, over budget) of a batch on the host."""
        lengths = batch[f"{self.column}_lengths"].numpy()
        n = len(lengths)
        longest = int(lengths.max()) if n else 0
        over = int(n == 1 and self.budget is not None and bool(self.budget.over(lengths)[0]))
        return n, int(lengths.sum()), n * longest, over

    def handed(self, figure: tuple[int, int, int, int]) -> None:
        n, real, padded, over = figure
        self.batch = {"samples": n, "real": real, "padded": padded, "share": _share(real, padded)}
        totals = self.epochs[self._epoch]
        totals["batches"] += 1
        totals["samples"] += n
        totals["real"] += real
        totals["padded"] += padded
        totals["share"] = _share(totals["real"], totals["padded"])
        if self.budget is not None:
            totals["over_budget"] += over
        p, epochs = self._pass
        if epochs.repeats(p, self._b):
            totals["repeated_batches"] += 1
        self._b += 1

    def __repr__(self) -> str:
        e = self.epoch
        where = f"epoch {self._epoch}: {e['share']:.1%} of {e['padded']:,} elements padding" if e else "no batch yet"
        return f"Padding({self.column!r}; {where})"


def _zeros(budget: bool) -> dict:
    figures = {"batches": 0, "samples": 0, "real": 0, "padded": 0, "share": 0.0, "repeated_batches": 0,
               "dropped_batches": 0}
    if budget:
        figures["over_budget"] = 0
    return figures


def _share(real: int, padded: int) -> float:
    return 1 - real / padded if padded else 0.0
