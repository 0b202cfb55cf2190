"""Tracing turns (engine/tracing_turns.py): while a thread lowers, steps and
lowerings alternate first come first served; after, steps take no turn."""

import threading
import time

from jaxinfer.engine.tracing_turns import TracingTurns


def test_back_to_back_steps_do_not_starve_a_lowering():
    """A thread stepping in a loop (as the engine does) and one lowering five
    programs: each lowering waits for at most the step under way, so the two
    alternate (a plain lock lets the stepping thread take it again at once)."""
    turns = TracingTurns()
    turns.lowering_started()
    order, stop = [], threading.Event()

    def steps():
        while not stop.is_set():
            with turns.step():
                order.append("step")
                time.sleep(0.002)

    stepping = threading.Thread(target=steps)
    stepping.start()
    time.sleep(0.02)
    for _ in range(5):
        with turns.turn():
            order.append("lower")
            time.sleep(0.002)
    stop.set()
    stepping.join(10)
    lowerings = [i for i, what in enumerate(order) if what == "lower"]
    assert len(lowerings) == 5
    assert all(b - a <= 2 for a, b in zip(lowerings, lowerings[1:]))  # at most one step between two lowerings


def test_steps_take_no_turn_once_nothing_is_left_to_lower():
    turns = TracingTurns()
    turns.lowering_started()
    turns.lowering_done()
    stepped = threading.Event()

    def step():
        with turns.step():
            stepped.set()

    with turns.turn():  # another thread's turn held: a step does not wait for it
        threading.Thread(target=step).start()
        assert stepped.wait(5)


def test_a_waiting_step_gives_its_turn_away():
    """A step waiting for the lowering thread (a bucket it makes) hands its
    turn over, so the lowering can run, and takes a turn again after."""
    turns = TracingTurns()
    turns.lowering_started()
    lowered = threading.Event()

    def lower():
        with turns.turn():
            lowered.set()

    with turns.step():
        lowering = threading.Thread(target=lower)
        lowering.start()
        assert not lowered.wait(0.2)  # the step holds the turn
        with turns.given_up():
            assert lowered.wait(5)
        order_after = threading.Event()
        threading.Thread(target=lambda: (turns._take(), order_after.set(), turns._give())).start()
        assert not order_after.wait(0.2)  # the step holds its turn again
    assert order_after.wait(5)
    lowering.join(5)
