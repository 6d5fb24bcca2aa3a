"""Work done ahead of its reader: the same items in the same order, made before they are asked for, a worker's
error raised where it happened, and a closed reader stops its worker."""
from __future__ import annotations

import threading

import pytest

from engine.train.ahead import Ahead


def test_items_come_in_order_and_are_made_before_they_are_asked_for():
    third_made = threading.Event()

    def items():
        for i in range(6):
            yield i * i
            if i == 2:
                third_made.set()   # runs once the worker has gone past the third item

    with Ahead(items(), depth=2) as ahead:
        assert next(ahead) == 0
        # the reader holds item 0 only; the worker makes items 1 and 2 (depth 2) without being asked
        assert third_made.wait(timeout=30)
        assert list(ahead) == [1, 4, 9, 16, 25]
        assert ahead.waited_s >= 0
        with pytest.raises(StopIteration):
            next(ahead)


def test_a_workers_error_is_raised_after_the_items_before_it():
    def items():
        yield "a"
        yield "b"
        raise ValueError("shard 3 is corrupt")

    ahead = Ahead(items(), depth=4)
    assert [next(ahead), next(ahead)] == ["a", "b"]
    with pytest.raises(ValueError, match="shard 3 is corrupt"):
        next(ahead)
    with pytest.raises(StopIteration):   # nothing after the error
        next(ahead)
    ahead.close()


def test_closing_stops_an_endless_worker_and_runs_its_clean_up():
    cleaned = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            cleaned.set()

    ahead = Ahead(endless(), depth=1, name="endless")
    assert next(ahead) == 0 and next(ahead) == 1
    ahead.close()
    assert cleaned.is_set() and not ahead._thread.is_alive()
    with pytest.raises(StopIteration):
        next(ahead)


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        Ahead(iter([]), depth=0)
