"""Work done ahead of its reader: an iterator run on a worker thread, a few items in advance.

A training step on a GPU is short next to building its batch on the CPU (reading a shard, padding sequences,
gathering soft labels); built in the training thread, each batch leaves the GPU idle while it is made. Here
the next batches are built while the current one trains, in the same order, and whatever the worker raises
(a corrupt shard, say) is raised to the reader at the item where it happened, never earlier.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_END = object()   # the worker's iterator is exhausted


class Ahead(Generic[T]):
    """Iterates `items` on a daemon thread, at most `depth` items ahead of `next()`. `waited_s` is the time the
    reader has spent waiting for an item (the work it did not hide). `close()` stops the worker; items it had
    made are dropped."""

    def __init__(self, items: Iterator[T], depth: int = 2, name: str = "ahead") -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, not {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.waited_s = 0.0
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(items,), name=name, daemon=True)
        self._thread.start()

    def _put(self, entry: tuple) -> bool:
        """Queue `entry` unless the reader closed us first; whether it was queued."""
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, items: Iterator[T]) -> None:
        try:
            for item in items:
                if not self._put((item, None)):
                    return
            self._put((_END, None))
        except BaseException as exc:   # handed to the reader, raised where the item would have been
            self._put((None, exc))
        finally:   # a generator's own clean-up (a reader thread it holds, say) runs here, on its thread
            closing = getattr(items, "close", None)
            if closing is not None:
                closing()

    def __iter__(self) -> "Ahead[T]":
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        start = time.perf_counter()
        item, exc = self._queue.get()
        self.waited_s += time.perf_counter() - start
        if exc is not None:
            self._done = True
            raise exc
        if item is _END:
            self._done = True
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop the worker (after the item it is making) and drop what it made."""
        self._stop.set()
        self._done = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=60)

    def __enter__(self) -> "Ahead[T]":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
