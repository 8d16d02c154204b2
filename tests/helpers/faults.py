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


def on_call(qualname: str, action: Callable[[], None], nth: int = 1) -> None:
    count = 0
    lock = threading.Lock()

    def hook(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_qualname == qualname:
            with lock:
                count += 1
                fire = count == nth
            if fire:
                action()

    sys.setprofile(hook)
    threading.setprofile(hook)


def clear() -> None:
    sys.setprofile(None)
    threading.setprofile(None)


def sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def pause(seconds: float) -> Callable[[], None]:
    return lambda: time.sleep(seconds)
