"""Where widget decodes run: on the thread that owns MLX's streams, never on a comm thread.

MLX keeps its streams per thread: a graph built on one thread cannot be evaluated on another ("There is
no Stream(cpu, 0) in current thread"), and a Stepper builds its next step ahead. JupyterLab 4.6 sends
widget messages over kernel subshells, so ipykernel runs widget callbacks on a subshell thread. An Owner
remembers the thread that created it (a notebook cell: the kernel's main thread) and its event loop;
`submit` runs work there: at once when already on it, else queued on its loop, which runs it when the
running cell ends or, during an `await`, between two tokens.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


class Owner:
    """The thread (and event loop) that decodes; callbacks from other threads queue their work on it."""

    def __init__(self, on_error: Callable[[BaseException], None] | None = None):
        self.thread = threading.current_thread()
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:  # plain Python, no event loop: callbacks come on this thread
            self.loop = None
        self.on_error = on_error

    def here(self) -> bool:
        return threading.current_thread() is self.thread

    def submit(self, work: Callable[[], object]) -> None:
        """Run `work` on the owner thread: now when called there, else as soon as its loop is free."""
        if self.here():
            self._run(work)
        elif self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._run, work)
        else:
            raise RuntimeError("a widget callback came on another thread and the decoding thread has no event loop")

    def _run(self, work: Callable[[], object]) -> None:
        try:
            work()
        except Exception as error:  # a callback's error would otherwise vanish into the loop's log
            if self.on_error is None:
                raise
            self.on_error(error)
