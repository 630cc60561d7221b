"""The engine's state lock lets a waiting inspector in between steps (kvql.engine.turns)."""

from __future__ import annotations

import threading

from kvql.engine.turns import Turns


def test_a_thread_waiting_for_the_state_gets_it_before_the_next_step():
    turns, order, stepping, stop = Turns(), [], threading.Event(), threading.Event()

    def engine():
        while not stop.is_set():
            with turns.for_step():
                order.append("step")
                stepping.set()

    thread = threading.Thread(target=engine)
    thread.start()
    stepping.wait()
    for _ in range(20):  # each waiter gets in while the engine steps without a pause
        with turns:
            order.append("inspect")
    stop.set()
    thread.join()
    assert order.count("inspect") == 20 and order.count("step") >= 1


def test_it_is_reentrant_and_a_step_inside_an_entry_point_does_not_wait_for_itself():
    turns = Turns()
    with turns:
        with turns.for_step():
            with turns:
                pass
