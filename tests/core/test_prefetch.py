"""drafter.prefetch.Prefetch: the read-ahead thread ends before close() returns.

A producer thread left running while the process exits is killed inside whatever it is doing; inside
a torch op that aborts the process ("terminate called without an active exception", exit -6), which
once replaced `drafter train`'s exit code 143 after a SIGTERM.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from drafter.prefetch import Prefetch


def _items(producing: threading.Event, closed: threading.Event):
    try:
        yield 0
        producing.set()  # the consumer stops while the producer works on the next item
        time.sleep(0.5)
        yield 1
        yield 2
    finally:
        closed.set()


def _producers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "under-test"]


def test_close_returns_only_after_the_producer_thread_has_ended():
    producing, closed = threading.Event(), threading.Event()
    ahead = Prefetch(_items(producing, closed), depth=1, name="under-test")
    it = iter(ahead)
    assert next(it) == 0
    assert producing.wait(10)
    it.close()  # the consumer leaves early: __iter__'s finally closes the Prefetch
    assert not _producers()  # joined, not merely told to stop
    assert closed.is_set()  # and the items' generator was closed (it releases what it holds)


def test_an_error_in_the_producer_reaches_the_consumer_and_the_thread_ends():
    def failing():
        yield 0
        raise ValueError("bad item")

    ahead = Prefetch(failing(), depth=2, name="under-test")
    with pytest.raises(ValueError, match="bad item"):
        list(ahead)
    assert not _producers()


def test_all_items_arrive_in_order():
    ahead = Prefetch(iter(range(50)), depth=3, name="under-test")
    assert list(ahead) == list(range(50))
    assert not _producers()


EXIT_WHILE_PACKING = """
import sys, torch
from drafter.prefetch import Prefetch
parts = [torch.randn(2_000_000) for _ in range(8)]
def items():
    while True:
        yield torch.cat(parts).sum()  # releases the GIL inside torch, like the trainer's packer
it = iter(Prefetch(items(), 2, "packer"))
next(it)
it.close()
sys.exit(143)
"""


def test_a_process_that_exits_right_after_closing_a_prefetch_keeps_its_exit_code():
    """The trainer's SIGTERM path in miniature: stop reading, exit 143. Before close() joined the
    producer, this aborted in nearly every run."""
    repo = Path(__file__).resolve().parents[2]
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", EXIT_WHILE_PACKING], cwd=repo, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 143 and "terminate called" not in done.stderr, done.stderr
