"""Progress for long start-up work: bars where the work has steps, a spinner where it has none.

Both write to stderr only when it is a terminal (tqdm's own rule), so logs, tests and CI stay
clean; SPECSERVE_PROGRESS=0 silences them, =1 forces them on.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def _disable() -> bool | None:
    flag = os.environ.get("SPECSERVE_PROGRESS")
    if flag == "0":
        return True
    if flag == "1":
        return False
    return None  # tqdm: off when stderr is not a terminal


def bar(iterable: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """Iterate with a progress bar."""
    yield from tqdm(iterable, desc=desc, total=total, unit=unit, disable=_disable(), leave=False, dynamic_ncols=True)


@contextlib.contextmanager
def spinner(desc: str) -> Iterator[None]:
    """Show `desc` and the elapsed time while the block runs (work with no steps to count)."""
    disable = _disable()
    t = tqdm(total=None, desc=desc, bar_format="{desc}: {elapsed}", disable=disable, leave=False)
    if t.disable:
        yield
        return
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.5):
            t.refresh()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        t.close()
