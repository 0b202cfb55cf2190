"""When drafting pays: the adaptive on/off rule of speculative decoding.

A step that verifies drafts costs more than a plain step (1 + K rows per
sequence through the target, and the proposer's drafting); it pays only when
the drafts accepted make up for it. Both sides depend on the machine, the
model, the head and the text, so they are measured as the engine runs, per
decode batch size (power-of-two buckets, as the runner compiles them):

  on(n)    seconds of a step of n decoding sequences that verifies drafts and
           drafts again (the proposer's time included)
  off(n)   seconds of a step of n decoding sequences without drafts
  emitted  tokens a sequence emits per verification (1 + accepted drafts)

and a step drafts when emitted * off(n) > on(n): more tokens per second with
drafts than without. Only steady steps are timed (a step that verified and
drafted, or did neither, with no prompt tokens in it): the first and last
step of a drafting stretch carry half of each kind of work. Nor are the
first such step of each kind and bucket (its programs' first run pays
one-time costs, several steps' worth on the CPU), nor steps run while
programs compile in the background (the engine passes no time for them).

While drafting does not pay, it is tried again for PROBE_STEPS steps, so
that a change of text (a code request after chat, where n-gram drafts start
to hit) turns it back on; the tries are spaced so that what they lose (on(n)
- emitted * off(n) a step) stays under PROBE_OVERHEAD of the time: the worse
drafting measures, the rarer the tries (at batch 32 on the 2-core CPU a
drafting step cost ~5 plain ones). Until a bucket has been timed both ways,
it drafts first (to learn on(n) and emitted), then decodes plainly (to
learn off(n)).

Outputs never depend on this rule: verification keeps greedy and seeded
sampled outputs token-for-token whether a step drafts or not.
"""

from __future__ import annotations

import math

from jaxinfer.utils import bucket_size

# The drafting steps of a try, and the share of the time tries may lose.
PROBE_STEPS = 4
PROBE_OVERHEAD = 0.03
# Samples of a quantity before it is trusted, and the weight of a new sample
# in its running mean (exponential: a step's cost drifts with the machine).
MIN_SAMPLES = 3
SMOOTHING = 0.1


class _RunningMean:
    def __init__(self):
        self.value, self.count = 0.0, 0

    def add(self, sample: float) -> None:
        self.count += 1
        # The plain mean for the first samples, then exponential.
        self.value += (sample - self.value) * max(SMOOTHING, 1.0 / self.count)

    @property
    def known(self) -> bool:
        return self.count >= MIN_SAMPLES


class DraftPolicy:
    def __init__(self):
        self.step_seconds: dict[tuple[int, bool], _RunningMean] = {}  # (bucket, drafting) -> seconds
        self.emitted = _RunningMean()  # per sequence and verification
        self._since_probe: dict[int, int] = {}
        self._probe_left: dict[int, int] = {}
        self._first_run_seen: set[tuple[int, bool]] = set()  # (bucket, drafting): first timed step dropped

    def should_draft(self, num_decoding: int) -> bool:
        """Whether the next step, with num_decoding sequences decoding, drafts."""
        bucket = bucket_size(num_decoding, 1)
        on, off = self._seconds(bucket, True), self._seconds(bucket, False)
        if not (on.known and self.emitted.known):
            return True
        if not off.known:
            return False
        if self.emitted.value * off.value > on.value:
            return True
        if self._probe_left.get(bucket, 0):
            self._probe_left[bucket] -= 1
            return True
        self._since_probe[bucket] = self._since_probe.get(bucket, 0) + 1
        if self._since_probe[bucket] >= self.probe_interval(on.value, off.value):
            self._since_probe[bucket] = 0
            self._probe_left[bucket] = PROBE_STEPS - 1
            return True
        return False

    def probe_interval(self, on: float, off: float) -> int:
        """Plain steps between two tries of PROBE_STEPS drafting steps, so
        that the tries lose at most PROBE_OVERHEAD of the time (a try's step
        loses on - emitted * off, in plain steps on / off - emitted)."""
        loss = PROBE_STEPS * (on / off - self.emitted.value)
        return max(PROBE_STEPS, math.ceil(loss / PROBE_OVERHEAD))

    def record(self, batch, out, drafted: bool, seconds: float | None) -> None:
        """A finished step: `batch` as scheduled, its StepOutput `out`, whether
        drafts were proposed after it, and its wall time (None: not to be timed)."""
        for i, num_drafts in enumerate(batch.num_drafts):
            if num_drafts:
                self.emitted.add(float(out.num_emitted[i]))
        decode_only = all(n == 1 + d for n, d in zip(batch.num_new_tokens, batch.num_drafts))
        if seconds is None or not decode_only or batch.verifies_drafts != drafted:
            return
        kind = (bucket_size(len(batch), 1), drafted)
        if kind in self._first_run_seen:
            self._seconds(*kind).add(seconds)
        self._first_run_seen.add(kind)

    def _seconds(self, bucket: int, drafting: bool) -> _RunningMean:
        return self.step_seconds.setdefault((bucket, drafting), _RunningMean())
