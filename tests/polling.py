"""The one way the tests wait for something another thread or process does: poll, never sleep and hope."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(check: Callable[[], object], what: str, timeout: float = 20.0, interval: float = 0.02,
               gone: Callable[[], str | None] | None = None):
    """``check()``'s first true value. AssertionError naming ``what`` after ``timeout`` seconds, or at once when
    ``gone()`` says why it can never come (a process that exited, say)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        why = gone() if gone is not None else None
        if why:
            raise AssertionError(f"{why} before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"never saw {what} within {timeout:g} s")
        time.sleep(interval)
