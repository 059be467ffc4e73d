"""Waiting in tests for a condition another thread or process makes true."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], what: str, timeout: float = 30.0, interval: float = 0.01) -> None:
    """Poll ``cond`` until it is truthy; fail the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)
