"""Running a test's risky call with a time limit, so a hang fails instead of blocking CI.

pytest-timeout is not a dependency; a daemon thread is enough for the calls tests
bound (an engine run that could spin, an interpreted kernel).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def call_within(seconds: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a daemon thread; its result, or its exception re-raised.

    Raises:
        AssertionError: fn still runs after `seconds` (it is left running, detached).
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as err:  # re-raised in the caller's thread
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds} s"
    if "error" in result:
        raise result["error"]
    return result["value"]
