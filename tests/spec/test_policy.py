"""The adaptive drafting rule (engine/spec/policy.py) on step timings it is
told: it drafts while emitted * off > on, stops when drafting is slower,
tries again so seldom that the tries cost under PROBE_OVERHEAD of the time,
comes back on when the drafts start to hit, and times only steady decode
steps past their first. (That outputs never depend on it is
test_engine_speculative.py's test_adaptive_drafting_is_exact_and_turns_off.)"""

from types import SimpleNamespace

import numpy as np
import pytest

from jaxinfer.engine.scheduler import ScheduledBatch
from jaxinfer.engine.spec.policy import PROBE_OVERHEAD, PROBE_STEPS, DraftPolicy

K = 4


def run(policy, steps, emitted, on_seconds, off_seconds, num_seqs=1, drafting=False):
    """Drive the rule like the engine: a step verifies the drafts the rule
    chose after the step before. -> (whether each step drafted, drafting at the end)."""
    decisions = []
    for _ in range(steps):
        num_drafts = [K if drafting else 0] * num_seqs
        batch = ScheduledBatch([None] * num_seqs, [1 + d for d in num_drafts], [10] * num_seqs, num_drafts)
        out = SimpleNamespace(num_emitted=np.full(num_seqs, emitted if drafting else 1))
        next_drafting = policy.should_draft(num_seqs)
        policy.record(batch, out, next_drafting, on_seconds if drafting else off_seconds)
        decisions.append(next_drafting)
        drafting = next_drafting
    return decisions, drafting


def test_drafts_while_it_pays():
    decisions, _ = run(DraftPolicy(), 200, emitted=3.0, on_seconds=2.0, off_seconds=1.0)
    # Learning the plain step's cost takes a few steps without drafts; after that it drafts every step.
    assert sum(not d for d in decisions) <= 8 and all(decisions[-150:])


def overhead(decisions, emitted, on_seconds, off_seconds):
    """The time the steps after `decisions` took over the time plain decoding
    takes for the tokens they emitted, minus one."""
    seconds = sum(on_seconds if d else off_seconds for d in decisions)
    tokens = sum(emitted if d else 1 for d in decisions)
    return seconds / (tokens * off_seconds) - 1


@pytest.mark.parametrize("on_seconds", [2.0, 3.5])
def test_stops_when_drafting_is_slower_and_tries_again_cheaply(on_seconds):
    policy = DraftPolicy()
    decisions, drafting = run(policy, 1000, emitted=1.2, on_seconds=on_seconds, off_seconds=1.0)
    late = decisions[40:]
    # Off but for tries, and the tries lose under PROBE_OVERHEAD of the time
    # (a cycle's edge may fall in the window: a little slack).
    assert PROBE_STEPS <= sum(late) <= len(late) // 10
    assert overhead(late, 1.2, on_seconds, 1.0) <= PROBE_OVERHEAD * 1.2
    # The drafts start to hit (the text changed): a later try turns drafting back on for good
    # (each try moves the running mean of emitted part of the way: the tries come closer).
    decisions, _ = run(policy, 1500, emitted=4.0, on_seconds=on_seconds, off_seconds=1.0, drafting=drafting)
    assert all(decisions[-100:])


def test_batch_sizes_are_timed_apart():
    policy = DraftPolicy()
    run(policy, 60, emitted=2.0, on_seconds=1.5, off_seconds=1.0, num_seqs=1)  # pays at batch 1
    decisions, _ = run(policy, 60, emitted=2.0, on_seconds=3.0, off_seconds=1.0, num_seqs=8)  # not at 8
    assert sum(decisions[-40:]) <= PROBE_STEPS
    assert policy.should_draft(1)


def test_only_steady_decode_steps_are_timed():
    policy = DraftPolicy()
    # A step with a prompt chunk in it (12 new tokens) and a step that starts drafting are not timed.
    prefill = ScheduledBatch([None, None], [1, 12], [10, 0], [0, 0])
    policy.record(prefill, SimpleNamespace(num_emitted=np.array([1, 1])), False, 5.0)
    start = ScheduledBatch([None], [1], [10], [0])
    policy.record(start, SimpleNamespace(num_emitted=np.array([1])), True, 5.0)
    assert all(m.count == 0 for m in policy.step_seconds.values())
    # Nor is a steady step the engine passes no time for (programs compiling
    # beside it), nor the first timed one of its kind (a program's first run).
    steady = ScheduledBatch([None], [1 + K], [10], [K])
    for seconds in (None, 50.0, 2.0):
        policy.record(steady, SimpleNamespace(num_emitted=np.array([3])), True, seconds)
    assert policy.step_seconds[(1, True)].count == 1 and policy.step_seconds[(1, True)].value == 2.0
    assert policy.emitted.count == 3 and policy.emitted.value == 3.0
