"""What a verified draft token costs on this machine, measured while the engine runs: the
break-even acceptance rate of speculation at the current batch size.

A decode step of R rows (each running sequence's token, plus its draft tokens) takes about
`T(R) = F + r * R`: `F` the fixed part (reading the weights, launching kernels, the step's own
bookkeeping), `r` what each row adds. One sequence of a batch of B decodes that drafts k tokens,
of which a are accepted, turns a step of B rows making B tokens into one of B + k rows making
B + a tokens. That pays when

    (F + r (B + k)) / (B + a) < (F + r B) / B   <=>   a / k > r B / (F + r B) = rho(B),

the share of the step that grows with its rows. Alone on a CPU (B = 1) rho is about 0.2: a
draft token pays if one in five is accepted; in a batch of 20 it is 0.6-0.8: only drafts that
are nearly always right pay (the integer kernels' rows are cheap in a batch, the fixed part is
shared). `StepCostModel` fits F and r by exponentially weighted least squares over decode
steps (their row counts vary with the drafts), and `break_even(B)` gives rho(B): the per-draft
acceptance a sequence must keep up to go on speculating (spec_decode/backoff.py).
"""

from __future__ import annotations


class StepCostModel:
    def __init__(self, weight: float = 0.02, min_steps: int = 20) -> None:
        self.weight = weight  # of the newest step in the moving sums
        self.min_steps = min_steps  # steps seen before the fit is trusted
        self.steps = 0
        self._n = self._r = self._t = self._rr = self._rt = 0.0  # weighted sums

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step (every scheduled sequence ran its last token and its drafts)."""
        keep = 1.0 - self.weight
        self._n = keep * self._n + 1.0
        self._r = keep * self._r + rows
        self._t = keep * self._t + seconds
        self._rr = keep * self._rr + rows * rows
        self._rt = keep * self._rt + rows * seconds
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(F, r) in seconds, or None until enough steps with different row counts were seen."""
        if self.steps < self.min_steps:
            return None
        mean_r, mean_t = self._r / self._n, self._t / self._n
        var = self._rr / self._n - mean_r * mean_r
        if var < 0.25:  # rows hardly varied: the slope is not measurable yet
            return None
        slope = (self._rt / self._n - mean_r * mean_t) / var
        fixed = mean_t - slope * mean_r
        if slope <= 0 or fixed <= 0:
            return None
        return fixed, slope

    def break_even(self, batch_rows: int) -> float | None:
        """rho(B): the accepted share of draft tokens at which speculating breaks even with B
        decode rows in the step (None: not measured yet)."""
        f = self.fit()
        if f is None:
            return None
        fixed, slope = f
        b = max(1, batch_rows)
        return slope * b / (fixed + slope * b)
