"""Per-sequence back-off of proposals that keep failing: speculation's cost stays bounded where
too little is accepted (a draft model that guesses badly, text with nothing to copy).

Each sequence keeps a moving average of the share of its draft tokens that were accepted
(weight 0.2 on the latest proposal), starting from the engine's own moving average over every
proposal (weight 0.02; 1 at first): where proposals fail for everyone, a new sequence pauses
after its first miss. While its share is under `min_rate` the sequence gets no proposal for a
pause of 1, 2, 4, ... decode steps (at most `max_pause`), one probe after each; back above,
the pause starts again from 1. With nothing accepted a sequence speculates on about one step
in `max_pause`; one above the bar speculates on nearly every step
(tests/unit/test_spec_decode_backoff.py).

`min_rate` is what a draft token must be worth on this machine at this batch size: the engine
core sets it every step to the break-even share that `StepCostModel` measures
(spec_decode/step_cost.py: about 0.2 alone on a CPU, 0.6-0.8 in a batch of 20), and keeps
`DEFAULT_MIN_RATE` until that model has seen enough steps.
"""

from __future__ import annotations

DEFAULT_MIN_RATE = 0.1  # before the step cost is measured


class SpecBackoff:
    def __init__(self, min_rate: float = DEFAULT_MIN_RATE, max_pause: int = 64, weight: float = 0.2) -> None:
        self.min_rate = min_rate
        self.max_pause = max_pause
        self.weight = weight
        self._mean: dict[int, float] = {}  # seq id -> moving mean of the accepted share of its drafts
        self.engine_mean = 1.0  # the same over every sequence's proposals: a new sequence's start
        self.engine_weight = weight / 10
        self._pause: dict[int, int] = {}  # seq id -> its next pause in steps
        self._paused_until: dict[int, int] = {}  # seq id -> first step it may propose again

    def allows(self, seq_id: int, step: int) -> bool:
        return self._paused_until.get(seq_id, 0) <= step

    def observe(self, seq_id: int, num_accepted: int, num_drafted: int, step: int) -> None:
        """A proposal of `num_drafted` tokens of `seq_id`, `num_accepted` of them accepted,
        verified at `step`."""
        rate = num_accepted / max(1, num_drafted)
        self.engine_mean += self.engine_weight * (rate - self.engine_mean)
        mean = (1 - self.weight) * self._mean.get(seq_id, self.engine_mean) + self.weight * rate
        self._mean[seq_id] = mean
        if mean >= self.min_rate:
            self._pause.pop(seq_id, None)
            self._paused_until.pop(seq_id, None)
            return
        pause = self._pause.get(seq_id, 1)
        self._paused_until[seq_id] = step + 1 + pause
        self._pause[seq_id] = min(2 * pause, self.max_pause)

    def forget_all_but(self, live: set[int]) -> None:
        """Drop the state of sequences that are gone."""
        for d in (self._mean, self._pause, self._paused_until):
            for seq_id in [s for s in d if s not in live]:
                del d[seq_id]

    def __len__(self) -> int:
        return len(self._mean)
