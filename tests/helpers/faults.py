"""Fault injection at real code boundaries: run an action when a function is entered.

A profile hook (this thread and threads started later) counts calls of functions whose
``co_qualname`` matches and fires ``action`` on the n-th one: a SIGKILL of this rank, a pause.
Nothing in the library is replaced; the process really dies or really waits there.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable


def _is_call_of(frame, qualname: str) -> bool:
    own = getattr(frame.f_code, "co_qualname", None)
    if own is not None:
        return own == qualname
    # Python 3.10 has no co_qualname: the function's name, and for a method the class of its self
    owner, _, name = qualname.rpartition(".")
    if frame.f_code.co_name != name:
        return False
    if not owner:
        return True
    instance = frame.f_locals.get("self")
    return instance is not None and any(cls.__qualname__ == owner for cls in type(instance).__mro__)


def on_call(qualname: str, action: Callable[[], None], nth: int = 1,
            when: Callable[[], bool] | None = None, this_thread: bool = True) -> None:
    """``when``: count only calls made while it returns True (say, once a step is reached).
    ``this_thread=False``: watch only threads started later (the caller's runs at full speed)."""
    count = 0
    lock = threading.Lock()

    def hook(frame, event, arg):
        nonlocal count
        if event == "call" and _is_call_of(frame, qualname) and (when is None or when()):
            with lock:
                count += 1
                fire = count == nth
            if fire:
                action()

    if this_thread:
        sys.setprofile(hook)
    threading.setprofile(hook)


def clear() -> None:
    sys.setprofile(None)
    threading.setprofile(None)


def sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def pause(seconds: float) -> Callable[[], None]:
    return lambda: time.sleep(seconds)
