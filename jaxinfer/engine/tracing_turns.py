"""Turns at JAX's tracing between engines' steps and background lowering.

A cold start lowers (traces) only the programs its first buckets need
before serving; a background thread lowers the rest while the engine
serves (engine/compiled_programs.py). JAX calls its support for tracing on
two threads at once limited, and an earlier version that lowered beside
the serving thread failed now and then inside JAX's lowering (a KeyError on
a jaxpr variable). So while any thread still has programs to lower, every
lowering and every engine step (engine.py, LLMEngine.step: scheduling,
dispatch, the proposers' own programs) takes a turn, first come first
served: a step waits for at most one program's lowering, and the lowering
is not starved by steps that follow each other back to back (a plain lock
is taken again by the thread that just released it). Once nothing is left
to lower, a step takes no turn at all (data-parallel replicas then step
side by side again).
"""

from __future__ import annotations

import contextlib
import itertools
import threading


class TracingTurns:
    def __init__(self):
        self._cond = threading.Condition()
        self._tickets = itertools.count()
        self._now_serving = 0  # the ticket whose turn it is
        self._holder: int | None = None  # the thread holding the turn
        self._lowering = 0  # threads with programs left to lower (lowering_started / lowering_done)

    def lowering_started(self) -> None:
        """A thread will lower programs while engines step (called before
        the engine serves, so that no step already under way misses it)."""
        with self._cond:
            self._lowering += 1

    def lowering_done(self) -> None:
        with self._cond:
            self._lowering -= 1

    def _take(self) -> None:
        with self._cond:
            ticket = next(self._tickets)
            self._cond.wait_for(lambda: self._now_serving == ticket)
            self._holder = threading.get_ident()

    def _give(self) -> None:
        with self._cond:
            self._holder = None
            self._now_serving += 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def turn(self):
        """A background lowering's turn."""
        self._take()
        try:
            yield
        finally:
            self._give()

    @contextlib.contextmanager
    def step(self):
        """An engine step's turn, where some thread still lowers."""
        if not self._lowering or self._holder == threading.get_ident():
            yield
            return
        with self.turn():
            yield

    @contextlib.contextmanager
    def given_up(self):
        """This thread's turn given away while it waits for a background
        thread (a step waiting for a bucket that thread is still making), and
        taken again after."""
        if self._holder != threading.get_ident():
            yield
            return
        self._give()
        try:
            yield
        finally:
            self._take()


TRACING_TURNS = TracingTurns()
