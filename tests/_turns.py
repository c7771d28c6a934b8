"""Turns between a thread that estimates a model again and again and one that trains it.

PyTorch 2.13 can corrupt the heap when one thread reads a tensor's ``.grad`` while another
thread assigns it (``zero_grad``, FSDP2's post-backward): a PyTorch fault, with or without
koila (``docs/estimate.rst``, "Estimating a model that other threads use", and
``test_estimate_threads.py``). ``koila.estimate`` reads the gradients of what it lends, so
the tests that train beside estimates that repeat take turns on exactly that: an estimate
holds the lock while it runs, the training thread holds it only while it assigns gradients,
and everything else (the training's forward, the estimate's runs against the training's
forward) goes on at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Turns:
    """A lock between estimates and the code that assigns ``.grad``, in lockstep.

    Each estimate holds the lock while it runs; the training thread waits for one to be
    running before its forward (:meth:`beside`), so that forward and the estimate run at
    once, and takes the lock only to assign gradients (:meth:`writing`); the next estimate
    waits for that.

    Args:
        wait (float): seconds either thread waits for the other; never reached while both run.
    """

    def __init__(self, wait: float = 60.0) -> None:
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.written = threading.Event()
        self.wait = wait
        self.over = False

    @contextmanager
    def estimating(self) -> Iterator[None]:
        """Hold the lock for one estimate, then wait for the training thread to write once."""
        self.written.clear()
        with self.lock:
            self.running.set()
            try:
                yield
            finally:
                if not self.over:
                    self.running.clear()
        self.written.wait(self.wait)

    def beside(self) -> bool:
        """Wait until an estimate is running, or the estimates are over; return whether one is."""
        return self.running.wait(self.wait) and not self.over

    def end(self) -> None:
        """Say no estimate comes any more: the training thread waits for none."""
        self.over = True
        self.running.set()

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Hold the lock while this thread assigns gradients."""
        with self.lock:
            yield
        self.written.set()

    def finish(self) -> None:
        """Say the training thread writes no more: an estimate waiting for it goes on."""
        self.written.set()
