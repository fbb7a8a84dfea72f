"""Background threads: one that keeps the caller's context, and a bounded read-ahead iterator."""
from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator


def thread(fn: Callable[[], None], name: str, daemon: bool = False) -> threading.Thread:
    """A thread that runs in a copy of the caller's context: the progress callback and logging of
    an orchestrator (Prefect keeps its run context in contextvars) keep working from it."""
    ctx = contextvars.copy_context()
    return threading.Thread(target=ctx.run, args=(fn,), name=name, daemon=daemon)


class Prefetch:
    """Iterate `items` in a background thread, up to `depth` items ahead; errors are re-raised
    to the consumer at the item where they happened."""

    _END = object()

    def __init__(self, items: Iterable, depth: int, name: str):
        self.wait_s = 0.0  # time the consumer spent waiting for the next item
        self.active_s = 0.0  # time from the consumer's first request to the end (or close)
        self._started: float | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._items = items
        self._thread = thread(self._run, name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._items:
                if not self._put((item, None)):
                    return
            self._put((self._END, None))
        except BaseException as e:
            self._put((None, e))
        finally:
            close = getattr(self._items, "close", None)
            if close is not None:  # a generator left early releases what it holds (pools, files)
                close()

    def _put(self, entry) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator:
        try:
            while True:
                t = time.perf_counter()
                if self._started is None:
                    self._started = t
                item, error = self._queue.get()
                self.wait_s += time.perf_counter() - t
                if error is not None:
                    raise error
                if item is self._END:
                    return
                yield item
        finally:
            self.close()  # also when the consumer stops early: the producer thread ends

    def close(self) -> None:
        if self._started is not None and not self._stop.is_set():
            self.active_s = time.perf_counter() - self._started
        self._stop.set()
        # Wait for the producer (it stops at its next item): a daemon thread still inside a torch op
        # when the interpreter exits is killed mid-frame and aborts the process ("terminate called
        # without an active exception", exit -6 instead of the CLI's code).
        if self._thread is not threading.current_thread():
            self._thread.join()
